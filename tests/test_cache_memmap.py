"""MemmapDataset over s3:// through the shared ShardCache (lazy mode)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from test_stage import make_dataset, upload

from feedpipe import MemmapDataset
from feedpipe.remote import transfer as _remote


def test_remote_memmap_dataset_reads_through_cache(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=4, nbytes=20_000)
    url = upload(tmp_path / "src", bucket, opts)
    local = MemmapDataset(tmp_path / "src")
    remote = MemmapDataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
    assert len(remote) == len(local) == 80
    first = remote[0]
    assert remote._cache.stats.downloads >= 2  # shard 0 (data + label), readahead queued
    assert torch.equal(first["data"], local[0]["data"])
    idx = [79, 3, 41, 22, 60]
    for a, b in zip(remote.__getitems__(idx), local.__getitems__(idx), strict=True):
        assert torch.equal(a["data"], b["data"]) and int(a["label"]) == int(b["label"])
    # pickles (as for DataLoader workers) and reads from the same cache without downloading
    clone = pickle.loads(pickle.dumps(remote))
    assert torch.equal(clone[55]["data"], local[55]["data"])
    assert clone._cache.stats.downloads == 0
    assert remote._cache.leased_files()
    remote.close()
    assert remote._cache.leased_files() == []
    clone.close()


def test_remote_memmap_dataset_needs_cache_dir(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=1, nbytes=2000)
    ds = MemmapDataset(upload(tmp_path / "src", bucket, opts), storage_options=opts)
    with pytest.raises(NotImplementedError, match="cache_dir"):
        ds[0]


def _cache_bytes(cache_dir: Path) -> int:
    """Bytes the cache counts against its limit: shard files and download temps. A file seen
    both as its temp and, renamed meanwhile, under its final name counts once. The walk is not
    atomic: a shard evicted while the walk went on, before a download that took its room
    began, could be counted beside that download (they never coexisted; seen once in a fresh
    clone's suite), so a file counts only if it still exists once the walk is done."""
    sizes: dict[str, int] = {}
    found: list[tuple[Path, int]] = []
    for p in list(cache_dir.rglob("*")):
        skip = ".locks" in p.parts or p.name in ("index.json", ".cache.lock", ".pressure")
        try:
            if skip or not p.is_file():
                continue
            size = p.stat().st_size
        except FileNotFoundError:  # renamed or evicted while walking
            continue
        found.append((p, size))
    for p, size in found:
        if not p.exists():  # evicted (or renamed to its final name) during the walk
            continue
        target = _remote.temp_target(p.name)
        name = p.name if target is None else target[0]
        sizes[name] = max(sizes.get(name, 0), size)
    return sum(sizes.values())


@pytest.mark.parametrize(("workers", "kind"), [(0, "thread"), (2, "thread"), (2, "process")])
def test_remote_epoch_under_a_cache_limit_smaller_than_the_epoch(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], workers: int, kind: str
) -> None:
    """8 shards, room for ~3: a shuffled epoch evicts LRU shards instead of waiting for room.

    Process workers each keep an idle shard open: they must drop it when another waits."""
    from feedpipe import DataLoader

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=8, nbytes=16_000)  # 16 records of 1000 B per shard
    url = upload(tmp_path / "src", bucket, opts)
    local = MemmapDataset(tmp_path / "src")
    shard = 16 * 1000 + 16 * 8  # data + label column
    limit = 3 * shard + 100
    remote = MemmapDataset(
        url, cache_dir=tmp_path / "cache", cache_limit_bytes=limit, storage_options=opts
    )
    remote._shard_cache().room_timeout_s = 5.0  # a regression fails fast instead of after 30 s
    torch.manual_seed(0)
    loader = DataLoader(
        remote,
        batch_size=10,
        shuffle=True,
        num_workers=workers,
        worker_type=kind,
        timeout=60 if workers else 0,
    )
    seen: list[int] = []
    for batch in loader:
        labels = batch["label"].tolist()
        expect = local.read_batch(labels)
        assert torch.equal(batch["data"], expect["data"])
        seen += labels
        assert _cache_bytes(tmp_path / "cache") <= limit
    assert sorted(seen) == list(range(len(local)))
    cache = remote._shard_cache()
    assert len(list(Path(cache.dir).glob("shard-*.data"))) <= 3  # the rest was evicted
    if kind == "thread":  # the counters are per process
        assert cache.stats.evictions > 0
    # consecutive reads of one shard neither reopen nor fetch it again
    remote.read_batch([0, 1, 2])
    before, shard0 = cache.stats.downloads, remote._open_files()._open[0]
    remote.read_batch([3, 4, 5])
    assert remote._open_files()._open[0] is shard0 and cache.stats.downloads == before
    remote.close()
    assert cache.leased_files() == []


def test_idle_shards_are_unpinned_when_a_download_waits_for_room(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A download that waits for room (any process) makes readers drop idle pins next read."""
    from feedpipe.errors import DatasetError
    from feedpipe.remote.cache import ShardCache

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=4, nbytes=16_000)
    url = upload(tmp_path / "src", bucket, opts)
    shard = 16 * 1000 + 16 * 8
    ds = MemmapDataset(
        url, cache_dir=tmp_path / "cache", cache_limit_bytes=7 * shard, storage_options=opts
    )
    ds.read_batch([0, 16])  # shards 0 and 1: both stay open (idle) and pinned
    files = ds._open_files()
    assert files.is_open(0) and files.is_open(1)
    # another reader (own lock fds, as another process) finds no room and times out waiting
    other = ShardCache(url, tmp_path / "cache", 16_000, opts, room_timeout_s=0.3)
    with pytest.raises(DatasetError, match="leased by readers"):
        other.acquire("shard-00003.data")
    assert other.pressure_changed() and not other.pressure_changed()
    ds.read_batch([32])  # sees the pressure: drops its idle shards before reading shard 2
    assert not files.is_open(0) and not files.is_open(1) and files.is_open(2)
    assert sorted(ds._shard_cache().leased_files()) == ["shard-00002.data"]
    other.close()
    ds.close()
