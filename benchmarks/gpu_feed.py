"""GPU feed: GB/s delivered to the device, torch DataLoader + ``.cuda(non_blocking=True)`` versus
``feedpipe.DataLoader(device=...)``, on MemmapDataset with 256 KiB and 8 KiB records.

Both loaders read the same shuffled dataset (written to /dev/shm or a temp dir, read once to
warm the page cache) in the same run; each configuration runs whole epochs for ``--seconds``
after a warm-up batch. Then a synthetic GPU step (``torch.cuda._sleep``, or ``time.sleep`` on the
CPU) that needs half the measured feed bandwidth shows how long the device waited for input.

    python benchmarks/gpu_feed.py                            # H200 machine, writes docs
    python benchmarks/gpu_feed.py --device cpu --gb 0.2      # smoke check anywhere
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import machine, write_section

import feedpipe
from feedpipe.device.feed import GPUFeedWarning

_GB = 1e9


@dataclass
class Result:
    name: str
    workers: int
    gbps: float
    batches: int


def make_dataset(root: str, record_bytes: int, total_bytes: int) -> str:
    """Write ``total_bytes`` of ``record_bytes`` uint8 records and read them once (page cache)."""
    path = os.path.join(root, f"rec{record_bytes}")
    n = max(1, total_bytes // record_bytes)
    block = np.random.default_rng(0).integers(
        0, 256, (max(1, (32 << 20) // record_bytes), record_bytes), dtype=np.uint8
    )
    with feedpipe.MemmapWriter(path, shape=(record_bytes,), dtype="uint8", overwrite=True) as w:
        done = 0
        while done < n:
            k = min(len(block), n - done)
            w.append_batch(block[:k])
            done += k
    buf = bytearray(64 << 20)
    for dirpath, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(dirpath, f), "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    return path


def run_epochs(
    loader: Any, to_device: Callable[[Any], Any], seconds: float, sync: Callable[[], None]
) -> tuple[float, int]:
    """GB/s over whole epochs for about ``seconds``, timed from after the first batch."""
    nbytes = batches = 0
    start: float | None = None
    while True:
        for batch in loader:
            b = to_device(batch)
            if start is None:
                sync()
                start = time.perf_counter()
                continue
            nbytes += b.numel() * b.element_size()
            batches += 1
        sync()
        if start is not None and time.perf_counter() - start >= seconds:
            break
    return nbytes / (time.perf_counter() - start) / _GB, batches


def bench_torch(ds: Any, bs: int, workers: int, device: torch.device, seconds: float) -> Result:
    cuda = device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=bs,
        shuffle=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers else None,
    )
    gbps, n = run_epochs(
        loader,
        (lambda b: b.to(device, non_blocking=True)) if cuda else (lambda b: b),
        seconds,
        torch.cuda.synchronize if cuda else (lambda: None),
    )
    return Result("torch DataLoader", workers, gbps, n)


def feed_loader(ds: Any, bs: int, workers: int, device: torch.device, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return feedpipe.DataLoader(
            ds,
            batch_size=bs,
            shuffle=True,
            num_workers=workers,
            worker_type="thread",
            device=str(device),
            prefetch=2,
            **kw,
        )


def bench_feed(
    ds: Any, bs: int, workers: int, device: torch.device, seconds: float, *, direct: bool
) -> Result:
    cuda = device.type == "cuda"
    loader = feed_loader(ds, bs, workers, device, direct=direct if cuda else None)
    if cuda and direct:
        assert loader._direct is not None, "the direct path was not taken"
    gbps, n = run_epochs(
        loader, lambda b: b, seconds, torch.cuda.synchronize if cuda else (lambda: None)
    )
    return Result("direct" if direct else "ring", workers, gbps, n)


def dma_ceiling(ds: Any, bs: int, device: torch.device, seconds: float) -> float:
    """GB/s of ``ds.read_batch(out=<device tensor>)`` alone on one thread (shuffled batches)."""
    rec = ds[0].numel()
    out = [torch.empty(bs, rec, dtype=torch.uint8, device=device) for _ in range(2)]
    perm = np.random.default_rng(2).permutation(len(ds))
    nb = len(ds) // bs
    ds.read_batch(perm[:bs], out=out[0])  # registers the maps (not timed)
    torch.cuda.synchronize()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ds.read_batch(perm[(k % nb) * bs : (k % nb + 1) * bs], out=out[k % 2])
        k += 1
    torch.cuda.synchronize()
    return k * bs * rec / (time.perf_counter() - t0) / _GB


def read_ceiling(ds: Any, bs: int, workers: int, pin: bool, seconds: float) -> float:
    """GB/s of ``ds.read_batch`` alone: ``workers`` threads, each into its own (pinned) buffer."""
    rec = ds[0].numel()
    perm = np.random.default_rng(1).permutation(len(ds))
    nb = len(ds) // bs
    bufs = [torch.empty(bs, rec, dtype=torch.uint8, pin_memory=pin) for _ in range(workers)]
    done = [0] * workers
    deadline = time.perf_counter() + seconds

    def work(w: int) -> None:
        for k, s in enumerate(range(w, 10 * nb, workers)):
            if k % 4 == 0 and time.perf_counter() > deadline:
                return
            ds.read_batch(perm[(s % nb) * bs : (s % nb + 1) * bs], out=bufs[w])
            done[w] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) * bs * rec / (time.perf_counter() - t0) / _GB


def synthetic_step(
    ds: Any,
    bs: int,
    workers: int,
    device: torch.device,
    *,
    need_gbps: float,
    seconds: float,
    direct: bool,
) -> dict[str, float]:
    """A fake training step that consumes ``need_gbps``; returns the share of time the device
    idled for input."""
    cuda = device.type == "cuda"
    batch_bytes = bs * ds[0].numel()
    step_s = batch_bytes / (need_gbps * _GB)
    if cuda:
        # calibrate torch.cuda._sleep cycles -> seconds with events
        cycles = 1_000_000
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        per_cycle = e0.elapsed_time(e1) / 1000 / (20 * cycles)
        cycles = max(1, int(step_s / per_cycle))
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        step_s = e0.elapsed_time(e1) / 1000  # the step as the GPU really runs it

        def step(b: Any) -> None:
            torch.cuda._sleep(cycles)
            b.view(-1)[:1].sum()  # the step reads its input
    else:

        def step(b: Any) -> None:
            time.sleep(step_s)
            b.view(-1)[:1].sum()

    loader = feed_loader(ds, bs, workers, device, direct=direct if cuda else None)
    steps, host_wait = 0, 0.0
    marks: list[tuple[Any, Any]] = []  # CUDA events around each step: the gaps are idle time
    t_start: float | None = None
    deadline = time.perf_counter() + seconds
    it = iter(loader)  # one epoch (steady state), at most ``seconds``
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        if t_start is None:  # warm-up batch: start the clocks after it
            if cuda:
                torch.cuda.synchronize()
            t_start = time.perf_counter()
            continue
        host_wait += time.perf_counter() - t0
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()  # after the wait for this batch's copy (enqueued by next())
            step(b)
            e1.record()
            marks.append((e0, e1))
        else:
            step(b)
        steps += 1
    if cuda and marks:
        marks[-1][1].synchronize()
        total = marks[0][0].elapsed_time(marks[-1][1]) / 1000
        busy = sum(e0.elapsed_time(e1) for e0, e1 in marks) / 1000
        idle = max(0.0, total - busy)
    else:
        total = time.perf_counter() - (t_start or 0.0)
        idle = max(0.0, total - steps * step_s)
    floor = 0.0
    if cuda and steps:  # the same loop over one batch already on the device: launch gaps only
        b = next(iter(loader))
        torch.cuda.synchronize()
        marks = []
        for _ in range(steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(b)
            e1.record()
            marks.append((e0, e1))
        marks[-1][1].synchronize()
        span = marks[0][0].elapsed_time(marks[-1][1]) / 1000
        busy = sum(e0.elapsed_time(e1) for e0, e1 in marks) / 1000
        floor = 100 * max(0.0, span - busy) / span
    return {
        "floor_pct": floor,
        "step_ms": step_s * 1e3,
        "need_gbps": batch_bytes / step_s / _GB,
        "steps": steps,
        "total_s": total,
        "idle_pct": 100 * idle / total if total else 0.0,
        "host_wait_pct": 100 * host_wait / total if total else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gb", type=float, default=4.0, help="dataset size per record size, GB")
    p.add_argument("--batch-mb", type=float, default=16.0, help="batch size in MiB")
    p.add_argument("--seconds", type=float, default=3.0, help="timed run per configuration")
    p.add_argument("--torch-workers", default="0,4,8")
    p.add_argument("--direct-workers", default="0,1", help="thread workers, direct DMA path")
    p.add_argument("--ring-workers", default="4,8", help="thread workers, pinned ring path")
    p.add_argument("--steps", default="10,18,30", help="synthetic steps: GB/s each one consumes")
    p.add_argument("--records", default="262144,8192", help="record sizes in bytes")
    p.add_argument("--dir", default=None, help="where to write (default /dev/shm if roomy)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu")
        return 2
    total = int(args.gb * _GB)
    root = args.dir
    if root is None:
        shm = "/dev/shm"
        roomy = os.path.isdir(shm) and shutil.disk_usage(shm).free > 2.5 * total * 2
        root = tempfile.mkdtemp(prefix="gpu_feed_", dir=shm if roomy else None)
    workers = {
        "torch": [int(x) for x in args.torch_workers.split(",")],
        "direct": [int(x) for x in args.direct_workers.split(",")] if cuda else [],
        "ring": [int(x) for x in args.ring_workers.split(",")],
    }
    records = [int(x) for x in args.records.split(",")]
    print(f"# {machine()}\n# data in {root}, {args.gb} GB per record size, device {device}")
    rows: list[str] = []
    detail: list[str] = []
    synth: list[dict[str, float]] = []
    try:
        for rec in records:
            t0 = time.perf_counter()
            path = make_dataset(root, rec, total)
            ds = feedpipe.MemmapDataset(path)
            bs = max(1, int(args.batch_mb * 2**20) // rec)
            ds.read_batch(list(range(bs)))  # open files once, before threads race to
            print(
                f"records {rec} B: {len(ds)} written+warmed in {time.perf_counter() - t0:.1f}s,"
                f" batch {bs}"
            )
            results: dict[str, list[Result]] = {"torch": [], "direct": [], "ring": []}
            for kind, ws in workers.items():
                for w in ws:
                    if kind == "torch":
                        r = bench_torch(ds, bs, w, device, args.seconds)
                    else:
                        r = bench_feed(ds, bs, w, device, args.seconds, direct=kind == "direct")
                    results[kind].append(r)
                    print(f"  {kind} w={w}: {r.gbps:.2f} GB/s ({r.batches} batches)", flush=True)
            best = {k: max(v, key=lambda r: r.gbps) for k, v in results.items() if v}
            bt = best["torch"]
            ring_alone = read_ceiling(ds, bs, best["ring"].workers, cuda, args.seconds)
            size = f"{rec // 1024} KiB" if rec >= 1024 else f"{rec} B"
            cells = []
            direct_default = "direct" in best and rec >= 2048  # feedpipe.device.direct._AUTO_MIN

            def cell(r: Result, alone: float, bold: bool, base: float = bt.gbps) -> str:
                star = "**" if bold else ""
                return (
                    f"{star}{r.gbps:.2f}{star} ({r.workers} thr; alone {alone:.2f}) "
                    f"{star}{r.gbps / base:.1f}x{star}"
                )

            if "direct" in best:
                alone = dma_ceiling(ds, bs, device, args.seconds)
                cells.append(cell(best["direct"], alone, direct_default))
            else:
                cells.append("n/a (no CUDA)")
            cells.append(cell(best["ring"], ring_alone, not direct_default))
            print(f"  best: {size}: torch {bt.gbps:.2f}; " + "; ".join(cells), flush=True)
            rows.append(
                f"| {size} | {bs} | {bt.gbps:.2f} ({bt.workers} workers) | "
                + " | ".join(cells)
                + " |"
            )
            detail.append(
                f"{size}: "
                + ", ".join(
                    f"{k} w={x.workers} {x.gbps:.2f}" for k, v in results.items() for x in v
                )
            )
            if rec == max(records):
                fast = best.get("direct", best["ring"])
                # the best worker count, and one worker thread (what num_workers >= 1 gets)
                for w in sorted({fast.workers, 1}):
                    for need in (float(x) for x in args.steps.split(",")):
                        out = synthetic_step(
                            ds,
                            bs,
                            w,
                            device,
                            need_gbps=need if cuda else min(need, fast.gbps / 2),
                            seconds=args.seconds,
                            direct="direct" in best,
                        )
                        out["record"] = rec
                        out["workers"] = w
                        synth.append(out)
                        print(f"  synthetic step: {out}", flush=True)
            ds.close()
            shutil.rmtree(path, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    cmd = "python benchmarks/gpu_feed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        f"Machine: {machine()}  ",
        f"Command: `{cmd.strip()}` (device {device}; {args.gb} GB per record size in the page "
        f"cache, shuffled, batches of {args.batch_mb:g} MiB, {args.seconds:g} s per configuration"
        ", timed after a warm-up batch). GB/s = bytes delivered to the device per second; "
        "each cell is the best worker count, with `read_batch` alone beside it; bold: the path "
        "`DataLoader(device=...)` takes by default for that record size.",
        "",
        "| record | batch | torch DataLoader(pin_memory) + .to(device, non_blocking), best "
        "| feedpipe DataLoader(device): direct path from the page cache (the default from 2 KiB "
        "records; copy engines from 64 KiB, a gather kernel below); read_batch(out=cuda) alone "
        "on 1 thread; ratio to torch "
        "| feedpipe DataLoader(device): pinned ring, thread workers (the default below 2 KiB;"
        " direct=False); read_batch into pinned memory alone; ratio to torch |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "All configurations (GB/s): " + "; ".join(detail) + ".",
    ]
    for sy in synth:
        md += [
            "",
            f"Synthetic step on {int(sy['record']) // 1024} KiB records "
            f"({int(sy['workers'])} workers): {sy['step_ms']:.2f} ms per batch (consumes "
            f"{sy['need_gbps']:.1f} GB/s), {int(sy['steps'])} steps in {sy['total_s']:.2f} s: "
            f"the device was idle for input {sy['idle_pct']:.1f}% of the time, measured as "
            + (
                "the gaps between CUDA events recorded around each step"
                if cuda
                else "wall time minus step time"
            )
            + f" (host time inside next(): {sy['host_wait_pct']:.1f}%; the same loop over a batch "
            f"already on the device: {sy['floor_pct']:.1f}% idle, launch gaps).",
        ]
    text = "\n".join(md)
    print(text)
    if not args.no_write and cuda:
        write_section("gpu_feed", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
