"""MemmapDataset(read=...): the preadv path for fixed records equals the mmap path; bad input."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from feedpipe import DatasetError, MemmapDataset, MemmapWriter


def _write(tmp: Path, n: int, record: int, shard_bytes: int) -> tuple[Path, np.ndarray]:
    x = np.random.default_rng(1).integers(0, 256, (n, record), dtype=np.uint8)
    path = tmp / f"rec{record}"
    with MemmapWriter(
        path, shape=(record,), dtype="uint8", shard_bytes=shard_bytes, fields={"label": "int64"}
    ) as w:
        w.append_batch(x, label=np.arange(n, dtype=np.int64))
    return path, x


@pytest.mark.parametrize(
    "record", [24, 1000, 70_000]
)  # small, odd, >= 64 KiB (row copies across shards)
def test_pread_equals_mmap(tmp_path: Path, record: int) -> None:
    path, x = _write(tmp_path, 60, record, shard_bytes=7 * record)  # 9 shards, one short
    mm = MemmapDataset(path, read="mmap")
    pr = MemmapDataset(path, read="pread")
    auto = MemmapDataset(path)
    rng = np.random.default_rng(2)
    batches = [
        rng.permutation(60)[:25],  # shuffled, across shards
        np.arange(10, 40),  # adjacent runs crossing shard ends: coalesced preadv
        np.array([5, 5, 6, 4, -1, 59, 0]),  # duplicates, negatives, both ends
        np.array([], dtype=np.int64),
        np.arange(3, 6)[::-1],  # one shard, descending
    ]
    for idx in batches:
        want = x[np.where(idx < 0, idx + 60, idx)]
        for ds in (mm, pr, auto):
            got = ds.read_batch(idx)
            assert torch.equal(got["data"], torch.from_numpy(want)), (ds.read, idx)
            assert got["label"].tolist() == np.where(idx < 0, idx + 60, idx).tolist()
        out = {"data": torch.zeros(40, record, dtype=torch.uint8), "label": torch.zeros(40).long()}
        got = pr.read_batch(idx, out=out)
        assert len(idx) == 0 or got["data"].data_ptr() == out["data"].data_ptr()
        assert torch.equal(out["data"][: len(idx)], torch.from_numpy(want))
    pickled = pickle.loads(pickle.dumps(pr))
    assert pickled.read == "pread"
    assert torch.equal(pickled.read_batch([7, 8])["data"], torch.from_numpy(x[7:9]))


def test_pread_many_adjacent_records_split_past_iov_max(tmp_path: Path) -> None:
    path, x = _write(tmp_path, 2500, 8, shard_bytes=1 << 20)  # one shard, 2500 adjacent records
    ds = MemmapDataset(path, read="pread")
    assert torch.equal(ds.read_batch(np.arange(2500))["data"], torch.from_numpy(x))


def test_pread_truncated_after_open_raises(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, 8, 4096, shard_bytes=1 << 20)
    ds = MemmapDataset(path, read="pread")
    ds.read_batch([0])
    os.truncate(path / "shard-00000.data", 4096 * 5 + 10)
    # one rule for every read path (feedpipe.datasets._shard_guard): a shard truncated while
    # open is refused whole, naming it, even for the records still there (was: served)
    for batch in ([0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [7]):
        with pytest.raises(DatasetError, match=r"shard-00000\.data: shard 0 file is now 20490"):
            ds.read_batch(batch)


def test_read_option_is_checked(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, 4, 16, shard_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"read must be one of .*'preadv'"):
        MemmapDataset(path, read="preadv")


@pytest.mark.gpu
@pytest.mark.parametrize("record", [24, 70_000])
def test_dma_to_cuda_out_equals_mmap(tmp_path: Path, record: int) -> None:
    path, _ = _write(tmp_path, 60, record, shard_bytes=7 * record)
    ds = MemmapDataset(path)
    out = torch.zeros(40, record, dtype=torch.uint8, device="cuda")
    for idx in (np.random.default_rng(3).permutation(60)[:40], np.arange(10, 40), [5, 5, -1]):
        got = ds.read_batch(idx, out={"data": out})
        assert got["data"].is_cuda and got["data"].data_ptr() == out.data_ptr()
        want = ds.read_batch(idx)["data"]
        assert torch.equal(got["data"].cpu(), want)
    ds.close()  # unregisters the maps after the copies in flight
    with pytest.raises(ValueError, match=r"need torch\.uint8 with at least 61 rows"):
        MemmapDataset(path).read_batch([*range(60), 0], out=out)
