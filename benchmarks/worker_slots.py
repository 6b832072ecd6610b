"""Unchanged user datasets: feedpipe's process workers (collating into reused shared-memory
slots) against torch's DataLoader, same Dataset, same worker count, in the same run.

The dataset is what a user writes: a per-sample ``__getitem__`` over ``np.memmap`` rows.
With ``--device cuda`` both loaders deliver device batches: torch with ``pin_memory=True`` and
``.to(device, non_blocking=True)``, feedpipe with ``device="cuda"`` (slots page-locked once,
one DMA per batch). On the CPU both deliver unpinned host batches.

``--lease`` measures instead what the slots' lease costs per batch
(:mod:`feedpipe.loader.slot_lease`): handing a batch of ``L`` leaves out as tensors whose storages
hold the slot for their whole life (what ``Slots.resolve`` does), against the same views without
the storage's hold (the slots before it: a ``share_memory_()`` then let the slot be reused under
an earlier ``.numpy()``), interleaved in short rounds in the same run, each the least disturbed
of its rounds (on a shared machine a preempted round says nothing of the code); and what a
``share_memory_()`` of a batch costs: a slot batch (moved: one copy, on that path only), a heap
tensor (torch moves it the same way) and a batch of torch's own loader (already shared: nothing).

    python benchmarks/worker_slots.py [--device cuda] [--records 8192,262144] [--workers 4]
    python benchmarks/worker_slots.py --lease [--records 8192,262144]

``--malloc warm`` starts every loader from the allocator state of a process that has run a
while (``warm_malloc``); the default is a fresh process's, as in earlier rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

import feedpipe
from feedpipe.loader.slot_lease import Lease, leased_tensors


class MemmapRows(tud.Dataset):  # type: ignore[type-arg]
    """A user's map-style dataset: one row of a .npy file per sample."""

    def __init__(self, path: str, rows: int, record: int) -> None:
        self.path, self.rows, self.record = path, rows, record
        self.mm: np.memmap | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(self.rows, self.record))
        return torch.from_numpy(np.array(self.mm[i]))


def _consume(loader: Any, device: str, epochs: int) -> float:
    """Bytes per second over ``epochs`` passes (after one warm-up pass)."""
    total = 0
    for e in range(epochs + 1):
        if e == 1:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            total = 0
        for batch in loader:
            if device == "cuda" and not batch.is_cuda:
                batch = batch.to(device, non_blocking=True)
            total += batch.numel() * batch.element_size()
    if device == "cuda":
        torch.cuda.synchronize()
    return total / (time.perf_counter() - t0)


def warm_malloc() -> None:
    """Put this process's allocator where a training process's is before its loaders fork.

    glibc raises its mmap threshold (and its heap trim threshold, to twice that) the first time
    a block above the threshold is freed, up to 32 MiB, and a worker process inherits both at
    fork. A fresh benchmark process has freed none, so a loader whose workers fork first reads
    each 256 KiB sample through a new ``mmap`` (a page fault per 4 KiB) while one forked after
    another loader ran does not: the ratios would depend on the loaders' order. One 31 MiB block
    allocated and freed here puts every loader in the state of a process that has run a while
    (``--malloc warm``; the default ``cold`` keeps a fresh process's, as in earlier rounds)."""
    np.ones(31 << 20, dtype=np.uint8)


def run(record: int, workers: int, device: str, data_mb: int, epochs: int) -> dict[str, float]:
    rows = max(256, data_mb * 2**20 // record)
    batch = max(1, min(64, (8 * 2**20) // record))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rows.bin")
        np.random.default_rng(0).integers(0, 255, rows * record, dtype=np.uint8).tofile(path)
        ds = MemmapRows(path, rows, record)
        kw: dict[str, Any] = {"batch_size": batch, "num_workers": workers, "shuffle": True}
        kw["persistent_workers"] = True
        if device == "cuda":
            torch_loader = tud.DataLoader(ds, pin_memory=True, **kw)
            ours = feedpipe.DataLoader(ds, device="cuda", **kw)
        else:
            torch_loader = tud.DataLoader(ds, **kw)
            ours = feedpipe.DataLoader(ds, **kw)
        theirs = _consume(torch_loader, device, epochs)
        mine = _consume(ours, device, epochs)
        os.environ["FEEDPIPE_WORKER_SLOTS"] = "0"  # the same loader on torch's shared memory
        try:
            off_loader = (
                feedpipe.DataLoader(ds, device="cuda", **kw)
                if device == "cuda"
                else (feedpipe.DataLoader(ds, **kw))
            )
            off = _consume(off_loader, device, epochs)
            del off_loader
        finally:
            del os.environ["FEEDPIPE_WORKER_SLOTS"]
        info = ours.worker_slots or {}
        # the same dataset on thread workers (issue 28 item 4)
        on_device: dict[str, Any] = {"device": "cuda"} if device == "cuda" else {}
        threads_loader = feedpipe.DataLoader(ds, worker_type="thread", **on_device, **kw)
        threads = _consume(threads_loader, device, epochs)
        del torch_loader, ours, threads_loader
    return {
        "torch_GBps": theirs / 1e9,
        "feedpipe_GBps": mine / 1e9,
        "ratio": mine / theirs,
        "off_ratio": off / theirs,
        "thread_ratio": threads / theirs,
        "in_slots": info.get("batches_in_slots", 0),
        "fallback": info.get("batches_fallback", 0),
    }


class _Region(np.ndarray):  # type: ignore[type-arg]
    lease: Any = None


def _views_without_storage_lease(array: np.ndarray, layout: list[Any], lease: Lease) -> list[Any]:
    """The baseline: ``leased_tensors`` less the hold of each storage on the lease."""
    lo = layout[0][0]
    region = array[lo:].view(_Region)
    region.lease = lease
    out = []
    for off, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(torch.from_numpy(region[off - lo : off - lo + nbytes]).view(dtype).view(shape))
    return out


def _views_before(array: np.ndarray, layout: list[Any], lease: Lease) -> list[Any]:
    """The views as ``Slots.resolve`` made them before the storage lease (its code as it was)."""
    lo = layout[0][0]
    hi = max(off + int(np.prod(shape)) * dtype.itemsize for off, dtype, shape in layout)
    region = array[lo:hi].view(_Region)
    region.lease = lease
    out = []
    for off, dtype, shape in layout:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = torch.from_numpy(region[off - lo : off - lo + nbytes])
        out.append(raw.view(dtype).view(shape))
    return out


def _ns_per_call(fn: Any, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def lease_cost(record: int, leaves: int, rounds: int = 300, n: int = 50) -> dict[str, float]:
    """ns per batch of ``leaves`` leaves (rows of ``record`` bytes, batches as in :func:`run`),
    with and without the storage lease: the two interleaved, the least of ``rounds`` each."""
    rows = max(1, min(64, (8 * 2**20) // record))
    leaf = rows * record
    array = np.zeros(4096 + leaves * leaf, np.uint8)
    flags = np.zeros(1, np.uint8)
    layout = [(4096 + j * leaf, torch.uint8, (rows, record)) for j in range(leaves)]
    variants = {
        "lease": lambda: leased_tensors(array, layout, Lease(None, flags, 0)),
        "views": lambda: _views_without_storage_lease(array, layout, Lease(None, flags, 0)),
        "before": lambda: _views_before(array, layout, Lease(None, flags, 0)),
    }
    got: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            got[name].append(_ns_per_call(fn, n))
    out = {k: float(np.min(v)) for k, v in got.items()}
    return {**out, "ratio": out["lease"] / out["views"], "extra_ns": out["lease"] - out["views"]}


def share_cost(record: int, rounds: int = 15) -> dict[str, float]:
    """us per ``share_memory_()`` of a batch as in :func:`run` (one leaf): a slot batch, a heap
    tensor of the same bytes, and an already shared one (a batch of torch's own loader); the
    median of ``rounds`` (what a shared batch costs on average: one copy, a new segment)."""
    rows = max(1, min(64, (8 * 2**20) // record))
    array = np.random.default_rng(0).integers(0, 255, 4096 + rows * record, dtype=np.uint8)
    flags = np.zeros(1, np.uint8)
    layout = [(4096, torch.uint8, (rows, record))]
    shared = torch.zeros(rows, record, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    makers: dict[str, Callable[[], torch.Tensor]] = {
        "slot": lambda: leased_tensors(array, layout, Lease(None, flags, 0))[0],
        "heap": lambda: torch.zeros(rows, record, dtype=torch.uint8),
        "torch_batch": lambda: shared,
    }
    got: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            t = make()
            t0 = time.perf_counter_ns()
            t.share_memory_()  # type: ignore[no-untyped-call]
            got[name].append((time.perf_counter_ns() - t0) / 1e3)
            del t
    return {k: float(np.median(v)) for k, v in got.items()}


def main_lease(records: list[int]) -> None:
    print(f"lease cost per batch, torch={torch.__version__}, cpus={os.cpu_count()}")
    for record in records:
        for leaves in (1, 4):
            c = lease_cost(record, leaves)
            print(
                f"record {record:>7} B, {leaves} leaves: with the storage lease "
                f"{c['lease'] / 1e3:.2f} us, without {c['views'] / 1e3:.2f} us, ratio "
                f"{c['ratio']:.2f}x (+{c['extra_ns']:.0f} ns per batch); the views before this "
                f"lease {c['before'] / 1e3:.2f} us (ratio {c['lease'] / c['before']:.2f}x)",
                flush=True,
            )
        s = share_cost(record)
        print(
            f"record {record:>7} B: share_memory_() of a slot batch {s['slot']:.0f} us, "
            f"of a heap tensor {s['heap']:.0f} us (ratio {s['slot'] / s['heap']:.2f}x), "
            f"of torch's own batch {s['torch_batch']:.1f} us",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--records", default="8192,262144")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--data-mb", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lease", action="store_true", help="the per-batch cost of the slot lease")
    ap.add_argument("--malloc", default="cold", choices=["warm", "cold"], help="see warm_malloc")
    a = ap.parse_args()
    if a.malloc == "warm":
        warm_malloc()
    if a.lease:
        main_lease([int(r) for r in a.records.split(",")])
        return
    print(
        f"device={a.device} workers={a.workers} malloc={a.malloc} torch={torch.__version__}"
        + (f" gpu={torch.cuda.get_device_name()}" if a.device == "cuda" else "")
    )
    for record in (int(r) for r in a.records.split(",")):
        r = run(record, a.workers, a.device, a.data_mb, a.epochs)
        print(
            f"record {record:>7} B: torch {r['torch_GBps']:.2f} GB/s, feedpipe "
            f"{r['feedpipe_GBps']:.2f} GB/s, ratio {r['ratio']:.2f}x "
            f"(slots off: {r['off_ratio']:.2f}x; thread workers: {r['thread_ratio']:.2f}x) "
            f"(batches in slots {r['in_slots']}, fallback {r['fallback']})",
            flush=True,
        )


if __name__ == "__main__":
    main()
