"""A writer with no records column and only fixed-size fields (``records=False``,
``fields={"label": "int64"}``) keeps every record: appended one by one or in batches, across
shard boundaries, through close, abort and resume, and through ``convert`` of dicts of scalars
and ``convert(fn)`` returning them. (It once wrote an index of 0 records: with no file streamed,
the writer never saw its shard as open, so every write started a new one and none was closed.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import MemmapDataset, MemmapWriter
from feedpipe.errors import DatasetError
from feedpipe.format import read_index

sys.path.insert(0, str(Path(__file__).parent))
import _convert_fns as fns  # the worker functions live in an importable module

FIELDS = {"label": "int64", "xy": ("float32", (2,))}
ROW = 8 + 8  # bytes of one record's fields
SHARD = 4 * ROW  # four records a shard


def _label(i: int) -> int:
    return i * 7 - 3


def _xy(i: int) -> np.ndarray:
    return np.array([i / 2, -i], np.float32)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _check(path: Path, n: int, *, first: int = 0) -> None:
    """The dataset at ``path`` holds exactly records ``first..first+n-1``, by index and file."""
    index = read_index(str(path))
    assert index.num_records == n
    assert all(0 < s.records <= SHARD // ROW for s in index.shards)
    ds = MemmapDataset(path, verify=True)
    assert len(ds) == n
    want = range(first, first + n)
    batch = ds.read_batch(list(range(n)))
    assert batch["label"].tolist() == [_label(i) for i in want]
    assert np.array_equal(batch["xy"].numpy(), np.stack([_xy(i) for i in want]).reshape(n, 2))
    for k in {0, n // 2, n - 1} if n else set():
        assert ds[k]["label"].item() == _label(first + k)
        assert torch.equal(ds[k]["xy"], torch.from_numpy(_xy(first + k)))


def _writer(path: Path, **kw: Any) -> MemmapWriter:
    return MemmapWriter(path, records=False, fields=FIELDS, shard_bytes=SHARD, **kw)


# ---------------------------------------------------------------------- the writer
@pytest.mark.parametrize("n", [1, 4, 5, 23])
def test_record_by_record_across_shards(tmp_path: Path, n: int) -> None:
    with _writer(tmp_path / "d") as w:
        for i in range(n):
            w.append(label=_label(i), xy=_xy(i))
        assert len(w.shards) == (n - 1) // 4  # closed so far; the last is still open
    assert w.num_records == n
    assert len(read_index(str(tmp_path / "d")).shards) == -(-n // 4)
    _check(tmp_path / "d", n)


@pytest.mark.parametrize("sizes", [[23], [0, 3, 0, 9, 1, 10], [4, 4, 4], [1] * 6])
def test_append_batch_across_shards(tmp_path: Path, sizes: list[int]) -> None:
    n, i = sum(sizes), 0
    with _writer(tmp_path / "d") as w:
        for size in sizes:
            ids = range(i, i + size)
            w.append_batch(label=[_label(j) for j in ids], xy=np.array([_xy(j) for j in ids]))
            i += size
    assert len(read_index(str(tmp_path / "d")).shards) == -(-n // 4)
    _check(tmp_path / "d", n)


def test_append_and_append_batch_mixed(tmp_path: Path) -> None:
    with _writer(tmp_path / "d") as w:
        w.append(label=_label(0), xy=_xy(0))
        w.append_batch(label=[_label(1), _label(2), _label(3)], xy=[_xy(1), _xy(2), _xy(3)])
        w.append(label=_label(4), xy=_xy(4))
        w.append_batch(
            label=np.array([_label(j) for j in range(5, 11)]), xy=[_xy(j) for j in range(5, 11)]
        )
    _check(tmp_path / "d", 11)


def test_one_shard_when_the_size_allows(tmp_path: Path) -> None:
    with MemmapWriter(tmp_path / "d", records=False, fields={"label": "int64"}) as w:
        for i in range(100):
            w.append(label=i)
    index = read_index(str(tmp_path / "d"))
    assert [s.records for s in index.shards] == [100]
    assert MemmapDataset(tmp_path / "d").read_batch(range(100))["label"].tolist() == list(
        range(100)
    )


# ---------------------------------------------------------------------- close, abort, resume
def test_close_returns_the_index_and_ends_the_writer(tmp_path: Path) -> None:
    w = _writer(tmp_path / "d")
    w.append_batch(label=[_label(j) for j in range(6)], xy=[_xy(j) for j in range(6)])
    index = w.close()
    assert index.num_records == 6 and [s.records for s in index.shards] == [4, 2]
    with pytest.raises(RuntimeError, match="already closed"):
        w.close()
    with pytest.raises(RuntimeError, match="writer is closed"):
        w.append(label=1, xy=_xy(1))
    _check(tmp_path / "d", 6)


def test_an_empty_writer_closes_to_an_empty_dataset(tmp_path: Path) -> None:
    with _writer(tmp_path / "d") as w:
        w.append_batch(label=[], xy=np.zeros((0, 2), np.float32))
    assert read_index(str(tmp_path / "d")).num_records == 0
    assert len(MemmapDataset(tmp_path / "d")) == 0


def test_abort_and_an_error_leave_no_dataset(tmp_path: Path) -> None:
    w = _writer(tmp_path / "a")
    for i in range(6):
        w.append(label=_label(i), xy=_xy(i))
    w.abort()
    assert not (tmp_path / "a" / "index.json").exists()
    assert not [p for p in os.listdir(tmp_path / "a") if ".tmp-" in p]
    with pytest.raises(ValueError, match="boom"), _writer(tmp_path / "b") as w2:
        w2.append(label=1, xy=_xy(1))
        raise ValueError("boom")
    assert not (tmp_path / "b" / "index.json").exists()
    with pytest.raises(DatasetError):
        MemmapDataset(tmp_path / "b")


def test_a_writer_continuing_numbering_names_its_shards_and_records(tmp_path: Path) -> None:
    """``first_shard``/``first_record``: a writer of one part of a larger dataset."""
    with _writer(tmp_path / "d", first_shard=7, first_record=100) as w:
        for i in range(100, 106):
            w.append(label=_label(i), xy=_xy(i))
        with pytest.raises(DatasetError, match=r"record 106: field 'xy'"):
            w.append(label=1, xy=np.zeros(3, np.float32))
    index = read_index(str(tmp_path / "d"))
    assert [{role: f.path for role, f in s.files.items()} for s in index.shards] == [
        {"field.label": "shard-00007.label", "field.xy": "shard-00007.xy"},
        {"field.label": "shard-00008.label", "field.xy": "shard-00008.xy"},
    ]
    _check(tmp_path / "d", 6, first=100)


def test_overwrite_replaces_a_fields_only_dataset(tmp_path: Path) -> None:
    with _writer(tmp_path / "d") as w:
        for i in range(9):
            w.append(label=_label(i), xy=_xy(i))
    with _writer(tmp_path / "d", overwrite=True) as w:
        for i in range(5):
            w.append(label=_label(i), xy=_xy(i))
    _check(tmp_path / "d", 5)
    assert not (tmp_path / "d" / "shard-00002.label").exists()


# ---------------------------------------------------------------------- convert
def _dicts(n: int) -> list[dict[str, Any]]:
    return [{"label": _label(i), "xy": _xy(i)} for i in range(n)]


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_a_list_of_dicts_of_scalars(tmp_path: Path, workers: int) -> None:
    res = feedpipe.convert([{"a": 1}, {"a": 2}], tmp_path / "two", workers=workers)
    assert res.records == 2 and res.shards == 1
    assert MemmapDataset(tmp_path / "two").read_batch([0, 1])["a"].tolist() == [1, 2]
    res = feedpipe.convert(_dicts(50), tmp_path / "d", workers=workers, shard_bytes=SHARD)
    assert res.records == 50 and res.shards >= 50 // 4
    _check(tmp_path / "d", 50)


def test_convert_of_dicts_is_the_same_whatever_the_worker_count(tmp_path: Path) -> None:
    feedpipe.convert(_dicts(50), tmp_path / "one", workers=1, shard_bytes=SHARD)
    feedpipe.convert(_dicts(50), tmp_path / "two", workers=2, shard_bytes=SHARD)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


class _Failing(torch.utils.data.Dataset[dict[str, Any]]):
    """Dicts of scalars; record 30 fails while ``fail`` is set."""

    fail = True

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 30 and _Failing.fail:
            raise RuntimeError("injected failure")
        return {"label": _label(i), "xy": _xy(i)}


def test_convert_of_dicts_resumes_after_a_failure(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    _Failing.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        feedpipe.convert(_Failing(), dest, workers=1, shard_bytes=64)
    assert (tmp_path / "d.partial").exists() and not dest.exists()
    _Failing.fail = False
    res = feedpipe.convert(_Failing(), dest, workers=1, shard_bytes=64)
    assert res.resumed_parts > 0 and res.records == 50
    _check(dest, 50)
    feedpipe.convert(_Failing(), tmp_path / "clean", workers=1, shard_bytes=64)
    assert _files(dest) == _files(tmp_path / "clean")


def _scalars(n: int) -> list[dict[str, Any]]:
    return [r for i in range(n) for r in fns.scalars(i)]


def _convert_fn(fn: Any, out: Path, n: int, **kw: Any) -> Any:
    kw.setdefault("progress_bar", False)
    return feedpipe.convert(fn, list(range(n)), output=str(out), inputs_per_part=8, **kw)


def _check_scalars(path: Path, n: int) -> None:
    want = _scalars(n)
    ds = MemmapDataset(path, verify=True)
    assert len(ds) == len(want)
    batch = ds.read_batch(list(range(len(want))))
    assert batch["doc"].tolist() == [r["doc"] for r in want]
    assert batch["score"].tolist() == [float(r["score"]) for r in want]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_convert_fn_returning_dicts_of_scalars(tmp_path: Path, num_workers: int) -> None:
    res = _convert_fn(fns.scalars, tmp_path / "d", 30, num_workers=num_workers, shard_bytes=48)
    assert res.records == len(_scalars(30)) and res.shards > 4
    _check_scalars(tmp_path / "d", 30)


def test_convert_fn_of_scalars_is_the_same_whatever_the_worker_count(tmp_path: Path) -> None:
    _convert_fn(fns.scalars, tmp_path / "one", 30, num_workers=0, shard_bytes=48)
    _convert_fn(fns.scalars, tmp_path / "two", 30, num_workers=2, shard_bytes=48)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_convert_fn_of_scalars_resumes_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEEDPIPE_TEST_FAIL_AT", "16")
    with pytest.raises(DatasetError, match="input 16"):
        _convert_fn(fns.scalars_failing_from_env, tmp_path / "d", 30, num_workers=0)
    monkeypatch.delenv("FEEDPIPE_TEST_FAIL_AT")
    res = _convert_fn(fns.scalars_failing_from_env, tmp_path / "d", 30, num_workers=2)
    assert res.resumed_parts == 2 and res.records == len(_scalars(30))
    _check_scalars(tmp_path / "d", 30)
    _convert_fn(fns.scalars_failing_from_env, tmp_path / "clean", 30, num_workers=0)
    assert _files(tmp_path / "d") == _files(tmp_path / "clean")
