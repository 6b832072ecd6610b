"""MemmapDataset over s3:// through the shared ShardCache (lazy mode)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from test_stage import make_dataset, upload

from feedpipe import MemmapDataset


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
    assert remote._cache.pinned_files()
    remote.close()
    assert remote._cache.pinned_files() == []
    clone.close()


def test_remote_memmap_dataset_needs_cache_dir(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=1, nbytes=2000)
    ds = MemmapDataset(upload(tmp_path / "src", bucket, opts), storage_options=opts)
    with pytest.raises(NotImplementedError, match="cache_dir"):
        ds[0]
