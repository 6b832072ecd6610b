"""Download amplification of the lazy ``ShardCache``: Belady (the loader's plan) vs plain LRU.

A remote dataset read through ``MemmapDataset(url, cache_dir=..., cache_limit_bytes=...)`` with
the documented block shuffle (``DistributedSampler(shuffle_mode="block",
block_size=samples_per_shard)``). The "remote" is a local directory behind a counting fsspec
filesystem (``countfile://``), so every byte the cache downloads is counted by the filesystem
itself. Amplification = bytes downloaded / (dataset bytes x epochs). Both policies run in the
same run, on the same dataset and order: LRU is the same dataset with the plan turned off.

    .venv/bin/python benchmarks/cache_policy.py
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, write_section


def counting_filesystem() -> type:
    """Register ``countfile://``: the local filesystem, counting the bytes each download copies."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class CountingFileSystem(LocalFileSystem):  # type: ignore[misc]
        protocol = ("countfile",)
        root_marker = "/"
        downloaded: ClassVar[dict[str, int]] = {"bytes": 0, "files": 0}
        lock = threading.Lock()

        @classmethod
        def _strip_protocol(cls, path: Any) -> str:
            text = str(path)
            if text.startswith("countfile://"):
                text = text[len("countfile://") :]
            return str(super()._strip_protocol(text))

        def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
            super().get_file(rpath, lpath, **kwargs)
            size = Path(lpath).stat().st_size
            with self.lock:
                self.downloaded["bytes"] += size
                self.downloaded["files"] += 1

    fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)
    return CountingFileSystem


def make_dataset(root: Path, shards: int, records: int, record_bytes: int) -> int:
    """A fixed-layout dataset with a label field; returns its total bytes."""
    from feedpipe import MemmapWriter

    rng = np.random.default_rng(0)
    with MemmapWriter(
        root,
        shape=(record_bytes,),
        dtype="uint8",
        fields={"label": "int64"},
        shard_bytes=records * record_bytes,
    ) as w:
        for s in range(shards):
            block = rng.integers(0, 256, (records, record_bytes), dtype=np.uint8)
            w.append_batch(block, label=np.arange(records) + s * records)
    return sum(p.stat().st_size for p in root.iterdir() if p.name != "index.json")


def run_epochs(
    url: str,
    cache: Path,
    limit: int,
    *,
    plan: bool,
    workers: int,
    epochs: int,
    block: int,
    batch: int,
) -> tuple[int, float]:
    """Bytes downloaded and seconds for ``epochs`` block-shuffled epochs through the loader."""
    from feedpipe import DataLoader, DistributedSampler, MemmapDataset

    class NoPlan(MemmapDataset):
        def plan_horizon(self) -> int:  # the same dataset, without the loader's plan: LRU
            return 0

    counter = counting_filesystem()
    shutil.rmtree(cache, ignore_errors=True)
    ds = (MemmapDataset if plan else NoPlan)(url, cache_dir=cache, cache_limit_bytes=limit)
    sampler = DistributedSampler(
        ds, num_replicas=1, rank=0, shuffle_mode="block", block_size=block, seed=1
    )
    loader = DataLoader(
        ds,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        worker_type="thread" if workers else "process",
    )
    before = counter.downloaded["bytes"]
    t0 = time.perf_counter()
    seen = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for b in loader:
            seen += len(b["label"])
    dt = time.perf_counter() - t0
    assert seen == epochs * len(ds), (seen, len(ds))
    ds.close()
    return counter.downloaded["bytes"] - before, dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--records", type=int, default=64, help="records per shard")
    ap.add_argument("--record-kb", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="feedpipe-cache-policy-"))
    rows = []
    try:
        total = make_dataset(tmp / "src", args.shards, args.records, args.record_kb << 10)
        url = f"countfile://{tmp / 'src'}"
        shard = args.records * (args.record_kb << 10)
        for frac, label in ((0.2, "20% of the dataset"), (1.1, "holds the dataset")):
            limit = int(total * frac)
            for workers in (0, 2):
                got = {}
                for plan in (False, True):
                    nbytes, dt = run_epochs(
                        url,
                        tmp / "cache",
                        limit,
                        plan=plan,
                        workers=workers,
                        epochs=args.epochs,
                        block=args.records,
                        batch=args.batch,
                    )
                    got[plan] = (nbytes / (total * args.epochs), dt)
                rows.append((label, limit, workers, got[False], got[True]))
                print(
                    f"limit {label} ({limit / 2**20:.1f} MiB), workers={workers}: LRU "
                    f"{got[False][0]:.2f}x, Belady {got[True][0]:.2f}x",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cmd = (
        f"python benchmarks/cache_policy.py --shards {args.shards} --records {args.records} "
        f"--record-kb {args.record_kb} --batch {args.batch} --epochs {args.epochs}"
    )
    lines = [
        "## Lazy cache eviction: Belady (the loader's plan) vs LRU",
        "",
        f"Machine: {machine()}  ",
        f"Command: `{cmd}`",
        "",
        f"Dataset: {args.shards} shards of {shard / 2**20:.2f} MiB ({args.records} records of "
        f"{args.record_kb} KiB, plus a label file each), {total / 2**20:.1f} MiB, read through "
        "`MemmapDataset(url, cache_dir=..., cache_limit_bytes=...)` from a counting fsspec "
        "filesystem over local files; `DataLoader(batch_size="
        f'{args.batch})` with `DistributedSampler(shuffle_mode="block", '
        f"block_size={args.records})`; {args.epochs} epochs. Amplification = bytes downloaded "
        "(counted by the filesystem) / (dataset bytes x epochs). LRU is the same dataset with "
        "the plan turned off, in the same run.",
        "",
        "| cache limit | workers | LRU amplification | Belady amplification | target | "
        "LRU s | Belady s |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for label, limit, workers, lru, bel in rows:
        target = 1.5 if label.startswith("20%") else 1.05
        ok = bel[0] <= target
        lines.append(
            f"| {label} ({limit / 2**20:.1f} MiB) | {workers or 'main thread'}"
            f"{' threads' if workers else ''} | {lru[0]:.2f}x | **{bel[0]:.2f}x** | "
            f"<= {target}x: {'met' if ok else 'NOT met'} | {lru[1]:.2f} | {bel[1]:.2f} |"
        )
    lines += [
        "",
        "Belady evicts first the files no planned read uses, then the one needed farthest in "
        "the future; the loader plans twice the samples that fill the limit ahead of its reads "
        "(`feedpipe.remote.plan`). Worker processes read their own copies of the dataset, which "
        "the loader cannot reach: they evict least recently used first.",
    ]
    if not args.no_write:
        write_section("cache_policy", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
