"""Sharded datasets against a hand-written torch baseline, a peer library and a copy ceiling.

Subjects: ``feedpipe.DataLoader`` over ``MemmapDataset`` and over ``ZarrDataset`` (uncompressed
and zstd; TensorStore). Baselines, all in the same run, from the page cache, shuffled:

  (a) torch DataLoader over per-sample ``np.memmap`` indexing (best of 0 and 2 workers);
  (b) torch DataLoader with a hand-written ``__getitems__`` (one sorted ``np.take`` per batch);
  (c) LitData / WebDataset in their own formats when installed (skipped with a note otherwise);
  (d) the ceiling: one contiguous copy per batch of the same bytes into a preallocated buffer.

Record sizes 512 B (128 int32), 8 KiB (2048 int32) and 256 KiB. Each configuration runs for a
fixed time per repetition (repetitions interleaved, best kept). Then the loader's peak RSS is
sampled over an epoch of a dataset much larger than its batch buffers.

    python benchmarks/datasets.py            # --quick (default): under ~3 minutes
    python benchmarks/datasets.py --full     # longer runs, a larger RSS dataset
    python benchmarks/datasets.py --no-write # do not rewrite docs/benchmarks.md

The shard-count axis (``--shards``, its own section of docs/benchmarks.md): the same records
in 1, 80 and 10,000 shards, read by ``feedpipe.DataLoader`` over ``MemmapDataset``, against
baseline (b) over one ``.npy`` of the same records, in the same run; the ratio is printed.
Where a record size has fewer records than shards, shard files are hard links to a smaller set
of distinct one-record files (the index lists every shard; the page cache holds the same
bytes as the baseline's file).

    python benchmarks/datasets.py --shards   # the shard-count axis only: under ~2 minutes
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from feedpipe import DataLoader, MemmapDataset, MemmapWriter, ZarrDataset
from feedpipe.format import FileInfo, Index, Layout, Shard, write_index
from feedpipe.io.crc import crc32c_file, to_hex

SIZES = {512: 256, 8192: 256, 262144: 32}  # record bytes -> batch size


# ---------------------------------------------------------------------- baseline datasets
class PerSample(Dataset[Any]):
    """(a) The typical user dataset: index a ``np.memmap`` per sample."""

    def __init__(self, path: str, n: int, width: int) -> None:
        self.path, self.n, self.width = path, n, width
        self.mm: np.memmap | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.int32, mode="r", shape=(self.n, self.width))
        return torch.from_numpy(np.array(self.mm[i]))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "mm": None}


class SortedTake(PerSample):
    """(b) The best a torch user writes by hand: one sorted ``np.take`` per batch."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.int32, mode="r", shape=(self.n, self.width))
        idx = np.asarray(indices)
        order = np.argsort(idx)
        rows = np.empty((len(idx), self.width), np.int32)
        rows[order] = np.take(self.mm, idx[order], axis=0)
        return list(torch.from_numpy(rows))


# ---------------------------------------------------------------------- measurement
def measure(make_iter: Callable[[], Iterable[Any]], batch: int, seconds: float) -> float:
    """Samples/s over ``seconds`` (after 2 warm-up batches); epochs restart as needed."""
    it = iter(make_iter())
    for _ in range(2):
        try:
            next(it)
        except StopIteration:
            it = iter(make_iter())
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            b = next(it)
        except StopIteration:
            it = iter(make_iter())
            continue
        count += len(b) if isinstance(b, torch.Tensor) else batch
    return count / (time.perf_counter() - start)


def ceiling(raw: np.ndarray, batch: int, seconds: float) -> Callable[[], Iterable[Any]]:
    """(d) one contiguous copy of ``batch`` records per batch into a preallocated buffer."""
    flat = raw.reshape(len(raw), -1)
    buf = np.empty((batch, flat.shape[1]), flat.dtype)
    nb = len(flat) // batch
    order = np.random.default_rng(0).permutation(nb)

    def gen() -> Iterable[Any]:
        for k in order:
            np.copyto(buf, flat[k * batch : (k + 1) * batch])
            yield torch.from_numpy(buf)

    return gen


def take_alone(raw: np.ndarray, batch: int, mode: str) -> Callable[[], Iterable[Any]]:
    """``np.take`` of shuffled batches from the raw map into a preallocated buffer (no loader):
    ``mode="clip"`` (what MemmapDataset uses) or numpy's default ``"raise"``."""
    flat = raw.reshape(len(raw), -1)
    buf = np.empty((batch, flat.shape[1]), flat.dtype)
    perm = np.random.default_rng(1).permutation(len(flat))

    def gen() -> Iterable[Any]:
        for k in range(len(flat) // batch):
            np.take(flat, perm[k * batch : (k + 1) * batch], axis=0, out=buf, mode=mode)
            yield torch.from_numpy(buf)

    return gen


def _warm(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass


def build(root: Path, rb: int, total: int) -> dict[str, Any]:
    """Write the raw memmap file, a MemmapDataset and two Zarr arrays with the same records."""
    import tensorstore as ts

    width = rb // 4
    n = total // rb
    rng = np.random.default_rng(rb)
    raw_path = root / f"raw-{rb}.bin"
    raw = np.memmap(raw_path, dtype=np.int32, mode="w+", shape=(n, width))
    step = max(1, (64 << 20) // rb)
    with MemmapWriter(root / f"memmap-{rb}", shape=(width,), dtype="int32") as w:
        for a in range(0, n, step):
            block = rng.integers(0, 50_000, (min(step, n - a), width), dtype=np.int32)
            raw[a : a + len(block)] = block
            w.append_batch(block)
    raw.flush()
    per_shard = max(1, (32 << 20) // rb)
    bytes_codec = {"name": "bytes", "configuration": {"endian": "little"}}
    zstd = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
    for name, inner in (("zarr", [bytes_codec]), ("zarr-zstd", [bytes_codec, zstd])):
        # written with TensorStore (zarr-python is slow at one chunk per record); v3 sharding
        # codec, one inner chunk per record, so a shuffled read touches only its record
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(root / f"{name}-{rb}")},
            "metadata": {
                "shape": [n, width],
                "data_type": "int32",
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": [per_shard, width]},
                },
                "codecs": [
                    {
                        "name": "sharding_indexed",
                        "configuration": {
                            "chunk_shape": [1, width],
                            "codecs": inner,
                            "index_codecs": [bytes_codec, {"name": "crc32c"}],
                        },
                    }
                ],
            },
        }
        store = ts.open(spec, create=True, delete_existing=True).result()
        for a in range(0, n, per_shard):
            store[a : a + per_shard].write(np.asarray(raw[a : a + per_shard])).result()
    for p in root.iterdir():
        if p.name.endswith(f"-{rb}") or p.name.endswith(f"-{rb}.bin"):
            _warm(p)
    return {"raw_path": str(raw_path), "n": n, "width": width, "raw": raw}


def run_size(root: Path, rb: int, total: int, seconds: float, reps: int) -> dict[str, float]:
    batch = SIZES[rb]
    d = build(root, rb, total)
    n, width, raw_path = d["n"], d["width"], d["raw_path"]
    mds = MemmapDataset(root / f"memmap-{rb}")
    zds = ZarrDataset(root / f"zarr-{rb}")
    zzs = ZarrDataset(root / f"zarr-zstd-{rb}")

    def torch_loader(ds: Dataset[Any], workers: int) -> Callable[[], Iterable[Any]]:
        loader = TorchLoader(
            ds,
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            drop_last=True,
        )
        return lambda: loader

    def fp_loader(ds: Any, workers: int) -> Callable[[], Iterable[Any]]:
        loader = DataLoader(
            ds,
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            worker_type="thread",
            drop_last=True,
        )
        return lambda: loader

    configs: dict[str, Callable[[], Iterable[Any]]] = {
        "(a) per-sample, 0 workers": torch_loader(PerSample(raw_path, n, width), 0),
        "(a) per-sample, 2 workers": torch_loader(PerSample(raw_path, n, width), 2),
        "(b) sorted np.take, 0 workers": torch_loader(SortedTake(raw_path, n, width), 0),
        "(b) sorted np.take, 2 workers": torch_loader(SortedTake(raw_path, n, width), 2),
        "MemmapDataset, 0 workers": fp_loader(mds, 0),
        "MemmapDataset, 2 threads": fp_loader(mds, 2),
        "ZarrDataset, 0 workers": fp_loader(zds, 0),
        "ZarrDataset, 2 threads": fp_loader(zds, 2),
        "ZarrDataset zstd, 2 threads": fp_loader(zzs, 2),
        "(d) contiguous copy": ceiling(d["raw"], batch, seconds),
        "np.take alone, mode='clip'": take_alone(d["raw"], batch, "clip"),
        "np.take alone, mode='raise'": take_alone(d["raw"], batch, "raise"),
    }
    best: dict[str, float] = {}
    for _ in range(reps):
        for name, make in configs.items():
            rate = measure(make, batch, seconds)
            best[name] = max(best.get(name, 0.0), rate)
            print(
                f"  {rb:>6} B  {name:<32} {rate:>12,.0f} samples/s  {rate * rb / 1e9:6.2f} GB/s",
                flush=True,
            )
    del configs
    gc.collect()
    return best


# ---------------------------------------------------------------------- shard-count axis
SHARD_COUNTS = (1, 80, 10_000)


def write_shards(path: Path, rows: np.ndarray, shards: int) -> int:
    """Write ``rows`` as a dataset of exactly ``shards`` shards (near-equal record counts);
    with fewer rows than shards, shard ``s`` is a hard link to one-row file ``s % len(rows)``.
    Returns the number of records the dataset holds."""
    path.mkdir(parents=True)
    parts = np.array_split(rows, shards) if shards <= len(rows) else None
    entries: list[Shard] = []
    distinct: list[FileInfo] = []
    for s in range(shards):
        rel = f"shard-{s:05d}.data"
        if parts is not None:
            (path / rel).write_bytes(parts[s].tobytes())
            crc, nbytes = crc32c_file(str(path / rel))
            info, records = FileInfo(rel, nbytes, to_hex(crc)), len(parts[s])
        else:
            k = s % len(rows)
            if s < len(rows):
                (path / rel).write_bytes(rows[k].tobytes())
                crc, nbytes = crc32c_file(str(path / rel))
                distinct.append(FileInfo(rel, nbytes, to_hex(crc)))
            else:
                (path / rel).hardlink_to(path / distinct[k].path)
            info, records = FileInfo(rel, distinct[k].bytes, distinct[k].crc32c), 1
        entries.append(Shard(records, {"data": info}))
    layout = Layout("fixed", tuple(rows.shape[1:]), str(rows.dtype))
    write_index(path, Index(layout, {}, entries))
    return sum(e.records for e in entries)


class NpyTake(SortedTake):
    """(b) over one ``.npy`` (``np.load(mmap_mode="r")``)."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        if self.mm is None:
            self.mm = np.load(self.path, mmap_mode="r")
        return super().__getitems__(indices)


Result = tuple[dict[str, float], dict[int, float], dict[str, float]]


def shards_size(root: Path, rb: int, total: int, seconds: float, reps: int) -> Result:
    """One record size: baseline (b) and MemmapDataset at each shard count; rates, first touch."""
    batch, width = SIZES[rb], rb // 4
    n = total // rb
    rows = np.random.default_rng(rb).integers(0, 50_000, (n, width), dtype=np.int32)
    npy = root / f"raw-{rb}.npy"
    np.save(npy, rows)
    sets: dict[int, MemmapDataset] = {}
    first: dict[int, float] = {}
    for count in SHARD_COUNTS:
        write_shards(root / f"s{count}-{rb}", rows, count)
    del rows
    for p in root.iterdir():
        _warm(p) if p.is_dir() else _warm(p.parent)
    for count in SHARD_COUNTS:
        ds = sets[count] = MemmapDataset(root / f"s{count}-{rb}")
        first[count] = _touch(ds, rb)
    ideas = gather_ideas(sets[SHARD_COUNTS[-1]], root / f"s{SHARD_COUNTS[-1]}-{rb}", batch)
    # 80 shards read the way every batch was read before (one gather per shard touched); at
    # 10,000 shards that path holds two descriptors per shard, past this machine's limit
    per_shard = MemmapDataset(root / f"s{SHARD_COUNTS[1]}-{rb}")
    per_shard._files.one_range = False  # the per-shard path, kept for datasets over the map budget
    _touch(per_shard, rb)

    def torch_loader(ds: Dataset[Any], workers: int) -> Callable[[], Iterable[Any]]:
        loader = TorchLoader(
            ds,
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            drop_last=True,
        )
        return lambda: loader

    def fp_loader(ds: Any, workers: int) -> Callable[[], Iterable[Any]]:
        loader = DataLoader(
            ds,
            batch_size=batch,
            shuffle=True,
            num_workers=workers,
            worker_type="thread",
            drop_last=True,
        )
        return lambda: loader

    base = NpyTake(str(npy), n, width)
    configs: dict[str, Callable[[], Iterable[Any]]] = {
        "(b) sorted np.take, 0 workers": torch_loader(base, 0),
        "(b) sorted np.take, 2 workers": torch_loader(base, 2),
    }
    for count, ds in sets.items():
        configs[f"{count} shards, 0 workers"] = fp_loader(ds, 0)
        configs[f"{count} shards, 2 threads"] = fp_loader(ds, 2)
    configs[f"{SHARD_COUNTS[1]} shards, per-shard path, 0 workers"] = fp_loader(per_shard, 0)
    best: dict[str, float] = {}
    for _ in range(reps):
        for name, make in configs.items():
            rate = measure(make, batch, seconds)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"  {rb:>6} B  {name:<32} {rate:>12,.0f} samples/s", flush=True)
    del configs
    for ds in [*sets.values(), per_shard]:
        ds.close()
    gc.collect()
    return best, first, ideas


def gather_ideas(ds: MemmapDataset, path: Path, batch: int) -> dict[str, float]:
    """Microseconds per random batch over many shards, by the two gathers considered: one
    ``np.take`` over the one-range map (what ``read_batch`` does), and a list of per-shard
    views gathered record by record with ``np.stack(..., out=)`` (no loader, same buffer)."""
    import mmap

    space = ds._shard_space()
    assert space is not None
    rb = ds.record_bytes
    views = []
    for shard in ds.index.shards:
        with open(path / shard.files["data"].path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        views.append(np.frombuffer(mm, np.uint8).reshape(-1, rb))
    starts = np.concatenate([[0], np.cumsum([s.records for s in ds.index.shards])])
    out = np.empty((batch, rb), np.uint8)

    def views_gather(idx: np.ndarray) -> None:
        sid = np.searchsorted(starts, idx, side="right") - 1
        pairs = zip(sid.tolist(), (idx - starts[sid]).tolist(), strict=True)
        np.stack([views[s][r] for s, r in pairs], out=out)

    ways: dict[str, Callable[[np.ndarray], None]] = {
        "one range, one np.take": lambda idx: space.take(idx, out),
        "list of views, np.stack": views_gather,
    }
    rng = np.random.default_rng(3)
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(3):
        for name, fn in ways.items():
            idxs = [rng.integers(0, len(ds), batch) for _ in range(100)]
            start = time.perf_counter()
            for idx in idxs:
                fn(idx)
            best[name] = min(best[name], (time.perf_counter() - start) / 100 * 1e6)
    return best


def _touch(ds: MemmapDataset, rb: int) -> float:
    """Read every record once in 16 MiB batches (maps every shard); return the seconds."""
    step = max(1, (16 << 20) // rb)
    buf = torch.empty((step, rb // 4), dtype=torch.int32)
    start = time.perf_counter()
    for a in range(0, len(ds), step):
        ds.read_batch(np.arange(a, min(a + step, len(ds))), out=buf)
    return time.perf_counter() - start


def shards_report(results: dict[int, Result], total: int, cmd: str) -> str:
    sizes = list(results)
    head = " | ".join(f"{rb // 1024} KiB" if rb >= 1024 else f"{rb} B" for rb in sizes)
    lines = [
        f"Machine: {machine()} (the measurement machine for this section).",
        f"Command: `{cmd}`. {total >> 20} MiB of distinct records per size, shuffled, page cache "
        "warm, best of the repetitions; samples/s. Baseline (b): `torch.utils.data.DataLoader` "
        "with a hand-written `__getitems__` (one sorted `np.take` over one `.npy`); feedpipe: "
        "`feedpipe.DataLoader` (thread workers) over `MemmapDataset` of the same records in "
        "1, 80 and 10,000 shards. At 256 KiB the 10,000 shards are hard links to "
        f"{total // (256 << 10)} distinct one-record files (see the script's docstring). "
        "'per-shard path' is the 80-shard dataset read one gather per shard touched (how every "
        "batch was read before the one-range map; still the path of datasets with more shards "
        "than a quarter of `vm.max_map_count`); at 10,000 shards it cannot run here: it holds "
        "two descriptors per shard, past this machine's limit of 20,000.",
        "",
        f"| loader | {head} |",
        "|---|" + "---|" * len(sizes),
    ]
    for name in results[sizes[0]][0]:
        cells = [f"{results[rb][0][name]:,.0f}" for rb in sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"| ratio to the best (b) (0 or 2 workers) | target | {head} |",
        "|---|---|" + "---|" * len(sizes),
    ]
    names = [f"{c} shards, {w}" for c in SHARD_COUNTS for w in ("0 workers", "2 threads")]
    names.append(f"{SHARD_COUNTS[1]} shards, per-shard path, 0 workers")
    for name in names:
        cells = []
        for rb in sizes:
            rates = results[rb][0]
            base = max(v for k, v in rates.items() if k.startswith("(b)"))
            cells.append(f"{rates[name] / base:.2f}x")
        target = "-" if "per-shard" in name else ">= 1.0x"
        lines.append(f"| {name} | {target} | " + " | ".join(cells) + " |")
    missed = [
        f"{name} at {rb} B"
        for name in names[:-1]
        for rb in sizes
        if results[rb][0][name] < max(v for k, v in results[rb][0].items() if k.startswith("(b)"))
    ]
    lines += [
        "",
        "Target met in every cell."
        if not missed
        else "Target NOT met for: " + "; ".join(missed) + " (see the note below).",
    ]
    firsts = "; ".join(
        f"{rb // 1024 if rb >= 1024 else rb} {'KiB' if rb >= 1024 else 'B'}: "
        + ", ".join(f"{c:,} shards {results[rb][1][c]:.2f} s" for c in SHARD_COUNTS)
        for rb in sizes
    )
    ideas = list(results[sizes[0]][2])
    lines += [
        "",
        f"The two gathers considered, alone (no loader), {SHARD_COUNTS[-1]:,} shards, "
        "microseconds per random batch (batch sizes as above), best of 3:",
        "",
        f"| gather | {head} |",
        "|---|" + "---|" * len(sizes),
        *(
            f"| {name} | " + " | ".join(f"{results[rb][2][name]:,.0f}" for rb in sizes) + " |"
            for name in ideas
        ),
    ]
    lines += [
        "",
        "First touch (not in the rates above: one pass over the dataset before measuring, which "
        "maps every shard into the dataset's one address range, closes its descriptor and "
        f"watches it with inotify): {firsts}.",
    ]
    return "\n".join(lines)


def run_shards(args: argparse.Namespace) -> None:
    total, seconds, reps = (32 << 20, 0.5, 2)
    if args.full:
        total, seconds, reps = (256 << 20, 2.0, 3)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="feedpipe-bench-shards-", dir=args.dir))
    results: dict[int, Result] = {}
    try:
        for rb in SIZES:
            print(f"records of {rb} B, shards {SHARD_COUNTS}", flush=True)
            results[rb] = shards_size(root, rb, total, seconds, reps)
            for p in list(root.iterdir()):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cmd = "python benchmarks/datasets.py --shards" + (" --full" if args.full else "")
    text = shards_report(results, total, cmd)
    print()
    print(text)
    if not args.no_write:
        write_section("datasets_shards", text)


# ---------------------------------------------------------------------- RSS over an epoch
def _rss() -> tuple[int, int]:
    anon = file = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) << 10
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) << 10
    return anon, file


def rss_epoch(root: Path, total: int) -> dict[str, Any]:
    """One shuffled epoch over ``total`` bytes of 8 KiB records; sample RSS every few batches."""
    rb, batch = 8192, 256
    path = root / "rss"
    n = total // rb
    with MemmapWriter(path, shape=(rb // 4,), dtype="int32") as w:
        block = np.arange(65536 * (rb // 4), dtype=np.int32).reshape(65536, rb // 4)
        for a in range(0, n, 65536):
            w.append_batch(block[: min(65536, n - a)])
    del block
    gc.collect()
    ds = MemmapDataset(path)
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=2, worker_type="thread")
    samples: list[tuple[int, int, int]] = []
    start = time.perf_counter()
    for k, b in enumerate(loader):
        if k % 50 == 0:
            samples.append((k * batch, *_rss()))
        del b
    seconds = time.perf_counter() - start
    samples.append((n, *_rss()))
    shutil.rmtree(path)
    anon = [s[1] for s in samples]
    return {
        "records": n,
        "bytes": n * rb,
        "seconds": seconds,
        "batch_bytes": batch * rb,
        "anon_first": anon[0],
        "anon_peak": max(anon),
        "anon_last": anon[-1],
        "file_peak": max(s[2] for s in samples),
    }


# ---------------------------------------------------------------------- report
def _peers_note() -> str:
    missing = []
    for mod in ("litdata", "webdataset"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        return (
            f"(c) peer libraries: {', '.join(missing)} not installed "
            "(pip install 'feedpipe[bench]'); skipped."
        )
    return "(c) peer libraries installed but not yet wired into this script; skipped."


def report(results: dict[int, dict[str, float]], rss: dict[str, Any], cmd: str) -> str:
    lines = [
        f"Machine: {machine()}",
        f"Command: `{cmd}`. Shuffled, page cache warm, best of the repetitions; samples/s (GB/s).",
        "`torch.set_num_threads(1)` in the main process (the baselines' best setting here).",
        "feedpipe runs `feedpipe.DataLoader` (thread workers, `read_batch` path); torch runs "
        "`torch.utils.data.DataLoader`.",
        "",
        "| loader | "
        + " | ".join(
            f"{rb // 1024 if rb >= 1024 else rb} {'KiB' if rb >= 1024 else 'B'}" for rb in results
        )
        + " |",
        "|---|" + "---|" * len(results),
    ]
    names = list(next(iter(results.values())))
    for name in names:
        cells = [f"{results[rb][name]:,.0f} ({results[rb][name] * rb / 1e9:.2f})" for rb in results]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    def best(r: dict[str, float], prefix: str) -> float:
        return max(v for k, v in r.items() if k.startswith(prefix))

    lines += [
        "",
        "| ratio | target | " + " | ".join(str(rb) for rb in results) + " |",
        "|---|---|" + "---|" * len(results),
    ]
    rows = [
        ("MemmapDataset / (b)", ">= 1.0", "MemmapDataset", "(b)"),
        ("MemmapDataset / (a)", ">= 10 @512 B, >= 2.5 @8 KiB", "MemmapDataset", "(a)"),
        ("MemmapDataset / (d)", ">= 0.8 @8 KiB, 256 KiB", "MemmapDataset", "(d)"),
        ("ZarrDataset / MemmapDataset", ">= 0.5", "ZarrDataset,", "MemmapDataset"),
        ("ZarrDataset zstd / MemmapDataset", "-", "ZarrDataset zstd", "MemmapDataset"),
    ]
    for label, target, num, den in rows:
        cells = [f"{best(results[rb], num) / best(results[rb], den):.2f}x" for rb in results]
        lines.append(f"| {label} | {target} | " + " | ".join(cells) + " |")
    kib8 = results.get(8192)
    if kib8:
        gbps = {k: v * 8192 / 1e9 for k, v in kib8.items()}
        clip, raise_ = gbps["np.take alone, mode='clip'"], gbps["np.take alone, mode='raise'"]
        lines += [
            "",
            'Notes: the gathers use `np.take(..., mode="clip")` straight into the batch; numpy\'s '
            'default `mode="raise"` gathers into a temporary and copies again (at 8 KiB, alone: '
            f"{raise_:.2f} against {clip:.2f} GB/s, rows above). A shuffled 8 KiB gather alone "
            f"reaches {clip / gbps['(d) contiguous copy']:.2f} of the contiguous copy here: it "
            "touches two 4 KiB page-cache pages per record at random. Earlier attempts to close "
            "that gap (`madvise` HUGEPAGE/WILLNEED/RANDOM, `preadv` per record, two threads per "
            "batch) did not; they are not re-measured here.",
        ]
    lines += [
        "",
        _peers_note(),
        "",
        f"Peak RSS over one shuffled epoch of {rss['bytes'] / 2**30:.1f} GiB "
        f"({rss['records']:,} records of 8 KiB, batches of {rss['batch_bytes'] >> 20} MiB, "
        f"2 thread workers, {rss['seconds']:.1f} s): anonymous memory "
        f"{rss['anon_first'] / 2**20:.0f} MiB at the start, "
        f"peak {rss['anon_peak'] / 2**20:.0f} MiB, "
        f"{rss['anon_last'] / 2**20:.0f} MiB at the end; mapped file pages (RssFile, page cache "
        f"shared with the kernel, reclaimable) peaked at {rss['file_peak'] / 2**20:.0f} MiB.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: under ~3 minutes")
    mode.add_argument("--full", action="store_true", help="longer runs and a larger RSS dataset")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--shards", action="store_true", help="only the shard-count axis")
    args = ap.parse_args()
    if args.shards:
        run_shards(args)
        return
    total, seconds, reps, rss_total = (96 << 20, 0.7, 2, 2 << 30)
    if args.full:
        total, seconds, reps, rss_total = (1 << 30, 3.0, 3, 6 << 30)
    # torch's intra-op threads make default_collate 20x slower on this busy 2-core machine
    # (43 vs 2 ms for 32 x 256 KiB); one thread is the baselines' best setting
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="feedpipe-bench-", dir=args.dir))
    try:
        results: dict[int, dict[str, float]] = {}
        for rb in SIZES:
            print(f"records of {rb} B: {total // rb:,} records ({total >> 20} MiB)", flush=True)
            results[rb] = run_size(root, rb, total, seconds, reps)
            for p in list(root.iterdir()):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"RSS over one epoch of {rss_total >> 20} MiB ...", flush=True)
        rss = rss_epoch(root, rss_total)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cmd = "python benchmarks/datasets.py" + (" --full" if args.full else "")
    text = report(results, rss, cmd)
    print()
    print(text)
    if not args.no_write:
        write_section("datasets", text)


if __name__ == "__main__":
    main()
