"""Diagnostic (issue 28 item 4): thread workers over an unchanged per-sample ``Dataset`` with
``device="cuda"`` against torch's pinned loader, using only the public API, so that the same
script runs against an older checkout (``PYTHONPATH=<old tree>``) to find a regression.

    python benchmarks/diagnostics/thread_regress.py --records 262144 --workers 8

Every loader starts from the allocator state of a process that has run a while (``warm_malloc``;
``--malloc cold`` for a fresh one, where the figures depend on which loader forks first).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

import feedpipe


class Rows(tud.Dataset):  # type: ignore[type-arg]
    """A user's dataset: one row of a raw file per sample, copied out of a memmap."""

    def __init__(self, path: str, rows: int, record: int) -> None:
        self.path, self.rows, self.record = path, rows, record
        self.mm: Any = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(self.rows, self.record))
        return torch.from_numpy(np.array(self.mm[i]))


def warm_malloc() -> None:
    """Put this process's allocator where a training process's is before its loaders fork.

    glibc raises its mmap threshold (and its heap trim threshold, to twice that) the first time
    a block above the threshold is freed, up to 32 MiB, and a worker process inherits both at
    fork. A fresh benchmark process has freed none, so a loader whose workers fork first reads
    each 256 KiB sample through a new ``mmap`` (a page fault per 4 KiB) while one forked after
    another loader ran does not: the ratios would depend on the loaders' order. One 31 MiB block
    allocated and freed here puts every loader in the state of a process that has run a while
    (``--malloc cold``: the old behaviour)."""
    np.ones(31 << 20, dtype=np.uint8)


def consume(loader: Any, dev: str, seconds: float) -> float:
    """GB/s over whole epochs for about ``seconds`` (after one batch)."""
    total, t0 = 0, None
    while True:
        for b in loader:
            if not b.is_cuda and dev == "cuda":
                b = b.to(dev, non_blocking=True)
            if t0 is None:
                torch.cuda.synchronize() if dev == "cuda" else None
                t0 = time.perf_counter()
                continue
            total += b.numel()
        torch.cuda.synchronize() if dev == "cuda" else None
        if t0 is not None and time.perf_counter() - t0 > seconds:
            return total / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=262144)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--label", default=os.environ.get("PYTHONPATH", "").split(":")[0])
    p.add_argument("--malloc", default="warm", choices=["warm", "cold"], help="see warm_malloc")
    a = p.parse_args()
    if a.malloc == "warm":
        warm_malloc()
    rows = a.mb * 2**20 // a.records
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        path = os.path.join(d, "rows.bin")
        np.random.default_rng(0).integers(0, 255, rows * a.records, dtype=np.uint8).tofile(path)
        ds = Rows(path, rows, a.records)
        kw: dict[str, Any] = dict(
            batch_size=a.batch, shuffle=True, num_workers=a.workers, persistent_workers=True
        )
        cuda = {"device": a.device} if a.device == "cuda" else {}
        loaders = {
            "torch": tud.DataLoader(ds, pin_memory=a.device == "cuda", **kw),
            "thread": feedpipe.DataLoader(ds, worker_type="thread", **cuda, **kw),
            "process": feedpipe.DataLoader(ds, worker_type="process", **cuda, **kw),
        }
        best = {k: 0.0 for k in loaders}
        for _ in range(2):
            for k, loader in loaders.items():
                best[k] = max(best[k], consume(loader, a.device, a.seconds))
    t = best["torch"]
    print(
        f"[{a.label}] {a.records} B x{a.batch}, {a.workers} workers, malloc {a.malloc}: "
        f"torch {t:.2f} GB/s; "
        f"thread {best['thread']:.2f} ({best['thread'] / t:.2f}x); "
        f"process {best['process']:.2f} ({best['process'] / t:.2f}x)",
        flush=True,
    )


if __name__ == "__main__":
    main()
