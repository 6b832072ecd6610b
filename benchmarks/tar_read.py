"""Reading WebDataset ``.tar`` shards: WebDataset against feedpipe, in the same run.

The same shards (``--shards`` shards of ``--samples`` samples; a sample is a ``jpg`` member of
random bytes, 4 to 28 KiB, and a ``cls`` integer, as WebDataset writes them), raw bytes to raw
bytes (nothing is decoded), batches of ``--batch``, page cache warm, each subject with 0 and 2
workers (processes), best of ``--reps`` interleaved epochs:

  (a) ``webdataset.WebDataset(urls, shardshuffle=False).batched(B, collation_fn=None)`` through
      ``webdataset.WebLoader(ds, batch_size=None, num_workers=W)``: WebDataset's documented fast
      path (batching inside the pipeline, shards split over workers); sequential by design.
  (b) ``feedpipe.TarDataset(urls)`` through ``feedpipe.DataLoader(batch_size=B,
      collate_fn=<the list of samples>)``: the same dicts of bytes, read in place by offset
      (map-style: one positioned read per member), in shard order.
  (c) the intended path: ``feedpipe convert`` of the same tars (timed once, reported), then
      ``MemmapDataset`` through ``feedpipe.DataLoader(batch_size=B)`` with default collation
      (``read_batch``: ``data`` is a list of uint8 tensors, views of one buffer; ``cls`` a
      tensor), in order, and shuffled (which (a) cannot do exactly).

Each subject's epoch is checked to hold every sample once, with the same total of bytes.
Ratios are feedpipe / WebDataset samples/s. Needs ``pip install webdataset``; without it the
WebDataset rows say so and the feedpipe rows still run.

    python benchmarks/tar_read.py            # quick (default)
    python benchmarks/tar_read.py --full     # more samples
    python benchmarks/tar_read.py --no-write # do not rewrite docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import DataLoader, MemmapDataset, TarDataset, convert


def _write_shards(root: Path, shards: int, samples: int) -> tuple[list[str], int]:
    """WebDataset-style shards; the total of ``jpg`` bytes."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    urls, total = [], 0
    for s in range(shards):
        path = root / f"train-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(samples):
                key = f"{s * samples + i:08d}"
                body = rng.integers(0, 256, int(rng.integers(4096, 28 * 1024)), np.uint8)
                for ext, data in (("jpg", body.tobytes()), ("cls", str(i % 1000).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                total += len(body)
        urls.append(str(path))
    return urls, total


def samples_list(batch: list[Any]) -> list[Any]:
    """collate_fn for (b): the batch is the list of sample dicts, as WebDataset's."""
    return batch


def _epoch(
    batches: Iterable[Any], count: Callable[[Any], tuple[int, int]]
) -> tuple[float, int, int]:
    """(seconds, samples, bytes) of one pass."""
    start = time.perf_counter()
    n = nbytes = 0
    for b in batches:
        k, m = count(b)
        n += k
        nbytes += m
    return time.perf_counter() - start, n, nbytes


def _count_dicts(batch: list[dict[str, Any]]) -> tuple[int, int]:
    return len(batch), sum(len(s["jpg"]) for s in batch)


def _count_memmap(batch: dict[str, Any]) -> tuple[int, int]:
    return len(batch["data"]), sum(int(t.numel()) for t in batch["data"])


def _wds(urls: list[str], batch: int, workers: int) -> Any:
    import webdataset as wds

    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).batched(
        batch, collation_fn=None
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples", type=int, default=None, help="per shard")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    per = args.samples or (2000 if args.full else 600)
    have_wds = importlib.util.find_spec("webdataset") is not None
    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-bench-tar-"))
    rows: list[str] = []
    try:
        urls, total_bytes = _write_shards(tmp / "wds", args.shards, per)
        n = args.shards * per
        start = time.perf_counter()
        convert(str(tmp / "wds"), str(tmp / "conv"), workers=2, progress_bar=False)
        t_convert = time.perf_counter() - start
        tar_ds = TarDataset(urls)
        mm = MemmapDataset(tmp / "conv")
        assert len(tar_ds) == len(mm) == n
        gen = torch.Generator()
        subjects: dict[str, Callable[[int], tuple[Iterable[Any], Callable[[Any], Any]]]] = {
            "(b) feedpipe TarDataset": lambda w: (
                DataLoader(tar_ds, batch_size=args.batch, num_workers=w, collate_fn=samples_list),
                _count_dicts,
            ),
            "(c) feedpipe after convert, in order": lambda w: (
                DataLoader(mm, batch_size=args.batch, num_workers=w),
                _count_memmap,
            ),
            "(c) feedpipe after convert, shuffled": lambda w: (
                DataLoader(
                    mm, args.batch, num_workers=w, shuffle=True, generator=gen.manual_seed(0)
                ),
                _count_memmap,
            ),
        }
        if have_wds:
            subjects = {
                "(a) WebDataset": lambda w: (_wds(urls, args.batch, w), _count_dicts),
                **subjects,
            }
        results: dict[tuple[str, int], float] = {}
        for workers in (0, 2):
            for _ in range(args.reps):  # interleaved repetitions, best kept
                for name, make in subjects.items():
                    loader, count = make(workers)
                    secs, got, nbytes = _epoch(loader, count)
                    if (got, nbytes) != (n, total_bytes):
                        want = f"want {n}, {total_bytes}"
                        raise RuntimeError(f"{name}: {got} samples, {nbytes} B; {want}")
                    key = (name, workers)
                    results[key] = max(results.get(key, 0.0), n / secs)
        for workers in (0, 2):
            base = results.get(("(a) WebDataset", workers))
            for name in subjects:
                rate = results[(name, workers)]
                ratio = "1.00" if name.startswith("(a)") else (f"{rate / base:.2f}" if base else "")
                print(f"{workers} workers  {name:<40} {rate:>10,.0f} samples/s  ratio {ratio}")
                rows.append(f"| {name} | {workers} | {rate:,.0f} | {ratio} |")
            if base is None:
                rows.append(f"| (a) WebDataset | {workers} | not installed: not measured | |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mb = total_bytes / 2**20
    print(f"feedpipe convert of the tars (2 workers): {t_convert:.2f} s")
    if not args.no_write:
        cmd = "python benchmarks/tar_read.py" + (" --full" if args.full else "")
        write_section(
            "tar_read",
            "## Reading WebDataset tar shards: WebDataset vs feedpipe\n\n"
            f"{machine()}; load average {load:.1f} at the start. "
            f"Command: `{cmd}`. {args.shards} shards of {per} samples "
            f"({mb:.0f} MiB of `jpg` bytes, 4 to 28 KiB each, plus `cls`), raw bytes (no "
            f"decoding), batches of {args.batch}, page cache warm, best of {args.reps} "
            "interleaved epochs. WebDataset: `WebDataset(urls, shardshuffle=False)"
            ".batched(B, collation_fn=None)` through `WebLoader(batch_size=None)` (its "
            "documented fast path). feedpipe: `TarDataset` (the same sample dicts, "
            "`collate_fn` returning the list), and `MemmapDataset` after `feedpipe convert` "
            f"of the same tars (took {t_convert:.2f} s with 2 workers; default collation). "
            "Workers are processes. Ratio: samples/s / WebDataset's at the same worker count."
            "\n\n| subject | workers | samples/s | ratio |\n|---|---|---|---|\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
