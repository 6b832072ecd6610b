"""A loader's fixed cost per pass: many short epochs, against a hand-written loop, in one run.

Issue 28: with no workers, each ``iter()`` of ``feedpipe.DataLoader`` paid ~400 us of fixed work
(protocol checks, the RNG states saved for resume, the stall meter's fold at the pass's end)
before and after its batches; at 8 KiB records an epoch of ``benchmarks/memmap_vs_take.py`` has
only 32 batches, so that was most of its gap to ``np.take``.

Each epoch here has ``--batches`` batches of ``--batch`` records of 512 B (one
``MemmapDataset``). The baseline is the hand-written loop a user would write instead: a shuffled
permutation and ``ds.read_batch`` per batch (the same read path, no loader). Against it,
``for batch in loader: pass`` with ``DataLoader(ds, batch_size, shuffle=True, num_workers=0)``,
counters on and off. Repetitions alternate the variants; printed: microseconds per pass
(median of ``--reps``, with the range), the loader's extra time per pass over the baseline, and
the ratio of the baseline's passes/s to each variant's (1.0: no fixed cost at all).

    python benchmarks/short_epochs.py                      # 1 and 4 batches an epoch
    python benchmarks/short_epochs.py --batches 1 32 --reps 9
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

from feedpipe import DataLoader, MemmapDataset, MemmapWriter, StallMeter

RECORD_INTS = 128  # 512 B records


def _variants(ds: MemmapDataset, batch: int) -> dict[str, Callable[[], None]]:
    n, rng = len(ds), np.random.default_rng(0)
    on = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=0)
    off = DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=0, meter=StallMeter(enabled=False)
    )

    def hand() -> None:
        perm = rng.permutation(n)
        for a in range(0, n, batch):
            ds.read_batch(perm[a : a + batch])

    def loader_on() -> None:
        for _ in on:
            pass

    def loader_off() -> None:
        for _ in off:
            pass

    return {"hand loop": hand, "loader": loader_on, "loader, counters off": loader_off}


def _per_pass(run: Callable[[], None], passes: int) -> float:
    t = time.perf_counter()
    for _ in range(passes):
        run()
    return (time.perf_counter() - t) / passes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="per epoch")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--passes", type=int, default=1000, help="epochs per repetition")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cores")
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-epochs-"))
    try:
        for batches in args.batches:
            n = batches * args.batch
            data = np.arange(n * RECORD_INTS, dtype=np.int32).reshape(n, RECORD_INTS)
            with MemmapWriter(tmp / f"ds-{batches}", shape=(RECORD_INTS,), dtype="int32") as w:
                w.append_batch(data)
            runs = _variants(MemmapDataset(tmp / f"ds-{batches}"), args.batch)
            for run in runs.values():  # warm: maps, first-use checks
                _per_pass(run, 50)
            us: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.reps):
                for name, run in runs.items():
                    us[name].append(_per_pass(run, args.passes))
            _print(batches, args.batch, us)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _print(batches: int, batch: int, us: dict[str, list[float]]) -> None:
    base = statistics.median(us["hand loop"])
    print(f"{batches} batch(es) of {batch} x 512 B an epoch:")
    for name, t in us.items():
        med = statistics.median(t)
        print(
            f"  {name:<21} {med:8.1f} us/pass ({min(t):.1f}-{max(t):.1f}); "
            f"+{med - base:6.1f} us over the hand loop; ratio {base / med:.2f}"
        )


if __name__ == "__main__":
    main()
