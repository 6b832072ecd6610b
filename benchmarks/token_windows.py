"""``feedpipe.TokenWindows`` against a per-window baseline and LitData's ``TokensLoader``.

One corpus of variable-length int32 documents (a ragged ``tokens`` field), shuffled windows of
``--block`` tokens, batches of ``--batch``, from the page cache, all in the same run:

  (a) ``TokenWindows.read_batch``: one contiguous read per window (two across a shard);
  (b) the baseline a user writes without it: an in-memory table of document starts (O(docs)),
      then per window the overlapping documents read with ``ds[j]`` and concatenated;
  (c) LitData's ``TokensLoader``, its documented recipe: ``litdata.optimize(fn, docs,
      chunk_size=block * 1024, item_loader=TokensLoader())`` writes the same documents (timed
      and reported, not compared), then ``StreamingDataset(dir, item_loader=TokensLoader(
      block), shuffle=True, drop_last=True)`` through ``StreamingDataLoader(batch_size=B,
      num_workers=W)``, against ``TokenWindows`` through ``feedpipe.DataLoader(batch_size=B,
      shuffle=True, num_workers=W, worker_type="thread")`` (feedpipe's setting for
      ``read_batch`` datasets): one
      shuffled epoch each, best of ``--reps`` interleaved, with 0 and 2 workers; also the time
      to the first batch, and the size of each on-disk index (``index.json``).

LitData needs ``pip install --no-deps litdata lightning-utilities obstore tifffile`` beside a
CPU torch (its ``torchvision`` requirement is not used here); without it (c) says so.

Also timed: building each index (TokenWindows: one number per shard, from ``index.json``).

    python benchmarks/token_windows.py            # quick (default)
    python benchmarks/token_windows.py --docs 20000 --seconds 5
    python benchmarks/token_windows.py --no-write # do not rewrite docs/benchmarks.md
    python benchmarks/token_windows.py --no-litdata  # (a) and (b) only
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import DataLoader, MemmapDataset, MemmapWriter, TokenWindows


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


def document(seed: int, j: int) -> np.ndarray:
    """Document ``j`` of the corpus: 1 to 3999 int32 tokens (the same for every reader)."""
    rng = np.random.default_rng([seed, j])
    return rng.integers(0, 50_000, int(rng.integers(1, 4000)), dtype=np.int32)


def lit_document(seed: int, j: int) -> torch.Tensor:
    """``document`` as LitData's ``optimize`` wants it for ``TokensLoader``: a 1-D tensor."""
    return torch.from_numpy(document(seed, j))


def _write(root: Path, docs: int, seed: int) -> int:
    total = 0
    spec = {"tokens": ("int32", (None,))}
    with MemmapWriter(root, records=False, fields=spec, shard_bytes=4 << 20) as w:
        for j in range(docs):
            t = document(seed, j)
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


def _epoch(loader: Any) -> tuple[float, float, int]:
    """(seconds to the first batch, windows/s over the epoch, windows) of one pass."""
    start = time.perf_counter()
    first, n = 0.0, 0
    for b in loader:
        if not n:
            first = time.perf_counter() - start
        n += len(b)
    return first, n / (time.perf_counter() - start), n


def _loaders(args: argparse.Namespace, tmp: Path, ds: MemmapDataset) -> list[str]:
    """(c): TokenWindows and LitData's TokensLoader through their loaders; table rows."""
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    out = tmp / "litdata"
    method = mp.get_start_method(allow_none=True)
    t0 = time.perf_counter()
    litdata.optimize(
        fn=functools.partial(lit_document, 0),
        inputs=list(range(args.docs)),
        output_dir=str(out),
        chunk_size=args.block * 1024,
        item_loader=TokensLoader(),
        num_workers=2,
        verbose=False,
    )
    t_optimize = time.perf_counter() - t0
    # optimize() switches this process to "spawn"; a training script that only reads (the
    # case measured) keeps the platform's default, so put it back for both loaders
    mp.set_start_method(method, force=True)
    tw = TokenWindows(ds, block_size=args.block)
    sizes = {
        "feedpipe": os.path.getsize(tmp / "corpus" / "index.json"),
        "LitData": os.path.getsize(out / "index.json"),
    }
    best: dict[tuple[str, int], tuple[float, float, int]] = {}
    for workers in (0, 2):
        for _ in range(args.reps):  # interleaved repetitions, best kept
            runs = {
                "feedpipe": lambda w: DataLoader(
                    tw, args.batch, shuffle=True, num_workers=w, drop_last=True,
                    worker_type="thread",
                ),
                "LitData": lambda w: litdata.StreamingDataLoader(
                    litdata.StreamingDataset(
                        str(out), item_loader=TokensLoader(block_size=args.block),
                        shuffle=True, drop_last=True,
                    ),
                    batch_size=args.batch, num_workers=w, drop_last=True,
                ),
            }  # fmt: skip
            for name, make in runs.items():
                first, rate, n = _epoch(make(workers))
                old = best.get((name, workers))
                best[(name, workers)] = (
                    min(first, old[0]) if old else first,
                    max(rate, old[1]) if old else rate,
                    n,
                )
    rows = []
    for workers in (0, 2):
        ours, theirs = best[("feedpipe", workers)], best[("LitData", workers)]
        for name, (first, rate, n) in (("feedpipe", ours), ("LitData", theirs)):
            subject = (
                "`TokenWindows` + `feedpipe.DataLoader`"
                if name == "feedpipe"
                else "LitData `StreamingDataset(TokensLoader)` + `StreamingDataLoader`"
            )
            ratio = f"{ours[1] / theirs[1]:.2f}" if name == "feedpipe" else "1.00"
            rows.append(
                f"| {subject} | {workers} | {rate:,.0f} | {ratio} | {first * 1e3:.0f} ms | "
                f"{n:,} | {sizes[name]:,} B |"
            )
            print(rows[-1])
    return [
        "",
        f"(c) Through the loaders, one shuffled epoch, batches of {args.batch}, best of "
        f"{args.reps} interleaved epochs; LitData's `optimize()` of the same documents "
        f"(2 workers, `chunk_size={args.block} * 1024` tokens) took {t_optimize:.1f} s. "
        "Ratio: feedpipe / LitData windows/s at the same worker count (feedpipe: thread "
        "workers; LitData: its worker processes). LitData's windows do not cross its chunks, "
        "so its epoch can hold slightly fewer windows.",
        "",
        "| subject | workers | windows/s | ratio | first batch | windows/epoch | index.json |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--block", type=int, default=2049)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-litdata", action="store_true", help="skip (c)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
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
        if args.no_litdata:
            lit = ["", "(c) LitData: not run (`--no-litdata`)."]
        elif importlib.util.find_spec("litdata") is None:
            lit = [
                "",
                "(c) LitData is not installed: `pip install --no-deps litdata "
                "lightning-utilities obstore tifffile` to compare with its `TokensLoader`.",
            ]
        else:
            lit = _loaders(args, tmp, ds)
        cmd = "python benchmarks/token_windows.py " + " ".join(sys.argv[1:])
        text = "\n".join(
            [
                "### Token windows: `TokenWindows` vs per-window reads and LitData `TokensLoader`",
                "",
                f"Machine: {machine()}; load average {load:.1f} at the start. "
                f"Command: `{cmd.strip()}`.",
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
                *lit,
            ]
        )
        print(text)
        if not args.no_write:
            write_section("token_windows", text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
