"""MixedDataset's one gather of fixed records into memory ``take`` allocates (batches smaller
than the pool keeps, records of up to ``NEW_RECORD_MAX`` bytes): each batch is the members'
records, copied in the widest word a record allows, in memory of its own, in a worker thread
too (whose allocator places memory between the members' maps)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _mix_reference import expected_batch

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets._mixed_take import NEW_RECORD_MAX


def _member(path: Path, base: int, n: int, shape: tuple[int, ...], dtype: str) -> MemmapDataset:
    x = (base + np.arange(n * int(np.prod(shape)))).reshape(n, *shape).astype(dtype)
    with MemmapWriter(path, shape=shape, dtype=dtype) as w:
        w.append_batch(x)
    return MemmapDataset(path)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((4,), "int64"), ((3,), "int32"), ((3,), "int16"), ((5,), "uint8"), ((1024,), "int32")],
)
def test_small_batches_are_the_members_records_in_memory_of_their_own(
    tmp_path: Path, shape: tuple[int, ...], dtype: str
) -> None:
    """Records of 8, 12, 6, 5 and 4096 bytes (every word size, and the largest record this path
    takes): a batch equals the members' records, in the main thread and in a worker thread, and
    writing it changes no later batch (it is a copy, not a view of a map)."""
    record = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert record <= NEW_RECORD_MAX
    members = {
        "a": _member(tmp_path / "a", 0, 40, shape, dtype),
        "b": _member(tmp_path / "b", 100, 7, shape, dtype),
        "c": _member(tmp_path / "c", 50, 13, shape, dtype),
    }
    mix = MixedDataset(members, weights={"a": 0.5, "b": 0.3, "c": 0.2}, epoch_samples=60)
    idx = np.random.default_rng(0).permutation(60).astype(np.int64)[:37]
    want = expected_batch(mix, idx)
    got: dict[str, torch.Tensor] = {}

    def read(key: str) -> None:
        got[key] = mix.read_batch(idx)

    read("main")
    worker = threading.Thread(target=read, args=("thread",))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    for key in ("main", "thread"):
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    got["main"].fill_(0)  # its own memory: the maps are read-only, the next batch unchanged
    assert torch.equal(mix.read_batch(idx), want)
    for ds in members.values():
        ds.close()
