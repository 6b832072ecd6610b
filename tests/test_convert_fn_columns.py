"""Typed columns from ``convert(fn, ...)``: dicts without ``data`` store str, JSON and ragged
columns; type mismatches, unstorable values and lossy widenings are refused naming the input,
the record and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _typed_column_fns as fns
import pytest
import torch
from _helpers import tree_bytes as _files

import feedpipe
from feedpipe import DatasetError, MemmapDataset


def _run(fn: Any, out: Path, n: int = 12, **kw: Any) -> Any:
    kw.setdefault("progress_bar", False)
    kw.setdefault("inputs_per_part", 3)
    kw.setdefault("shard_bytes", 512)
    return feedpipe.convert(fn, list(range(n)), output=str(out), **kw)


def test_fn_dicts_without_data_store_str_json_and_ragged_columns(tmp_path: Path) -> None:
    _run(fns.docs, tmp_path / "one", num_workers=1)
    _run(fns.docs, tmp_path / "two", num_workers=2)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    ds = MemmapDataset(tmp_path / "one")
    want = [r for item in range(12) for r in fns.docs(item)]
    assert len(ds) == len(want) > 0
    for i, w in enumerate(want):
        got = ds[i]
        assert got["text"] == w["text"] and got["meta"] == w["meta"]
        assert got["tokens"].tolist() == w["tokens"]
        assert float(got["score"]) == w["score"]


def test_fn_ragged_records_and_fields(tmp_path: Path) -> None:
    _run(fns.ragged_records, tmp_path / "one", num_workers=1)
    _run(fns.ragged_records, tmp_path / "two", num_workers=2)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    ds = MemmapDataset(tmp_path / "one")
    assert len(ds) == 12
    for i in range(12):
        assert ds[i]["data"].tolist() == [i] * (i % 4 + 1)
        assert ds[i]["pos"].tolist() == list(range(i % 3))


def test_fn_type_mismatch_names_input_record_and_field(tmp_path: Path) -> None:
    for workers in (1, 2):
        with pytest.raises(DatasetError, match=r"input 5 .*record 0: field 'text' is int64"):
            _run(fns.text_then_number, tmp_path / f"o{workers}", num_workers=workers)
        assert not (tmp_path / f"o{workers}").exists()


def test_fn_unstorable_value_is_refused_naming_input_and_field(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"input 0 .*record 0: field 'bad'.*dtype object"):
        _run(fns.a_set, tmp_path / "o", n=2, num_workers=1)
    assert not (tmp_path / "o").exists()


def test_fn_values_that_would_not_read_back_are_refused_naming_the_input(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"input 4 .*record 0: field 'meta'"):
        _run(fns.hostile_json, tmp_path / "j", num_workers=1)
    with pytest.raises(DatasetError, match=r"input 2 .*record 0: field 'text'.*UTF-8"):
        _run(fns.lone_surrogate, tmp_path / "s", num_workers=1)
    assert not (tmp_path / "j").exists() and not (tmp_path / "s").exists()


def test_fn_ragged_column_takes_arrays_later_and_refuses_lossy_values(tmp_path: Path) -> None:
    _run(fns.mixed_ragged, tmp_path / "ok", n=7, num_workers=1)
    ds = MemmapDataset(tmp_path / "ok")
    assert [ds[i]["tokens"].tolist() for i in range(7)] == [list(range(i)) for i in range(7)]
    with pytest.raises(DatasetError, match=r"input 7 .*field 'tokens' is float64"):
        _run(fns.mixed_ragged, tmp_path / "bad", n=9, num_workers=2)
    with pytest.raises(DatasetError, match=r"input 2 .*field 'tokens'.*make the first record's"):
        _run(fns.fixed_then_longer, tmp_path / "fixed", n=3, num_workers=1)


def test_fn_fixed_fields_widen_safely_and_refuse_truncation(tmp_path: Path) -> None:
    _run(fns.scalar_types, tmp_path / "ok", n=3, num_workers=1, inputs_per_part=3)
    ds = MemmapDataset(tmp_path / "ok")
    assert [int(ds[i]["count"]) for i in range(3)] == [0, 1, 2]
    assert ds[2]["count"].dtype == torch.int64
    with pytest.raises(DatasetError, match=r"input 3 .*field 'score' is float64 \[\]"):
        _run(fns.scalar_types, tmp_path / "bad", n=4, num_workers=1, inputs_per_part=4)
