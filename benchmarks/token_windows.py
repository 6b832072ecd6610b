"""``feedpipe.TokenWindows`` against a per-window baseline and LitData's ``TokensLoader``.

One corpus of variable-length int32 documents (a ragged ``tokens`` field), shuffled windows of
``--block`` tokens, batches of ``--batch``, from the page cache, all in the same run:

  (a) ``TokenWindows.read_batch``: one contiguous read per window (two across a shard);
  (b) the baseline a user writes without it: an in-memory table of document starts (O(docs)),
      then per window the overlapping documents read with ``ds[j]`` and concatenated;
  (c) LitData's ``TokensLoader``: not driven by this script yet; the table says whether
      ``litdata`` is installed.

Also timed: building each index (TokenWindows: one number per shard, from ``index.json``).

    python benchmarks/token_windows.py            # quick (default)
    python benchmarks/token_windows.py --docs 20000 --seconds 5
    python benchmarks/token_windows.py --no-write # do not rewrite docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import MemmapDataset, MemmapWriter, TokenWindows


class PerWindow:
    """(b) Windows from per-document reads: the documents' starts in memory, ``ds[j]`` each."""

    def __init__(self, ds: MemmapDataset, block: int) -> None:
        self.ds, self.block = ds, block
        lengths = [len(ds[j]["tokens"]) for j in range(len(ds))]  # O(docs) reads to build
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self.n = int(self.starts[-1]) // block

    def read_batch(self, indices: np.ndarray) -> torch.Tensor:
        rows = []
        for i in indices.tolist():
            a, b = i * self.block, (i + 1) * self.block
            first = int(np.searchsorted(self.starts, a, side="right")) - 1
            last = int(np.searchsorted(self.starts, b, side="left"))
            docs = [self.ds[j]["tokens"].numpy() for j in range(first, last)]
            cat = np.concatenate(docs)
            off = a - int(self.starts[first])
            rows.append(cat[off : off + self.block])
        return torch.from_numpy(np.stack(rows))


def _write(root: Path, docs: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    total = 0
    spec = {"tokens": ("int32", (None,))}
    with MemmapWriter(root, records=False, fields=spec, shard_bytes=4 << 20) as w:
        for _ in range(docs):
            t = rng.integers(0, 50_000, int(rng.integers(1, 4000)), dtype=np.int32)
            w.append(tokens=t)
            total += len(t)
    return total


def _rate(read: Callable[[np.ndarray], object], n: int, batch: int, seconds: float) -> float:
    """Windows per second over shuffled batches for ``seconds`` (after one warm-up batch)."""
    rng = np.random.default_rng(0)
    read(rng.integers(0, n, batch))
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        read(rng.integers(0, n, batch))
        done += batch
    return done / (time.perf_counter() - start)


def _litdata_note() -> str:
    if importlib.util.find_spec("litdata") is None:
        return "LitData is not installed in this environment: its `TokensLoader` was not run."
    return (
        "LitData is installed, but this script does not drive its `TokensLoader` yet: not compared."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--block", type=int, default=2049)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-tokens-"))
    try:
        tokens = _write(tmp / "corpus", args.docs, 0)
        ds = MemmapDataset(tmp / "corpus")
        t0 = time.perf_counter()
        tw = TokenWindows(ds, block_size=args.block)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        base = PerWindow(ds, args.block)
        t_base = time.perf_counter() - t0
        assert len(tw) == base.n
        probe = np.array([0, len(tw) // 2, len(tw) - 1])
        assert torch.equal(tw.read_batch(probe), base.read_batch(probe))
        ours = _rate(tw.read_batch, len(tw), args.batch, args.seconds)
        theirs = _rate(base.read_batch, base.n, args.batch, args.seconds)
        lit = _litdata_note()
        cmd = "python benchmarks/token_windows.py " + " ".join(sys.argv[1:])
        text = "\n".join(
            [
                "### Token windows: `TokenWindows` vs per-window reads",
                "",
                f"Machine: {machine()}. Command: `{cmd.strip()}`.",
                f"{args.docs} documents, {tokens:,} int32 tokens in {len(ds.index.shards)} "
                f"shards; shuffled windows of {args.block} tokens, batches of {args.batch}, "
                "page cache warm.",
                "",
                "| subject | windows/s | index built in |",
                "|---|---|---|",
                f"| (a) `TokenWindows.read_batch` | {ours:,.0f} | {t_ours * 1e3:.2f} ms |",
                f"| (b) per-window `ds[j]` reads of the overlapping documents | {theirs:,.0f} | "
                f"{t_base * 1e3:.0f} ms |",
                "",
                f"TokenWindows / per-window baseline: **{ours / theirs:.1f}x** windows/s.",
                "",
                lit,
            ]
        )
        print(text)
        if not args.no_write:
            write_section("token_windows", text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
