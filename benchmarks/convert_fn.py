"""``feedpipe.convert(fn, inputs, output=...)`` against LitData's ``optimize()`` and a sequential
loop, in the same run.

The function stands in for tokenizing: per input it splits generated text into words, maps them
to ids in Python, and yields fixed windows of 256 int32 tokens (``{"data": ..., "doc": ...}``).
The same function and inputs go to:

- a sequential loop in one process, appending to a ``MemmapWriter``;
- ``feedpipe.convert(fn, inputs, output=..., num_workers=W)``;
- ``litdata.optimize(fn=fn, inputs=inputs, output_dir=..., num_workers=W,
  chunk_bytes="64MB")`` (its documented call; every record is one chunk item).

Each output is checked to hold every record. Reported: seconds, records/s and MB/s of record
payload (the same bytes for all), the size on disk, and the ratio other / feedpipe time. Then
determinism: the first 16 inputs converted with 1 and with W workers by each tool, and whether
the two outputs are byte-identical (file names and contents).

LitData needs ``pip install --no-deps litdata lightning-utilities obstore tifffile`` beside a
CPU torch; without it its rows say so.

    python benchmarks/convert_fn.py              # quick (default)
    python benchmarks/convert_fn.py --full       # more inputs
    python benchmarks/convert_fn.py --no-write   # do not rewrite docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import MemmapWriter, convert

WORDS = [f"w{i}" for i in range(5000)]
WINDOW = 256


def tokenize(item: int) -> Iterator[dict[str, Any]]:
    """Python-heavy work per input, then windows of token ids."""
    rng = np.random.default_rng(item)
    text = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 20_000))
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(w, len(vocab)) for w in text.split()]
    arr = np.asarray(ids, np.int32)
    for k in range(len(arr) // WINDOW):
        yield {"data": arr[k * WINDOW : (k + 1) * WINDOW], "doc": item}


def _sequential(items: list[int], out: str) -> float:
    start = time.perf_counter()
    with MemmapWriter(out, shape=(WINDOW,), dtype="int32", fields={"doc": "int64"}) as w:
        for item in items:
            for rec in tokenize(item):
                w.append(rec["data"], doc=rec["doc"])
    return time.perf_counter() - start


def _litdata(items: list[int], out: str, workers: int) -> float:
    import litdata

    method = mp.get_start_method(allow_none=True)
    start = time.perf_counter()
    litdata.optimize(fn=tokenize, inputs=items, output_dir=out, num_workers=workers,
                     chunk_bytes="64MB", verbose=False)  # fmt: skip
    took = time.perf_counter() - start
    mp.set_start_method(method, force=True)  # optimize() leaves "spawn" set
    return took


def _feedpipe(items: list[int], out: str, workers: int) -> float:
    start = time.perf_counter()
    convert(tokenize, items, output=out, num_workers=workers, progress_bar=False)
    return time.perf_counter() - start


def _digest(root: str) -> str:
    """One digest of every file's relative name and bytes under ``root``."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _disk(root: str) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def _records(tool: str, root: str) -> int:
    if tool == "litdata":
        import litdata

        return len(litdata.StreamingDataset(root))
    from feedpipe import MemmapDataset

    return len(MemmapDataset(root))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    items = list(range(256 if args.full else 64))
    have_lit = importlib.util.find_spec("litdata") is not None
    tools = {"feedpipe": _feedpipe, **({"litdata": _litdata} if have_lit else {})}
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-convert-"))
    try:
        base = _sequential(items, str(tmp / "seq"))
        records = _records("feedpipe", str(tmp / "seq"))
        secs, disk, same, small = {}, {}, {}, {}
        for tool, run in tools.items():
            out = str(tmp / tool)
            secs[tool] = run(items, out, args.workers)
            got = _records(tool, out)
            if got != records:
                raise RuntimeError(f"{tool}: {got} records, the loop wrote {records}")
            disk[tool] = _disk(out)
            one, many = str(tmp / f"{tool}-d1"), str(tmp / f"{tool}-dn")
            small[tool] = run(items[:16], one, 1)
            run(items[:16], many, args.workers)
            same[tool] = _digest(one) == _digest(many)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    payload = records * (WINDOW * 4 + 8) / 1e6
    ours = secs["feedpipe"]
    names = {
        "feedpipe": f"`feedpipe.convert(fn)`, {args.workers} workers",
        "litdata": f"LitData `optimize()`, {args.workers} workers",
    }
    rows = [
        f"| sequential loop into `MemmapWriter` | {base:.2f} | {records / base:,.0f} | "
        f"{payload / base:.1f} | | {base / ours:.2f} | | |"
    ]
    for tool, t in secs.items():
        ident = "identical" if same[tool] else "differ"
        rows.append(
            f"| {names[tool]} | {t:.2f} | {records / t:,.0f} | {payload / t:.1f} | "
            f"{disk[tool] / 1e6:.1f} MB | {t / ours:.2f} | {ident} | {small[tool]:.2f} |"
        )
    if not have_lit:
        rows.append("| LitData `optimize()` | not installed: not measured | | | | | | |")
    print("\n".join(rows))
    if not args.no_write:
        cmd = "python benchmarks/convert_fn.py" + (" --full" if args.full else "")
        write_section(
            "convert_fn",
            "## Parallel conversion with a user function (`feedpipe.convert(fn, ...)`)\n\n"
            f"{machine()}; load average {load:.1f} at the start. "
            f"Command: `{cmd}`. {len(items)} inputs, a Python-heavy tokenizing "
            f"function, {records:,} records of 256 int32 tokens and an int64 `doc` "
            f"({payload:.1f} MB of payload). LitData: `optimize(fn, inputs, num_workers, "
            "chunk_bytes=\"64MB\")`. Ratio: that run's time / feedpipe's (above 1: feedpipe is "
            "faster). Determinism: the first 16 inputs converted with 1 and with "
            f"{args.workers} workers give byte-identical outputs (file names and contents), or "
            "differ; the time of that 1-worker run of 16 inputs shows each tool's fixed cost "
            "(start-up).\n\n"
            "| run | seconds | records/s | MB/s | on disk | ratio | 1 vs N workers | "
            "16 inputs, 1 worker (s) |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
