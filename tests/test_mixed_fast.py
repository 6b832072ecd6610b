"""MixedDataset's merged batches (issue 19, "How it is checked", MixedDataset speed): every
result equals ``default_collate`` of the per-sample reads for any dtype (numpy's and those numpy
lacks), layout (non-contiguous, zero-width rows), ``out=``, thread or pickled copy, so that a
faster read path can be checked against them."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from feedpipe import DataLoader, MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.errors import DatasetError
from feedpipe.testing import assert_batches_equal


def _write(path: Path, base: int, n: int, *, fields: bool = True) -> MemmapDataset:
    x = (base + np.arange(n, dtype=np.int64))[:, None] * np.ones((1, 5), np.int64)
    spec = {"label": "int32"} if fields else None
    with MemmapWriter(path, shape=(5,), dtype="int64", fields=spec, shard_bytes=480) as w:
        if fields:
            w.append_batch(x, label=np.arange(n, dtype=np.int32) % 7)
        else:
            w.append_batch(x)
    return MemmapDataset(path)


def _want(ds: MixedDataset, idx: list[int]) -> Any:
    return default_collate([ds[i] for i in idx])


def test_batches_share_no_memory(tmp_path: Path) -> None:
    """Each batch is a new tensor: reading the next batch does not change the one returned."""
    members = {"a": _write(tmp_path / "a", 1000, 30), "b": _write(tmp_path / "b", 2000, 30)}
    ds = MixedDataset(members, seed=1)
    first = ds.read_batch(list(range(0, 60, 3)))
    keep = {k: v.clone() for k, v in first.items()}
    for start in range(1, 3):
        ds.read_batch(list(range(start, 60, 3)))
    assert_batches_equal(first, keep)


def test_out_is_filled_and_its_views_returned(tmp_path: Path) -> None:
    members = {"a": _write(tmp_path / "a", 1000, 20), "b": _write(tmp_path / "b", 2000, 20)}
    ds = MixedDataset(members, seed=3)
    idx = [39, 0, 21, 5, 20, 19]
    out = {
        "data": torch.full((8, 5), -1, dtype=torch.int64),
        "label": torch.zeros(8, dtype=torch.int32),
    }
    got = ds.read_batch(idx, out=out)
    assert_batches_equal(got, _want(ds, idx))
    assert got["data"].data_ptr() == out["data"].data_ptr()
    assert out["data"][6:].eq(-1).all()
    with pytest.raises(ValueError, match="rows"):
        ds.read_batch(idx, out={"data": torch.empty((3, 5), dtype=torch.int64)})


def test_other_dtypes_still_refused_by_name_after_good_batches(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", 1000, 10, fields=False)
    with MemmapWriter(tmp_path / "b", shape=(5,), dtype="float32") as w:
        w.append_batch(np.zeros((10, 5), np.float32))
    c = _write(tmp_path / "c", 3000, 10, fields=False)
    ds = MixedDataset({"a": a, "c": c, "b": MemmapDataset(tmp_path / "b")})
    ds.read_batch(list(range(10)) + list(range(10, 20)))  # a and c: the fast path
    with pytest.raises(DatasetError, match=r"'a' and 'b'.*float32"):
        ds.read_batch(list(range(30)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float16])
def test_dtypes_numpy_lacks_are_scattered_bytewise(dtype: torch.dtype) -> None:
    class Tensors:
        def __init__(self, base: int, n: int) -> None:
            self.x = (torch.arange(n * 3).view(n, 3) + base).to(dtype)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.x[i]

        def read_batch(self, indices: Any, out: Any = None) -> torch.Tensor:
            rows = self.x[torch.as_tensor(indices)]
            return rows if out is None else out.copy_(rows)

    ds = MixedDataset({"a": Tensors(0, 7), "b": Tensors(100, 5)})
    for idx in ([11, 0, 7, 3], [1, 8, 2, 9, 10]):
        assert_batches_equal(ds.read_batch(idx), _want(ds, idx))


def test_threads_share_nothing_and_pickled_copies_work(tmp_path: Path) -> None:
    members = {"a": _write(tmp_path / "a", 1000, 50), "b": _write(tmp_path / "b", 2000, 13)}
    ds = MixedDataset(members, weights={"a": 1, "b": 1}, seed=7, epoch_samples=80)
    batches = [np.random.default_rng(s).permutation(80)[:32].tolist() for s in range(8)]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(5):
                for idx in batches:
                    assert_batches_equal(ds.read_batch(idx), _want(ds, idx))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    copy = pickle.loads(pickle.dumps(ds))
    assert_batches_equal(copy.read_batch(batches[0]), _want(ds, batches[0]))


def test_loader_with_thread_workers_matches_torch(tmp_path: Path) -> None:
    members = {"a": _write(tmp_path / "a", 1000, 64), "b": _write(tmp_path / "b", 2000, 10)}
    ds = MixedDataset(members, weights={"a": 2, "b": 1}, seed=9, epoch_samples=90)
    gen = torch.Generator().manual_seed(4)
    got = list(DataLoader(ds, batch_size=16, shuffle=True, generator=gen, num_workers=2,
                          worker_type="thread"))  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    want = list(torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=gen))
    for g, w in zip(got, want, strict=True):
        assert_batches_equal(g, w)


def test_non_contiguous_and_zero_width_member_batches() -> None:
    class Odd:
        def __init__(self, base: int, n: int, width: int) -> None:
            self.x = (torch.arange(n * 4).view(4, n) + base).t()[:, :width]  # not contiguous

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.x[i]

        def read_batch(self, indices: Any, out: Any = None) -> torch.Tensor:
            return self.x[torch.as_tensor(indices)].t().contiguous().t()  # column-major rows

    for width in (3, 0):
        ds = MixedDataset({"a": Odd(0, 6, width), "b": Odd(100, 5, width)})
        for idx in ([10, 0, 6, 3], [1, 7, 2, 8, 9, 5]):
            assert_batches_equal(ds.read_batch(idx), _want(ds, idx))
