"""Small batches to the GPU: ``feedpipe.DataLoader(device="cuda")`` against torch's pinned
per-sample loader, batches of 64 records of 512 B, 8 KiB and 256 KiB, in the same run.

The baseline is ``torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=W,
pin_memory=True)`` over the same ``MemmapDataset`` indexed one sample at a time, each batch moved
with ``.to("cuda", non_blocking=True)``. feedpipe reads the same records with thread workers,
process workers and no workers. Every row runs whole epochs for ``--seconds`` after a warm-up
batch, repetitions interleaved, best kept; the ratio to torch is printed per row.

``--profile 512,8192`` adds, for those record sizes, a cProfile of the consuming thread over
feedpipe's thread-worker, process-worker and no-worker loops (where the per-batch fixed cost
goes) and the per-batch wall time.

    python benchmarks/small_batches.py                        # the H200 machine
    python benchmarks/small_batches.py --device cpu --gb 0.02 --seconds 0.5   # smoke check
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_feed import make_dataset, run_epochs

import feedpipe
from feedpipe.device.feed import GPUFeedWarning


def _epochs(loader: Any, move: Any, seconds: float, sync: Any, record: int) -> float:
    """Samples/s over whole epochs for about ``seconds`` (gpu_feed's timing, in samples)."""
    return run_epochs(loader, move, seconds, sync)[0] * 1e9 / record


def _torch(ds: Any, bs: int, workers: int, dev: torch.device) -> Any:
    return torch.utils.data.DataLoader(
        ds,
        batch_size=bs,
        shuffle=True,
        num_workers=workers,
        pin_memory=dev.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers else None,
    )


def _feed(ds: Any, bs: int, workers: int, kind: str, dev: torch.device) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return feedpipe.DataLoader(
            ds,
            batch_size=bs,
            shuffle=True,
            num_workers=workers,
            worker_type=kind,
            device=str(dev),
            persistent_workers=workers > 0,
        )


def _rows(ds: Any, args: argparse.Namespace, dev: torch.device) -> list[tuple[str, Any, Any]]:
    bs, w = args.batch, args.workers
    cuda = dev.type == "cuda"
    to_dev = (lambda b: b.to(dev, non_blocking=True)) if cuda else (lambda b: b)
    rows: list[tuple[str, Any, Any]] = [
        (f"torch pinned per-sample, {w} workers", _torch(ds, bs, w, dev), to_dev)
    ]
    for kind, workers in (("thread", w), ("process", w), ("thread", 0)):
        name = (
            f"feedpipe device={dev.type}, {workers} {kind} workers"
            if workers
            else (f"feedpipe device={dev.type}, no workers")
        )
        rows.append((name, _feed(ds, bs, workers, kind, dev), lambda b: b))
    return rows


def bench(ds: Any, rec: int, args: argparse.Namespace, dev: torch.device) -> None:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = _rows(ds, args, dev)
    best = [0.0] * len(rows)
    for _ in range(args.reps):
        for i, (_, loader, move) in enumerate(rows):
            best[i] = max(best[i], _epochs(loader, move, args.seconds, sync, rec))
    print(f"\n{rec} B records, batches of {args.batch}, {len(ds)} records:")
    for (name, _, _), sps in zip(rows, best, strict=True):
        gbps = sps * rec / 1e9
        print(f"  {name:<44} {sps:>12,.0f} samples/s {gbps:7.2f} GB/s  {sps / best[0]:5.2f}x torch")


def profile(ds: Any, args: argparse.Namespace, dev: torch.device) -> None:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for kind, workers in (("thread", args.workers), ("process", args.workers), ("thread", 0)):
        loader = _feed(ds, args.batch, workers, kind, dev)
        _epochs(loader, lambda b: b, 0.3, sync, ds.record_bytes)  # warm
        prof = cProfile.Profile()
        prof.enable()
        sps = _epochs(loader, lambda b: b, args.seconds, sync, ds.record_bytes)
        prof.disable()
        print(
            f"\nprofile, {ds.record_bytes} B, {workers} {kind} workers: {sps:,.0f} samples/s, "
            f"{1e6 * args.batch / sps:.1f} us per batch (consuming thread):"
        )
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile_lines)
        print("\n".join(s.getvalue().splitlines()[4:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--gb", type=float, default=0.5, help="dataset size per record size, GB")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--records", default="512,8192,262144")
    p.add_argument("--profile", default="", help="record sizes to profile (comma-separated)")
    p.add_argument("--profile-lines", type=int, default=22)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    root = tempfile.mkdtemp(dir=args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        for rec in [int(r) for r in args.records.split(",") if r]:
            ds = feedpipe.MemmapDataset(make_dataset(root, rec, int(args.gb * 1e9)))
            bench(ds, rec, args, dev)
            if str(rec) in args.profile.split(","):
                profile(ds, args, dev)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
