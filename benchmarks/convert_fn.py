"""``feedpipe.convert(fn, inputs, output=...)`` against a sequential loop (and LitData), same run.

The function stands in for tokenizing: per input it splits generated text into words, maps them
to ids in Python, and yields fixed windows of 256 int32 tokens. The baseline runs the same
function over the same inputs in one process, appending to a ``MemmapWriter``. LitData's
``optimize()`` over the same function and inputs runs too when ``litdata`` is installed (else it
is reported as absent). The ratio is baseline time / feedpipe time.

    python benchmarks/convert_fn.py              # quick (default)
    python benchmarks/convert_fn.py --full       # more inputs
    python benchmarks/convert_fn.py --no-write   # do not rewrite docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _litdata(items: list[int], out: str, workers: int) -> float | None:
    if importlib.util.find_spec("litdata") is None:
        return None
    import litdata  # pragma: no cover - not installed here

    start = time.perf_counter()
    litdata.optimize(fn=tokenize, inputs=items, output_dir=out, num_workers=workers,
                     chunk_bytes="64MB")  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    items = list(range(256 if args.full else 64))
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-convert-"))
    try:
        base = _sequential(items, str(tmp / "seq"))
        start = time.perf_counter()
        convert(tokenize, items, output=str(tmp / "fp"), num_workers=args.workers,
                progress_bar=False)  # fmt: skip
        ours = time.perf_counter() - start
        lit = _litdata(items, str(tmp / "lit"), args.workers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"sequential loop: {base:.2f} s; feedpipe.convert(fn), {args.workers} workers: "
          f"{ours:.2f} s; ratio {base / ours:.2f}")  # fmt: skip
    lit_row = (
        f"| LitData `optimize()`, {args.workers} workers | {lit:.2f} | {lit / ours:.2f} |"
        if lit is not None
        else "| LitData `optimize()` | not installed: not measured | |"
    )
    print(lit_row)
    if not args.no_write:
        cmd = "python benchmarks/convert_fn.py" + (" --full" if args.full else "")
        write_section(
            "convert_fn",
            "## Parallel conversion with a user function (`feedpipe.convert(fn, ...)`)\n\n"
            f"{machine()}. Command: `{cmd}`. {len(items)} inputs, a Python-heavy tokenizing "
            "function, 256-token int32 records. Ratio: the other's time / feedpipe's.\n\n"
            "| run | seconds | ratio |\n|---|---|---|\n"
            f"| sequential loop into `MemmapWriter` | {base:.2f} | {base / ours:.2f} |\n"
            f"| `feedpipe.convert(fn)`, {args.workers} workers | {ours:.2f} | 1.00 |\n" + lit_row,
        )


if __name__ == "__main__":
    main()
