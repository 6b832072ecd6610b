"""``feedpipe convert`` from Parquet files (CLI and API). Real ``datasets.Dataset`` objects and
every Arrow type: tests/test_tables_real.py."""

from __future__ import annotations

import io
import json
import os
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


def _hf_meta(table: Any, features: dict[str, Any]) -> Any:
    raw = json.dumps({"info": {"features": features}}).encode()
    return table.replace_schema_metadata({b"huggingface": raw})


# ---------------------------------------------------------------------- 1: Parquet / HF
@pytest.mark.parametrize("lie", [5, ["Image"], {"x": 1}, None])
def test_hf_metadata_whose_type_is_not_a_string_is_ignored(tmp_path: Path, lie: Any) -> None:
    """Valid JSON whose ``_type`` is not a string was an AttributeError; it is no feature."""
    table = _hf_meta(pa.table({"data": np.arange(4), "x": np.arange(4) * 2}),
                     {"data": {"_type": lie}, "x": {"_type": lie, "shape": [2]}})  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    batch = MemmapDataset(tmp_path / "o").read_batch([1, 3])
    assert batch["data"].tolist() == [1, 3] and batch["x"].tolist() == [2, 6]


def test_classlabel_metadata_on_a_non_integer_column_is_ignored(tmp_path: Path) -> None:
    """A ``ClassLabel`` claimed for a string column names no classes (its values are no
    label numbers); on an integer column it does."""
    table = pa.table({"data": np.arange(4), "s": ["p", "q", "r", "s"], "y": np.arange(4) % 2})
    feats = {"s": {"_type": "ClassLabel", "names": ["a", "b"]},
             "y": {"_type": "ClassLabel", "names": ["neg", "pos"]}}  # fmt: skip
    pq.write_table(_hf_meta(table, feats), tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    assert ds.index.extra["class_labels"] == {"y": ["neg", "pos"]}
    assert ds.classes == ["neg", "pos"]


def test_parquet_file_urls_follow_the_one_rule(tmp_path: Path) -> None:
    """``file://localhost/abs`` and ``FILE:///abs`` are ``/abs``; ``file://host/abs`` is refused
    naming the URL (it was read as the relative path ``host/abs``)."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"data": np.arange(5)}), path)
    for i, url in enumerate([f"file://localhost{path}", f"FILE://{path}", f"file://{path}"]):
        feedpipe.convert(url, tmp_path / f"o{i}", workers=1)
        assert MemmapDataset(tmp_path / f"o{i}").read_batch([4]).tolist() == [4]
        assert MemmapDataset(tmp_path / f"o{i}").index.extra["source"]["paths"] == [str(path)]
    with pytest.raises(ValueError, match="names another host") as err:
        feedpipe.convert(f"file://host{path}", tmp_path / "ox", workers=1)
    assert f"file://host{path}" in str(err.value)
    assert not (tmp_path / "ox").exists()


def _two_groups(path: Any, scale: int, schema_int: bool = True) -> None:
    col = np.arange(8) * scale if schema_int else (np.arange(8) * scale).astype(np.float32)
    pq.write_table(pa.table({"data": col}), path, row_group_size=4)


@pytest.mark.parametrize("same_schema", [True, False])
def test_local_parquet_replaced_mid_conversion_is_named(tmp_path: Path, same_schema: bool) -> None:
    """Row group 0 is read, then the file is replaced (same row counts; same or another
    schema): reading row group 1 is an error naming the file, never rows of two versions."""
    from feedpipe.datasets.tables import ParquetSource

    path = tmp_path / "t.parquet"
    _two_groups(path, 1)
    src = ParquetSource([str(path)], None)
    assert src.read(0, 4)[0].tolist() == [0, 1, 2, 3]
    _two_groups(tmp_path / "new.parquet", 100, schema_int=same_schema)
    os.replace(tmp_path / "new.parquet", path)
    with pytest.raises(DatasetError, match="changed while it was converted") as err:
        src.read(4, 8)
    assert str(path) in str(err.value)


def test_s3_parquet_replaced_mid_conversion_is_named(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    import fsspec

    from feedpipe.datasets.tables import ParquetSource

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    url = f"s3://{bucket}/pq/t.parquet"
    for scale in (1, 100):
        buf = io.BytesIO()
        _two_groups(buf, scale)
        if scale == 1:
            fs.pipe(url, buf.getvalue())
            src = ParquetSource([url], None, opts)
            assert src.read(0, 4)[0].tolist() == [0, 1, 2, 3]
        else:
            fs.pipe(url, buf.getvalue())
    with pytest.raises(DatasetError, match="changed while it was converted") as err:
        src.read(4, 8)
    assert url in str(err.value)


def test_nulls_without_statistics_in_a_late_row_group_publish_nothing(tmp_path: Path) -> None:
    """No statistics (a footer that says nothing of nulls): the null is found when its row
    group is converted, after other parts were written; nothing appears at DEST."""
    path = tmp_path / "t.parquet"
    vals = pa.array([float(i) if i != 3001 else None for i in range(3200)])
    table = pa.table({"data": np.arange(3200), "v": vals})
    pq.write_table(table, path, row_group_size=200, write_statistics=False)
    with pytest.raises(DatasetError, match="row 3001 \\(record 3001\\): column 'v'"):
        feedpipe.convert(path, tmp_path / "o", workers=1, shard_bytes=4096)
    assert not (tmp_path / "o").exists()
