"""Diagnostic: where a GPU feed's bandwidth goes on one MemmapDataset (was ``gpu_feed --probe``).

Prints, for one record size: pinned host-to-host copy bandwidth by thread count (the host's memory
bandwidth for a gather), ``read_batch`` with ``read="mmap"`` and ``read="pread"`` on 1 and 16
threads, and on CUDA ``read_batch(out=<cuda tensor>)`` (DMA straight from the page cache). It
writes nothing but its temporary dataset.

    python benchmarks/diagnostics/feed_probe.py                      # H200 machine
    python benchmarks/diagnostics/feed_probe.py --device cpu --gb 0.2
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

from gpu_feed import make_dataset, read_ceiling

import feedpipe

_GB = 1e9


def probe(ds: Any, bs: int, device: torch.device, seconds: float) -> None:
    """Diagnostics: host copy bandwidth by threads, and DMA straight from the page cache."""
    rec = ds[0].numel()
    big = bs * rec
    pin = device.type == "cuda"
    for w in (1, 4, 8, 16):  # pinned -> pinned copies: the host's memory bandwidth for a gather
        src = [torch.empty(big, dtype=torch.uint8, pin_memory=pin) for _ in range(w)]
        dst = [torch.empty(big, dtype=torch.uint8, pin_memory=pin) for _ in range(w)]
        for buf in src:
            buf.fill_(1)
        done = [0] * w
        deadline = time.perf_counter() + seconds / 2

        def copy(
            k: int, src: Any = src, dst: Any = dst, done: Any = done, dl: float = deadline
        ) -> None:
            while time.perf_counter() < dl:
                dst[k].copy_(src[k])
                done[k] += 1

        t0 = time.perf_counter()
        ts = [threading.Thread(target=copy, args=(k,)) for k in range(w)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        print(
            f"  probe: host memcpy {big >> 20} MiB, {w} threads: "
            f"{sum(done) * big / (time.perf_counter() - t0) / _GB:.2f} GB/s",
            flush=True,
        )
    for r in ("mmap", "pread"):
        for w in (1, 16):
            g = read_ceiling(ds if r == ds.read else _with_read(ds, r), bs, w, pin, seconds / 2)
            print(f"  probe: read_batch read={r} {w} threads: {g:.2f} GB/s", flush=True)
    if device.type != "cuda":
        return
    # MemmapDataset.read_batch(out=<cuda tensor>): DMA from the registered page cache
    gpu_out = torch.empty(bs, rec, dtype=torch.uint8, device=device)
    perm0 = np.random.default_rng(2).permutation(len(ds))
    nb = len(ds) // bs
    ds.read_batch(perm0[:bs], out=gpu_out)  # registers the maps (timed apart)
    torch.cuda.synchronize()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        ds.read_batch(perm0[(k % nb) * bs : (k % nb + 1) * bs], out=gpu_out)
        k += 1
    torch.cuda.synchronize()
    print(
        f"  probe: read_batch(out=cuda) 1 thread: {k * big / (time.perf_counter() - t0) / _GB:.2f}"
        " GB/s",
        flush=True,
    )
    ds.close()


def _with_read(ds: Any, r: str) -> Any:
    return feedpipe.MemmapDataset(ds.path, read=r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gb", type=float, default=4.0, help="dataset size, GB")
    p.add_argument("--batch-mb", type=float, default=16.0, help="batch size in MiB")
    p.add_argument("--seconds", type=float, default=3.0, help="timed run per measurement")
    p.add_argument("--record", type=int, default=262144, help="record size in bytes")
    p.add_argument("--dir", default=None, help="where to write (default /dev/shm if roomy)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu")
        return 2
    total = int(args.gb * _GB)
    shm = "/dev/shm"
    roomy = os.path.isdir(shm) and shutil.disk_usage(shm).free > 2.5 * total
    root = tempfile.mkdtemp(prefix="feed_probe_", dir=args.dir or (shm if roomy else None))
    try:
        ds = feedpipe.MemmapDataset(make_dataset(root, args.record, total))
        bs = max(1, int(args.batch_mb * 2**20) // args.record)
        ds.read_batch(list(range(bs)))  # open files once, before threads race to
        print(f"records {args.record} B: {len(ds)}, batch {bs}, device {device}", flush=True)
        probe(ds, bs, device, args.seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
