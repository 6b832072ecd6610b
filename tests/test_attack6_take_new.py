"""Attacks on ``ShardSpace.take_new`` taking rows through the widest unsigned word that divides a
record (``_gather.word_rows``): for every record size, dtype and kind of index, its result is the
byte ``np.take`` it replaces (the same bytes, shape, dtype, the same ``IndexError``), it owns its
memory (writing into it never reaches the dataset), and ``read_batch`` (the small-batch path that
calls it) returns what per-sample reads return.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import MemmapDataset, MemmapWriter
from feedpipe.datasets import _gather
from feedpipe.datasets._batch_pool import ALIGN_MIN

SIZES = [1, 2, 3, 4, 6, 8, 12, 24, 510, 512, 520]
N = 37


def _write(path: Path, x: np.ndarray) -> MemmapDataset:
    with MemmapWriter(path, shape=x.shape[1:], dtype=x.dtype) as w:
        w.append_batch(x)
    return MemmapDataset(path)


def _space(ds: MemmapDataset) -> Any:
    space = ds._fixed.files.space()  # the one-range map the dataset reads through
    assert space is not None and space.one_file
    return space


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(len(x), -1).view(np.uint8)


def _outcome(fn: Any, idx: Any) -> Any:
    try:
        got = fn(idx)
    except Exception as e:  # the same error, type and text, as the byte take
        return (type(e).__name__, str(e))
    return (got.dtype, got.shape, got.tobytes(), got.flags.c_contiguous, got.flags.writeable)


INDICES: dict[str, Any] = {
    "int64": np.array([3, 0, N - 1, 3, 17], np.int64),
    "negative": np.array([-1, -N, 5], np.int64),
    "int32": np.array([2, 9, -2], np.int32),
    "strided": np.arange(0, N, dtype=np.int64)[::3],
    "reversed": np.arange(N, dtype=np.int64)[::-1],
    "empty": np.array([], np.int64),
    "two_d": np.array([[1, 2], [3, 4]], np.int64),
    "scalar": np.int64(4),
    "past_end": np.array([1, N], np.int64),
    "before_start": np.array([-N - 1], np.int64),
    "float": np.array([1.0]),
    "uint64": np.array([1, 2], np.uint64),
    "bool": np.array([True, False]),
}


@pytest.mark.parametrize("rb", SIZES)
def test_take_new_is_the_byte_take_for_every_record_size_and_index(tmp_path: Path, rb: int) -> None:
    x = (np.arange(N * rb, dtype=np.int64) * 7 % 251).astype(np.uint8).reshape(N, rb)
    ds = _write(tmp_path / "d", x)  # kept: the space closes with its dataset
    space = _space(ds)
    want = _bytes(x)
    for name, idx in INDICES.items():
        got = _outcome(space.take_new, idx)
        assert got == _outcome(lambda i: want.take(i, axis=0), idx), name


DTYPES: list[tuple[str, tuple[int, ...]]] = [
    ("float16", (3,)),
    ("float16", ()),
    ("bool", (5,)),
    ("bool", (8,)),
    ("complex64", (2,)),
    ("complex128", (1,)),
    ("int16", (2, 3)),
    ("uint8", (255,)),
    ("float32", (130,)),
    ("int64", (4,)),
]


@pytest.mark.parametrize(("dtype", "shape"), DTYPES)
def test_read_batch_small_path_for_odd_dtypes_owns_its_memory(
    tmp_path: Path, dtype: str, shape: tuple[int, ...]
) -> None:
    """read_batch's small-batch path (one take_new) gives per-sample reads' values, dtype and
    shape, contiguous and writable; writing into it leaves the dataset as written."""
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.arange(N * count, dtype=np.int64) % 5
    x = (raw % 2 == 1) if dtype == "bool" else (raw * 3 - 4).astype(dtype)
    x = x.reshape(N, *shape)
    ds = _write(tmp_path / "d", x)
    idx = np.array([5, -1, 0, 5, 30], np.int64)
    assert _space(ds).one_file and len(idx) * x[0].nbytes < ALIGN_MIN  # the take_new path
    got = ds.read_batch(idx)
    want = torch.from_numpy(x[idx])
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(got, torch.stack([ds[int(i)] for i in idx]))
    assert got.is_contiguous() and got.numpy().flags.writeable
    got.zero_()
    got2 = ds.read_batch(idx)
    assert torch.equal(got2, want)
    assert got2.data_ptr() != got.data_ptr() or not got2.any()
    assert torch.equal(ds[0], torch.as_tensor(x[0]))


def test_read_batch_strided_and_reversed_int64_indices(tmp_path: Path) -> None:
    x = (np.arange(N * 6, dtype=np.int64) % 97).astype(np.uint16).reshape(N, 6)
    ds = _write(tmp_path / "d", x)
    for idx in (np.arange(N, dtype=np.int64)[::-7], np.arange(-40, 40, dtype=np.int64)[5:70:9]):
        assert not idx.flags.c_contiguous  # a strided view, negative indices in the second
        assert torch.equal(ds.read_batch(idx), torch.from_numpy(x[idx]))


def test_out_of_range_still_names_the_dataset(tmp_path: Path) -> None:
    x = np.arange(N * 8, dtype=np.uint8).reshape(N, 8)
    ds = _write(tmp_path / "d", x)
    for bad in ([N], [-N - 1], [0, N + 5]):
        with pytest.raises(IndexError, match=r"out of range for .*\(length 37\)"):
            ds.read_batch(np.array(bad, np.int64))


def test_empty_dataset(tmp_path: Path) -> None:
    ds = _write(tmp_path / "d", np.zeros((0, 24), np.uint8))
    assert tuple(ds.read_batch(np.array([], np.int64)).shape) == (0, 24)
    space = ds._fixed.files.space()
    if space is not None and space.one_file:
        assert space.take_new(np.array([], np.int64)).shape == (0, 24)
        with pytest.raises(IndexError):
            space.take_new(np.array([0], np.int64))


@pytest.mark.parametrize("rb", [1, 2, 3, 4, 6, 8, 12, 24, 512, 520])
@pytest.mark.parametrize("shift", [0, 1, 2, 4, 6])
def test_word_rows_is_a_view_of_the_same_bytes_at_any_address(rb: int, shift: int) -> None:
    """``word_rows`` at an address of any alignment: a view of the same bytes in a word that
    divides both the record and the address (never a wider one), or the rows for bytes."""
    buf = np.arange(8 * rb + 16, dtype=np.int64).astype(np.uint8)
    records = buf[shift : shift + 8 * rb].reshape(8, rb)
    base = records.__array_interface__["data"][0]
    words = _gather.word_rows(records, base)
    if words.dtype == np.uint8:
        assert words is records
        assert all(rb % w or base % w for w in (2, 4, 8))
        return
    size = words.dtype.itemsize
    assert rb % size == 0 and base % size == 0
    assert all(rb % w or base % w for w in (2, 4, 8) if w > size)
    assert np.shares_memory(words, records)
    assert words.view(np.uint8).tobytes() == records.tobytes()
    idx = np.array([7, 0, 3], np.int64)
    assert words.take(idx, axis=0).view(np.uint8).tobytes() == records.take(idx, axis=0).tobytes()
