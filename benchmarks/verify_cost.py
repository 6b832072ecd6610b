"""What ``MemmapDataset(verify="first-use")`` (the default) costs against ``verify=False``.

With the default, every shard file is checked against its index CRC32C once, before its first
record is served (``feedpipe.datasets._shard_guard``); a corrupted shard is then an error naming
it instead of wrong records. The cost falls on the first epoch of a freshly opened dataset.

For each record size (512 B, 8 KiB, 256 KiB by default) one fixed-record dataset of ``--mib``
MiB in shards of ``--shard-mib`` MiB is written, then read as shuffled batches of ``--batch-kib``
KiB (``read_batch``), from the page cache, in the same run and interleaved:

  (a) epoch 1 of a freshly opened dataset, ``verify=False`` (the baseline);
  (b) epoch 1 of a freshly opened dataset, ``verify="first-use"`` (every shard checked once);
  (c) epoch 2 of each (every shard already checked: the steady state), verified against not.

Best of ``--reps``; prints each throughput and the ratios (b)/(a) and, for epoch 2,
verified/unverified.

    python benchmarks/verify_cost.py                 # quick (64 MiB per size)
    python benchmarks/verify_cost.py --mib 1024 --reps 5
    python benchmarks/verify_cost.py --write         # also write docs/benchmarks.md's section
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import MemmapDataset, MemmapWriter

SIZES = (512, 8 << 10, 256 << 10)


def _write(path: Path, record: int, mib: int, shard_mib: int) -> int:
    n = max(8, (mib << 20) // record)
    block = max(1, (4 << 20) // record)
    rng = np.random.default_rng(record)
    with MemmapWriter(path, shape=(record,), dtype="uint8", shard_bytes=shard_mib << 20) as w:
        for a in range(0, n, block):
            w.append_batch(rng.integers(0, 255, (min(block, n - a), record), dtype=np.uint8))
    return n


def _epoch(ds: MemmapDataset, order: np.ndarray, batch: int) -> float:
    out = np.empty(0)
    t0 = time.perf_counter()
    for a in range(0, len(order), batch):
        out = ds.read_batch(order[a : a + batch])
    del out
    return time.perf_counter() - t0


def run(record: int, mib: int, shard_mib: int, batch_kib: int, reps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fp-verify-") as tmp:
        path = Path(tmp) / "ds"
        n = _write(path, record, mib, shard_mib)
        batch = max(1, (batch_kib << 10) // record)
        order = np.random.default_rng(0).permutation(n)
        _epoch(MemmapDataset(path, verify=False), order, batch)  # page cache warm
        best = {"off": np.inf, "first": np.inf, "off2": np.inf, "steady": np.inf}
        for _ in range(reps):
            off = MemmapDataset(path, verify=False)
            best["off"] = min(best["off"], _epoch(off, order, batch))
            best["off2"] = min(best["off2"], _epoch(off, order, batch))
            off.close()
            on = MemmapDataset(path)  # verify="first-use", the default
            best["first"] = min(best["first"], _epoch(on, order, batch))
            best["steady"] = min(best["steady"], _epoch(on, order, batch))
            on.close()
        total = n * record / (1 << 20)
        return {k: total / v for k, v in best.items()}  # MiB/s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="dataset size per record size")
    p.add_argument("--shard-mib", type=int, default=4)
    p.add_argument("--batch-kib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section")
    args = p.parse_args()
    rows = []
    head = (
        f"{'record':>8}  {'off ep1':>11}  {'first-use ep1':>14}  {'ratio':>6}  "
        f"{'off ep2':>11}  {'first-use ep2':>14}  {'ratio':>6}"
    )
    print(f"{args.mib} MiB per size, {args.shard_mib} MiB shards, {args.batch_kib} KiB batches")
    print(head)
    for record in SIZES:
        r = run(record, args.mib, args.shard_mib, args.batch_kib, args.reps)
        first, steady = r["first"] / r["off"], r["steady"] / r["off2"]
        line = (
            f"{record:>8}  {r['off']:>5.0f} MiB/s  {r['first']:>8.0f} MiB/s  {first:>6.2f}  "
            f"{r['off2']:>5.0f} MiB/s  {r['steady']:>8.0f} MiB/s  {steady:>6.2f}"
        )
        print(line)
        rows.append(
            f"| {record} B | {r['off']:.0f} | {r['first']:.0f} | {first:.2f} | "
            f"{r['off2']:.0f} | {r['steady']:.0f} | {steady:.2f} |"
        )
    if args.write:
        table = "\n".join(
            [
                f"Machine: {machine()}. `python benchmarks/verify_cost.py --mib {args.mib}`: "
                f"shuffled `read_batch` epochs from the page cache, {args.batch_kib} KiB "
                "batches, MiB/s (best of "
                f"{args.reps}); ratio = against `verify=False` in the same run.",
                "",
                "| record | off, epoch 1 | first-use, epoch 1 | ratio | off, epoch 2 "
                "| first-use, epoch 2 | ratio |",
                "|---|---|---|---|---|---|---|",
                *rows,
            ]
        )
        write_section('Verification cost (verify="first-use")', table)


if __name__ == "__main__":
    main()
