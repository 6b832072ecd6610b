"""``feedpipe convert`` from Parquet files (CLI and API). Real ``datasets.Dataset`` objects and
every Arrow type: tests/test_tables_real.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import DatasetError, MemmapDataset
from feedpipe.cli import main as cli_main
from feedpipe.errors import MissingExtraError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _table(lo: int, hi: int) -> Any:
    n = hi - lo
    vecs = np.arange(lo * 6, hi * 6, dtype=np.float32).reshape(n, 2, 3)
    return pa.table({
        "x": pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), 3), 2
        ),
        "label": pa.array(np.arange(lo, hi, dtype=np.int64) % 7),
        "weight": pa.array(np.arange(lo, hi, dtype=np.float64) / 2),
    })  # fmt: skip


def _files(root: Path) -> None:
    root.mkdir()
    pq.write_table(_table(0, 70), root / "a.parquet", row_group_size=16)
    pq.write_table(_table(70, 100), root / "b.parquet", row_group_size=9)


def _check(dest: Path) -> None:
    ds = MemmapDataset(dest)
    assert len(ds) == 100
    want = torch.arange(600, dtype=torch.float32).reshape(100, 2, 3)
    assert torch.equal(ds.read_batch(range(100))["data"], want)
    for i in (0, 15, 16, 69, 70, 99):
        s = ds[i]
        assert int(s["label"]) == i % 7 and float(s["weight"]) == i / 2


def test_parquet_folder_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _files(tmp_path / "pq")
    rc = cli_main(["convert", str(tmp_path / "pq"), str(tmp_path / "o"), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    _check(tmp_path / "o")


def test_parquet_glob_api_workers_and_small_chunks(tmp_path: Path) -> None:
    _files(tmp_path / "pq")
    res = feedpipe.convert(str(tmp_path / "pq" / "*.parquet"), tmp_path / "o", workers=2,
                           shard_bytes=500)  # fmt: skip
    assert res.records == 100 and res.shards > 1
    _check(tmp_path / "o")


def test_strings_become_the_bytes_layout(tmp_path: Path) -> None:
    text = ["héllo", "", "world" * 50]
    pq.write_table(pa.table({"text": text, "id": [3, 4, 5]}), tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    assert [bytes(ds[i]["data"].numpy()).decode() for i in range(3)] == text
    assert [int(ds[i]["id"]) for i in range(3)] == [3, 4, 5]


def test_refused_up_front_naming_the_column(tmp_path: Path) -> None:
    from decimal import Decimal

    tags = [Decimal(1), Decimal(2)]
    pq.write_table(pa.table({"x": [1, 2], "tags": tags}), tmp_path / "v.parquet")
    with pytest.raises(DatasetError, match=r"'tags'.*decimal"):
        feedpipe.convert(tmp_path / "v.parquet", tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    pq.write_table(pa.table({"x": [1, None, 3]}), tmp_path / "n.parquet")
    with pytest.raises(DatasetError, match=r"row 1 \(record 1\): column 'x' \(int64\) is null"):
        feedpipe.convert(tmp_path / "n.parquet", tmp_path / "o2", workers=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no Parquet files"):
        feedpipe.convert(tmp_path / "empty" / "*.parquet", tmp_path / "o3", kind="parquet")
    with pytest.raises(DatasetError, match="no column 'nope'"):
        feedpipe.convert(tmp_path / "n.parquet", tmp_path / "o4", data_key="nope")


def test_missing_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _files(tmp_path / "pq")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MissingExtraError, match=r"feedpipe\[parquet\]"):
        feedpipe.convert(tmp_path / "pq", tmp_path / "o")
