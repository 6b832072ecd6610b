"""``MemmapDataset`` with no workers against a hand-batched ``np.take`` over one file, in one run.

The baseline is what a user writes by hand: ``np.memmap`` of the records (one ``.bin`` file),
and per batch ``torch.from_numpy(np.take(mm, indices, axis=0))`` over a shuffled epoch. Against
it, on the same records (one feedpipe dataset written by ``MemmapWriter``) and the same shuffled
indices:

- ``read_batch``: ``ds.read_batch(indices)`` (the dataset's batched read path, direct);
- ``loader``: ``feedpipe.DataLoader(ds, batch_size=..., shuffle=True, num_workers=0)``, which
  reads through ``read_batch`` and draws its own shuffled order (same size and count).

Every variant holds its batch until the next one is made, as a training loop does (so a new
batch never lands in the memory the previous one just freed).

The page cache is warm (every file read once first). Each repetition runs every variant for
``--epochs`` epochs, interleaved, and times it by wall clock and by this thread's CPU time (the
machine may be shared: CPU time is what other tenants disturb least). Printed: samples/s,
medians of ``--reps`` repetitions, and each ratio against the baseline with its spread (the
ratio of each repetition). Target (issue 28): >= 1.0 at 512 B, 8 KiB and 256 KiB.

    python benchmarks/memmap_vs_take.py                  # 128 MiB per record size
    python benchmarks/memmap_vs_take.py --mb 32 --reps 3 # quicker
    python benchmarks/memmap_vs_take.py --batch 64 1024  # other batch sizes
    python benchmarks/memmap_vs_take.py --write          # the docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import DataLoader, MemmapDataset, MemmapWriter

SIZES = {512: 256, 8192: 256, 262144: 32}  # record bytes -> batch size (benchmarks/datasets.py)
Run = Callable[[int], int]  # epochs -> samples delivered


def _write(tmp: Path, rb: int, mb: int) -> tuple[np.memmap, MemmapDataset, int]:
    n, width = (mb << 20) // rb, rb // 4
    data = np.random.default_rng(rb).integers(0, 1 << 30, (n, width), dtype=np.int32)
    raw = tmp / f"raw-{rb}.bin"
    data.tofile(raw)
    with MemmapWriter(tmp / f"ds-{rb}", shape=(width,), dtype="int32") as w:
        w.append_batch(data)
    mm = np.memmap(raw, dtype=np.int32, mode="r", shape=(n, width))
    return mm, MemmapDataset(tmp / f"ds-{rb}"), n


def _variants(mm: np.memmap, ds: MemmapDataset, n: int, batch: int) -> dict[str, Run]:
    rng = np.random.default_rng(0)
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=0)

    def take(epochs: int) -> int:
        done, batch_of = 0, None
        for _ in range(epochs):
            perm = rng.permutation(n)
            for a in range(0, n, batch):
                # held until the next one is made, as a training loop holds its batch
                batch_of = torch.from_numpy(np.take(mm, perm[a : a + batch], axis=0))
                done += len(batch_of)
        return done

    def read_batch(epochs: int) -> int:
        done, batch_of = 0, None
        for _ in range(epochs):
            perm = rng.permutation(n)
            for a in range(0, n, batch):
                batch_of = ds.read_batch(perm[a : a + batch])
                done += len(batch_of)
        return done

    def through_loader(epochs: int) -> int:
        done = 0
        for _ in range(epochs):
            for batch_of in loader:
                done += len(batch_of)
        return done

    return {"np.take": take, "read_batch": read_batch, "loader": through_loader}


def _sizes(batches: list[int]) -> list[tuple[int, int]]:
    """(record bytes, batch size) pairs: the defaults, or every size with each given batch."""
    if not batches:
        return list(SIZES.items())
    return [(rb, b) for rb in SIZES for b in batches]


def _time(run: Run, epochs: int) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.thread_time()
    done = run(epochs)
    return time.perf_counter() - wall, time.thread_time() - cpu, done


_DEFAULTS = {"mb": 128, "reps": 7, "epochs": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mb", type=int, default=_DEFAULTS["mb"], help="MiB of records per record size"
    )
    parser.add_argument("--reps", type=int, default=_DEFAULTS["reps"])
    parser.add_argument("--epochs", type=int, default=_DEFAULTS["epochs"])
    parser.add_argument(
        "--batch", type=int, nargs="*", default=[], help="batch sizes (default: 256, 256, 32)"
    )
    parser.add_argument("--write", action="store_true", help="write the docs section")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    print(f"load average {load:.1f} at the start; {os.cpu_count()} cores")
    rows: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-take-"))
    try:
        for rb, batch in _sizes(args.batch):
            mm, ds, n = _write(tmp, rb, args.mb)
            runs = _variants(mm, ds, n, batch)
            for run in runs.values():  # warm: page cache, maps, first-use checks
                run(1)
            wall: dict[str, list[float]] = {k: [] for k in runs}
            cpu: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.reps):
                for name, run in runs.items():
                    w, c, done = _time(run, args.epochs)
                    wall[name].append(done / w)
                    cpu[name].append(done / c)
            rows += _print(rb, batch, n, wall, cpu)
            del ds, mm
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.write:
        _write_doc(args, load, rows)


def _write_doc(args: argparse.Namespace, load: float, rows: list[str]) -> None:
    cmd = "python benchmarks/memmap_vs_take.py --write"
    for flag in ("mb", "reps", "epochs"):
        if getattr(args, flag) != _DEFAULTS[flag]:
            cmd += f" --{flag} {getattr(args, flag)}"
    if args.batch:
        cmd += " --batch " + " ".join(map(str, args.batch))
    write_section(
        "memmap_vs_take",
        "## No workers: `MemmapDataset` against a hand-batched `np.take`\n\n"
        f"{machine()}; load average {load:.1f} at the start. Command: `{cmd}`. One file of "
        "int32 records, shuffled epochs, page cache warm, every variant holding its batch "
        "until the next one is made; `read_batch` is the dataset's batched read, `loader` "
        "`feedpipe.DataLoader(num_workers=0)` over it. Medians of interleaved repetitions, "
        "samples/s by the wall clock and per second of the thread's CPU time; ratio against "
        "`torch.from_numpy(np.take(mm, idx, axis=0))` (in brackets: the ratio of each "
        "repetition). Target (issue 28): >= 1.0 at 512 B, 8 KiB and 256 KiB.\n\n"
        "| record | batch | variant | wall, samples/s | ratio | CPU, samples/s | ratio |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows),
    )


def _print(
    rb: int, batch: int, n: int, wall: dict[str, list[float]], cpu: dict[str, list[float]]
) -> list[str]:
    """Print one record size's figures; return its table rows."""
    base_w, base_c = wall["np.take"], cpu["np.take"]
    print(f"{rb:>6} B records, batch {batch}, {n} records:")
    rows = []
    for name, w in wall.items():
        c = cpu[name]
        pw = [a / b for a, b in zip(w, base_w, strict=True)]
        pc = [a / b for a, b in zip(c, base_c, strict=True)]
        print(
            f"  {name:<10} wall {statistics.median(w):>12,.0f} samples/s ratio "
            f"{statistics.median(w) / statistics.median(base_w):.2f} ({min(pw):.2f}-{max(pw):.2f});"
            f" cpu {statistics.median(c):>12,.0f} samples/s ratio "
            f"{statistics.median(c) / statistics.median(base_c):.2f} ({min(pc):.2f}-{max(pc):.2f})"
        )
        rows.append(
            f"| {rb:,} B | {batch} | {name} | {statistics.median(w):,.0f} | "
            f"{statistics.median(w) / statistics.median(base_w):.2f} ({min(pw):.2f}-{max(pw):.2f})"
            f" | {statistics.median(c):,.0f} | "
            f"{statistics.median(c) / statistics.median(base_c):.2f} ({min(pc):.2f}-{max(pc):.2f})"
            " |"
        )
    return rows


if __name__ == "__main__":
    main()
