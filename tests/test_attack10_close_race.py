"""Attack on the narrowed close fallbacks (``MapsClosedError``): a close by another thread
landing between a read taking the dataset's one-range map and gathering from it. The single
dataset's small-batch path falls back (tests/test_gather_maps_closed.py); the general batch
gather and the one-record read must too (the maps reopen on the next read, as ``close()``
promises), never hand the caller a bare "maps are closed" ValueError.

The close is made to land there deterministically: from inside the map's first ``take``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import MemmapDataset, MemmapWriter
from feedpipe.datasets._gather import ShardSpace


def _dataset(path: Path, n: int = 600, record: int = 64, shard_records: int = 100) -> MemmapDataset:
    x = ((np.arange(n)[:, None] * 7 + np.arange(record)[None, :]) % 251).astype(np.uint8)
    with MemmapWriter(
        path, shape=(record,), dtype="uint8", shard_bytes=shard_records * record
    ) as w:
        w.append_batch(x)
    return MemmapDataset(path)


def _close_at_first_take(monkeypatch: pytest.MonkeyPatch, ds: MemmapDataset) -> list[int]:
    space = ds.record_space()
    assert isinstance(space, ShardSpace)
    real: Callable[..., Any] = space.take
    calls: list[int] = []

    def take(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            ds.close()  # another thread's close, landing here
        return real(*args, **kwargs)

    monkeypatch.setattr(space, "take", take)
    return calls


def test_batch_gather_reads_when_the_maps_close_before_its_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = _dataset(tmp_path / "d")
    idx = np.random.default_rng(0).permutation(600)[:300].astype(np.int64)  # a big batch
    want = torch.stack([torch.as_tensor(np.asarray(ds[int(i)])) for i in idx])
    calls = _close_at_first_take(monkeypatch, ds)
    got = ds.read_batch(idx)
    assert calls, "the batch did not go through the one-range map's take"
    assert torch.equal(got, want)
    ds.close()


def test_one_record_reads_when_the_maps_close_before_its_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = _dataset(tmp_path / "d")
    want = torch.as_tensor(np.asarray(ds[457])).clone()
    calls = _close_at_first_take(monkeypatch, ds)
    got = ds[457]
    assert calls, "the record did not go through the one-range map's take"
    assert torch.equal(torch.as_tensor(np.asarray(got)), want)
    ds.close()


def test_a_read_racing_close_leaves_no_lease_after_the_next_close(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A remote dataset's read took its open files (``files()``), then another thread's
    ``close()`` ran, then the read opened its shard: that shard's cache lease must end with
    the dataset's next ``close()`` (else the cache can never evict it)."""
    from test_stage import make_dataset, upload

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=3, nbytes=4_000)
    url = upload(tmp_path / "src", bucket, opts)
    remote = MemmapDataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
    remote.read_batch(np.array([0]))
    taken = remote._files.files()  # the read, before the close lands
    remote.close()  # another thread's close
    with taken.use(2):  # the read goes on: shard 2 opened and leased
        cache = remote._files.source._cache  # the cache that read made (the closed one's heir)
        assert cache is not None and cache.leased_files()
    remote.close()
    assert cache.leased_files() == [], "a lease outlived close()"
