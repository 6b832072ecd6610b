"""``MixedDataset`` against one ``MemmapDataset`` of the same records, in the same run.

Three memmap datasets of fixed-size int32 records (one up-sampled, one down-sampled, one taken
whole) are mixed by weight; the baseline is one dataset holding as many records. Both go through
``feedpipe.DataLoader`` with the same sampler, batch size and thread workers, shuffled, from the
page cache, at 512 B, 8 KiB and 256 KiB records; repetitions are interleaved and their medians
compared. The ratio is mixed / single samples/s (target: >= 0.9, issue 28), with its spread
over the repetitions. ``--kind typed`` does the same with typed members: ragged int32 records
(lengths uniform in [0.5, 1.5] x the record size, padded per batch) and an int64 ``label`` side
field, against one such dataset of as many records.

    python benchmarks/mixed.py            # quick (default)
    python benchmarks/mixed.py --full     # longer runs
    python benchmarks/mixed.py --no-write # do not rewrite docs/benchmarks.md
    python benchmarks/mixed.py --kind typed --no-write  # typed/ragged members only
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import DataLoader, MemmapDataset, MemmapWriter, MixedDataset

RECORD = {512: 512, 8192: 256, 262144: 16}  # record bytes -> batch size
SCALE = {512: 1, 8192: 8, 262144: 256}  # fewer records of the bigger sizes


def _write(path: Path, n: int, width: int) -> MemmapDataset:
    rng = np.random.default_rng(n)
    with MemmapWriter(path, shape=(width,), dtype="int32") as w:
        for lo in range(0, n, 4096):
            m = min(4096, n - lo)
            w.append_batch(rng.integers(0, 1 << 30, (m, width), dtype=np.int32))
    return MemmapDataset(path)


def _write_typed(path: Path, n: int, width: int) -> MemmapDataset:
    """Ragged int32 records of ``width // 2`` to ``3 * width // 2`` values, and a label."""
    rng = np.random.default_rng(n)
    fields = {"label": "int64"}
    with MemmapWriter(path, shape=(None,), dtype="int32", fields=fields) as w:
        for lo in range(0, n, 4096):
            m = min(4096, n - lo)
            sizes = rng.integers(width // 2, 3 * width // 2 + 1, m)
            block = rng.integers(0, 1 << 30, int(sizes.sum()), dtype=np.int32)
            records = np.split(block, np.cumsum(sizes)[:-1])
            w.append_batch(records, label=np.arange(lo, lo + m, dtype=np.int64))
    return MemmapDataset(path)


def _rows(batch: Any) -> int:
    """Samples in a batch: a tensor's rows, a typed batch's labels."""
    return len(batch["label"]) if isinstance(batch, dict) else len(batch)


def _rate(ds: Any, batch: int, seconds: float, workers: int) -> tuple[float, float]:
    """Samples/s over shuffled passes of ``ds`` for about ``seconds``: by the wall clock, and
    per second of this process's CPU time (all threads: what other tenants disturb least)."""
    loader = DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=workers,
        worker_type="thread",
    )
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for b in loader:
            done += _rows(b)
            if time.perf_counter() - start >= seconds:
                break
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def _compare(
    single: Any, mixed: Any, what: str, *, batch: int, workers: int, seconds: float, reps: int
) -> str:
    """Interleaved repetitions of both; prints and returns the table row (medians, spread)."""
    runs: dict[str, list[tuple[float, float]]] = {"single": [], "mixed": []}
    for _ in range(reps):
        runs["single"].append(_rate(single, batch, seconds, workers))
        runs["mixed"].append(_rate(mixed, batch, seconds, workers))
    cells = []
    for j, clock in enumerate(("wall", "cpu")):
        one = statistics.median(r[j] for r in runs["single"])
        mix = statistics.median(r[j] for r in runs["mixed"])
        pairs = [m[j] / o[j] for m, o in zip(runs["mixed"], runs["single"], strict=True)]
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}"
        print(
            f"{what:>14} records, batch {batch}, {workers} thread workers, {clock}: single "
            f"{one:,.0f} samples/s, mixed (3 members) {mix:,.0f} samples/s (medians of "
            f"{reps}), ratio {mix / one:.2f} (per repetition {spread})"
        )
        cells.append(f"{one:,.0f} | {mix:,.0f} | {mix / one:.2f} ({spread})")
    return f"| {what} | {batch} | {workers} | " + " | ".join(cells) + " |"


def _kind_rows(
    kind: str, tmp: Path, total: int, *, workers_list: list[int], seconds: float, reps: int
) -> list[str]:
    """The table rows of one kind of member (``fixed`` or ``typed``) at every record size."""
    write = _write if kind == "fixed" else _write_typed
    rows = []
    for nbytes, batch in RECORD.items():
        width = nbytes // 4
        n = total // SCALE[nbytes]
        single = write(tmp / f"{kind}-single-{nbytes}", n, width)
        # web is down-sampled (60 % of a 2n/3 draw from n), code up-sampled, books whole
        members = {
            "web": write(tmp / f"{kind}-web-{nbytes}", n, width),
            "code": write(tmp / f"{kind}-code-{nbytes}", n // 10, width),
            "books": write(tmp / f"{kind}-books-{nbytes}", n // 5, width),
        }
        mixed = MixedDataset(
            members, weights={"web": 0.6, "code": 0.2, "books": 0.2}, epoch_samples=n
        )
        what = f"{nbytes} B" if kind == "fixed" else f"{nbytes} B typed"
        for workers in workers_list:
            rows.append(
                _compare(
                    single, mixed, what, batch=batch, workers=workers, seconds=seconds, reps=reps
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--kind", nargs="+", choices=["fixed", "typed"], default=["fixed"])
    args = parser.parse_args()
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    seconds, reps, total = (3.0, 5, 200_000) if args.full else (1.0, 5, 60_000)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-mixed-"))
    try:
        for kind in args.kind:
            rows += _kind_rows(
                kind, tmp, total, workers_list=args.workers, seconds=seconds, reps=reps
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.no_write:
        cmd = "python benchmarks/mixed.py" + (" --full" if args.full else "")
        if args.workers != [0, 2]:
            cmd += " --workers " + " ".join(map(str, args.workers))
        if args.kind != ["fixed"]:
            cmd += " --kind " + " ".join(args.kind)
        write_section(
            "mixed",
            "## Mixing datasets (`MixedDataset`) against one dataset\n\n"
            f"{machine()}; load average {load:.1f} at the start. "
            f"Command: `{cmd}`. `feedpipe.DataLoader` (0 workers, or thread "
            "workers), shuffled, page cache; three members (down-sampled, up-sampled, whole) "
            "against one `MemmapDataset` of as many records; medians of interleaved "
            "repetitions, by the wall clock and per second of the process's CPU time. Ratio: "
            "mixed / single (in brackets: the ratio of each repetition).\n\n"
            "| record | batch | workers | single (wall, samples/s) | mixed (wall) | ratio (wall) "
            "| single (CPU) | mixed (CPU) | ratio (CPU) |\n"
            "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
