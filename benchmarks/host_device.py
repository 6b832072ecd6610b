"""A loader with ``device="cpu"`` against the same loader without ``device``, in one run.

``device = "cuda" if torch.cuda.is_available() else "cpu"`` is how scripts pick their device; on
a machine without a GPU a feedpipe loader given that ``"cpu"`` must cost nothing. Three loaders
read the same ``MemmapDataset`` (fixed int32 records, shuffled, page cache warm, batches of 64):

- ``none``: ``feedpipe.DataLoader(ds, ...)`` (the baseline);
- ``cpu``: the same with ``device="cpu"`` (host batches by the baseline's path);
- ``ring``: the same with ``FEEDPIPE_HOST_RING=1`` (the feed's ring in host memory: how every
  CPU ``device`` ran before 2026-12-07, two more copies of each batch).

Repetitions are interleaved; samples/s by the wall clock, medians, and each ratio against
``none`` with its spread. Target: ``cpu`` >= 0.95x ``none`` at every size.

    python benchmarks/host_device.py            # 512 B, 8 KiB, 256 KiB; 0 and 2 thread workers
    python benchmarks/host_device.py --write    # the docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import DataLoader, MemmapDataset, MemmapWriter
from feedpipe.device.feed import GPUFeedWarning

VARIANTS = ("none", "cpu", "ring")


def _write(tmp: Path, rb: int, mb: int) -> MemmapDataset:
    n, width = max(256, (mb << 20) // rb), rb // 4
    with MemmapWriter(tmp / f"ds-{rb}", shape=(width,), dtype="int32") as w:
        for lo in range(0, n, 4096):
            m = min(4096, n - lo)
            w.append_batch(np.random.default_rng(lo).integers(0, 1 << 30, (m, width), np.int32))
    return MemmapDataset(tmp / f"ds-{rb}")


def _loader(ds: Any, variant: str, workers: int, batch: int) -> Any:
    kw: dict[str, Any] = {} if variant == "none" else {"device": "cpu"}
    if variant == "ring":
        os.environ["FEEDPIPE_HOST_RING"] = "1"  # read when the loader is made
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GPUFeedWarning)
            return DataLoader(
                ds, batch_size=batch, shuffle=True, num_workers=workers, worker_type="thread", **kw
            )
    finally:
        os.environ.pop("FEEDPIPE_HOST_RING", None)


def _rate(loader: Any, seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for b in loader:
            done += len(b)
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", default="512,8192,262144")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mb", type=int, default=32, help="MiB of records per record size")
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the docs section")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    print(f"load average {load:.1f} at the start; {os.cpu_count()} cores")
    rows: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-host-device-"))
    try:
        for rb in (int(x) for x in args.records.split(",")):
            ds = _write(tmp, rb, args.mb)
            for workers in args.workers:
                loaders = {v: _loader(ds, v, workers, args.batch) for v in VARIANTS}
                for ld in loaders.values():  # warm: page cache, workers, the ring
                    _rate(ld, 0.1)
                rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for _ in range(args.reps):
                    for v, ld in loaders.items():
                        rates[v].append(_rate(ld, args.seconds))
                rows.append(_row(rb, workers, rates))
            ds.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.write:
        write_section(
            "host_device",
            '## `device="cpu"`: host batches at the speed of no `device`\n\n'
            f"{machine()}; load average {load:.1f} at the start. Command: "
            "`python benchmarks/host_device.py --write`. `feedpipe.DataLoader` over one "
            f"`MemmapDataset`, batches of {args.batch}, shuffled, page cache warm; samples/s, "
            "medians of interleaved repetitions; ratio against no `device` (in brackets: each "
            "repetition's). `ring`: `FEEDPIPE_HOST_RING=1`, the path every CPU `device` took "
            "before 2026-12-07. Target: `cpu` >= 0.95x.\n\n"
            '| record | thread workers | no device | `device="cpu"` | ratio | ring | ratio |\n'
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows),
        )


def _row(rb: int, workers: int, rates: dict[str, list[float]]) -> str:
    """Print one line; return its table row."""
    base = rates["none"]
    cells, text = [f"{statistics.median(base):,.0f}"], []
    for v in ("cpu", "ring"):
        pairs = [a / b for a, b in zip(rates[v], base, strict=True)]
        ratio = statistics.median(rates[v]) / statistics.median(base)
        cells += [f"{statistics.median(rates[v]):,.0f}"]
        cells += [f"{ratio:.2f} ({min(pairs):.2f}-{max(pairs):.2f})"]
        text.append(f"{v} {statistics.median(rates[v]):,.0f} ({ratio:.2f}x)")
    print(f"{rb:>7} B, {workers} workers: none {statistics.median(base):,.0f}; " + "; ".join(text))
    return f"| {rb:,} B | {workers} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
