"""``feedpipe convert`` from Parquet (CLI: files, folders, globs, S3) and real Hugging Face
``datasets.Dataset`` objects: every Arrow type maps to a typed column, what cannot be stored is
refused up front naming the column, its type and the file, nulls are refused naming the row,
and a damaged or mismatched file is named with nothing published.

The ``datasets`` tests run offline, in memory, with ``HF_HOME`` in a temporary folder."""

from __future__ import annotations

import datetime
import io
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import feedpipe
from feedpipe import DatasetError, MemmapDataset
from feedpipe.cli import main as cli_main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _convert_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli_main(["convert", *args, "--no-progress", "--workers", "1"])
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------------- every Arrow type
N = 7


def _all_types() -> Any:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, size=i % 4).tolist() for i in range(N)]
    day = datetime.date(2024, 2, 29)
    return pa.table({
        "ids": pa.array(ids, pa.list_(pa.int32())),
        "i8": pa.array(np.arange(N, dtype=np.int8) - 3),
        "u16": pa.array(np.arange(N, dtype=np.uint16) * 1000),
        "f16": pa.array(np.linspace(0, 1, N).astype(np.float16)),
        "f64": pa.array(np.linspace(0, 1, N)),
        "flag": pa.array([i % 2 == 0 for i in range(N)]),
        "s": pa.array([f"héllo {i}" * i for i in range(N)], pa.string()),
        "ls": pa.array(["x" * i for i in range(N)], pa.large_string()),
        "b": pa.array([bytes([i]) * i for i in range(N)], pa.binary()),
        "lb": pa.array([b"\x00\xff" * i for i in range(N)], pa.large_binary()),
        "fsb": pa.array([bytes([i, i, i]) for i in range(N)], pa.binary(3)),
        "vec": pa.array([[i, -i] for i in range(N)], pa.list_(pa.float32(), 2)),
        "lst": pa.array([list(range(i)) for i in range(N)], pa.large_list(pa.int64())),
        "pts": pa.array([[[i, 1]] * (i % 3) for i in range(N)],
                        pa.list_(pa.list_(pa.int16(), 2))),
        "tags": pa.array([["a", "b"][: i % 3] for i in range(N)], pa.list_(pa.string())),
        "st": pa.array([{"a": i, "b": {"c": "x" * i}} for i in range(N)]),
        "mp": pa.array([[("k", i), ("l", None)] for i in range(N)],
                       pa.map_(pa.string(), pa.int64())),
        "ts": pa.array([datetime.datetime(2024, 1, 1, 0, 0, i, tzinfo=datetime.timezone.utc)
                        for i in range(N)], pa.timestamp("ms", tz="UTC")),
        "d32": pa.array([day + datetime.timedelta(days=i) for i in range(N)], pa.date32()),
        "t64": pa.array([datetime.time(0, 0, i) for i in range(N)], pa.time64("us")),
        "dur": pa.array([datetime.timedelta(seconds=i) for i in range(N)], pa.duration("s")),
        "cat": pa.array(["red", "green", "red", "blue", "red", "red", "green"]).dictionary_encode(),
    })  # fmt: skip


def test_every_arrow_type_maps_to_a_typed_column(tmp_path: Path) -> None:
    table = _all_types()
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", data_key="ids", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    fields = ds.index.fields
    assert ds.index.layout.kind == "ragged" and ds.index.layout.dtype == "int32"
    kinds = {n: (f.kind, f.dtype, tuple(f.shape)) for n, f in fields.items()}
    assert kinds["s"][0] == kinds["ls"][0] == kinds["cat"][0] == "str"
    assert kinds["tags"][0] == kinds["st"][0] == kinds["mp"][0] == "json"
    assert kinds["b"] == kinds["lb"] == kinds["fsb"] == ("ragged", "uint8", ())
    assert kinds["lst"] == ("ragged", "int64", ()) and kinds["pts"] == ("ragged", "int16", (2,))
    assert kinds["vec"][1:] == ("float32", (2,)) and kinds["f16"][1] == "float16"
    for name in ("ts", "d32", "t64", "dur"):
        assert kinds[name][1:] == ("int64", ()), name
    cols = ds.index.extra["source"]["columns"]
    assert cols["ts"] == "timestamp[ms, tz=UTC]" and cols["d32"] == "date32[day]"
    rows = table.to_pylist()
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    for i, want in enumerate(rows):
        got = ds[i]
        assert got["data"].tolist() == want["ids"]
        for name in ("i8", "u16", "f16", "f64", "flag"):
            assert got[name].item() == pytest.approx(np.asarray(want[name]).item()), name
        assert got["s"] == want["s"] and got["ls"] == want["ls"] and got["cat"] == want["cat"]
        for name in ("b", "lb", "fsb"):
            assert bytes(got[name].numpy()) == want[name], name
        assert got["vec"].tolist() == want["vec"] and got["lst"].tolist() == want["lst"]
        assert got["pts"].tolist() == want["pts"]
        assert got["tags"] == want["tags"] and got["st"] == want["st"]
        assert got["mp"] == {"k": i, "l": None}
        assert int(got["ts"]) == (want["ts"] - epoch) // datetime.timedelta(milliseconds=1)
        assert int(got["d32"]) == (want["d32"] - datetime.date(1970, 1, 1)).days
        assert int(got["t64"]) == i * 1_000_000 and int(got["dur"]) == i


def test_records_column_kinds(tmp_path: Path) -> None:
    """Records: strings -> bytes layout, lists -> ragged, fixed-size lists -> fixed."""
    table = _all_types()
    pq.write_table(table, tmp_path / "t.parquet")
    for key, kind in (("s", "bytes"), ("b", "bytes"), ("vec", "fixed"), ("ts", "fixed")):
        out = tmp_path / f"o-{key}"
        feedpipe.convert(tmp_path / "t.parquet", out, data_key=key, workers=1)
        ds = MemmapDataset(out)
        assert ds.index.layout.kind == kind, key
        assert "ids" in ds.index.fields and key not in ds.index.fields
    assert bytes(MemmapDataset(tmp_path / "o-s")[3]["data"].numpy()).decode() == "héllo 3" * 3


@pytest.mark.parametrize(
    ("column", "typ", "why"),
    [
        (pa.array([Decimal("1.5")]), "decimal128", "cast it to float64"),
        (pa.array([None]), "null", "no feedpipe column type"),
        (pa.array([[(1, 2)]], pa.map_(pa.int64(), pa.int64())), "map<int64", "no feedpipe"),
        (pa.array([{"a": b"x"}]), "struct<a: binary>", "no feedpipe"),
        (pa.array([[datetime.date(2020, 1, 1)]]), "list<element: date32", "no feedpipe"),
    ],
)
def test_unstorable_types_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], column: Any, typ: str, why: str
) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": pa.array([1], pa.int64()), "bad": column}), path)
    rc, err = _convert_cli([str(path), str(tmp_path / "o")], capsys)
    assert rc == 1
    assert str(path) in err and "'bad'" in err and typ in err and why in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_struct_as_records_is_refused_with_a_hint(tmp_path: Path) -> None:
    pq.write_table(pa.table({"meta": [{"a": 1}], "x": [1]}), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"t\.parquet: the records column 'meta'.*data_key"):
        feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)


# ---------------------------------------------------------------------- nulls
@pytest.mark.parametrize(
    ("column", "row", "what"),
    [
        (pa.array(["a", "b", None, "d"]), 2, "is null"),
        (pa.array([1.0, None, 3.0, 4.0]), 1, "is null"),
        (pa.array([[1], [2, 3], [], [4, None]]), 3, "null element"),
        (pa.array([[1, 2], [3, 4], [5, 6], [7, None]], pa.list_(pa.int64(), 2)), 3, "null elem"),
    ],
)
def test_nulls_are_refused_naming_file_row_and_column(
    tmp_path: Path, column: Any, row: int, what: str
) -> None:
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"x": np.arange(4), "col": column}), path, row_group_size=2)
    with pytest.raises(DatasetError) as err:
        feedpipe.convert(path, tmp_path / "o", workers=1)
    msg = str(err.value)
    assert f"{path}: row {row} (record {row}): column 'col'" in msg and what in msg, msg
    assert not (tmp_path / "o").exists()
    if what == "is null":  # a flat column: found in the footer's statistics, before any part
        assert not (tmp_path / "o.partial").exists()


def test_null_in_a_json_column_is_stored_as_none(tmp_path: Path) -> None:
    col = pa.array([{"a": 1}, None, {"a": None}])
    pq.write_table(pa.table({"x": [1, 2, 3], "meta": col}), tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    assert [ds[i]["meta"] for i in range(3)] == [{"a": 1}, None, {"a": None}]


def test_map_with_duplicate_keys_is_refused(tmp_path: Path) -> None:
    col = pa.array([[("k", 1), ("k", 2)]], pa.map_(pa.string(), pa.int64()))
    pq.write_table(pa.table({"x": [1], "mp": col}), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"t\.parquet: row 0.*'mp'.*duplicate"):
        feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)


# ---------------------------------------------------------------------- Parquet via the CLI
def _part(lo: int, hi: int) -> Any:
    return pa.table({
        "tokens": pa.array([list(range(i % 5)) for i in range(lo, hi)], pa.list_(pa.int32())),
        "text": pa.array([f"doc {i}" for i in range(lo, hi)]),
        "label": pa.array(np.arange(lo, hi) % 3),
    })  # fmt: skip


def _check_docs(dest: Path, n: int) -> None:
    ds = MemmapDataset(dest)
    assert len(ds) == n
    batch = ds.read_batch(list(range(n)))
    assert batch["data_lengths"].tolist() == [i % 5 for i in range(n)]
    assert batch["text"] == [f"doc {i}" for i in range(n)]
    assert batch["label"].tolist() == [i % 3 for i in range(n)]


def test_cli_several_files_a_folder_and_row_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(_part(0, 40), root / "a.parquet", row_group_size=7)
    pq.write_table(_part(40, 41), root / "b.parquet")
    pq.write_table(_part(41, 90), root / "c.parquet", row_group_size=11)
    assert pq.ParquetFile(root / "a.parquet").num_row_groups == 6
    files = [str(root / n) for n in ("a.parquet", "b.parquet", "c.parquet")]
    rc, err = _convert_cli([*files, str(tmp_path / "o1"), "--data-key", "tokens"], capsys)
    assert rc == 0, err
    _check_docs(tmp_path / "o1", 90)
    rc, err = _convert_cli(
        [str(root), str(tmp_path / "o2"), "--data-key", "tokens", "--shard-size", "300B"], capsys
    )
    assert rc == 0, err
    _check_docs(tmp_path / "o2", 90)
    assert len(MemmapDataset(tmp_path / "o2").index.shards) > 1


def test_cli_schema_mismatch_names_both_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(_part(0, 5), tmp_path / "a.parquet")
    other = _part(5, 9).set_column(2, "label", pa.array(["x"] * 4))
    pq.write_table(other, tmp_path / "b.parquet")
    rc, err = _convert_cli([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"),
                            str(tmp_path / "o")], capsys)  # fmt: skip
    assert rc == 1
    assert str(tmp_path / "a.parquet") in err and str(tmp_path / "b.parquet") in err
    assert "'label'" in err and "string" in err and "int64" in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_cli_truncated_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(_part(0, 50), root / "a.parquet")
    raw = (root / "a.parquet").read_bytes()
    (root / "b.parquet").write_bytes(raw[: len(raw) // 2])
    rc, err = _convert_cli([str(root), str(tmp_path / "o")], capsys)
    assert rc == 1 and f"{root / 'b.parquet'}: not a readable Parquet file" in err, err
    assert not (tmp_path / "o").exists()


def test_cli_corrupt_row_group_is_named_and_nothing_published(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The footer is intact, the data pages of the second row group are not: the conversion
    fails naming the file and the row group, and no dataset appears."""
    path = tmp_path / "a.parquet"
    pq.write_table(_part(0, 400), path, row_group_size=200, write_page_checksum=True)
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(1).column(1)  # the "text" column of row group 1
    start = chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    for k in range(start + 40, start + 60):
        raw[k] ^= 0x5A
    path.write_bytes(bytes(raw))
    rc, err = _convert_cli([str(path), str(tmp_path / "o"), "--shard-size", "1KiB"], capsys)
    assert rc == 1 and f"{path}: row group 1 unreadable" in err, err
    assert not (tmp_path / "o").exists()  # parts already written wait in o.partial for a rerun


def test_cli_s3_parquet(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    for name, (lo, hi) in {"a.parquet": (0, 30), "b.parquet": (30, 45)}.items():
        buf = io.BytesIO()
        pq.write_table(_part(lo, hi), buf, row_group_size=8)
        fs.pipe(f"{bucket}/pq/{name}", buf.getvalue())
    endpoint = opts["client_kwargs"]["endpoint_url"]
    rc, err = _convert_cli([f"s3://{bucket}/pq/*.parquet", str(tmp_path / "o1"), "--data-key",
                            "tokens", "--endpoint-url", endpoint], capsys)  # fmt: skip
    assert rc == 0, err
    _check_docs(tmp_path / "o1", 45)
    assert MemmapDataset(tmp_path / "o1").index.extra["source"]["paths"] == [
        f"s3://{bucket}/pq/a.parquet", f"s3://{bucket}/pq/b.parquet"
    ]  # fmt: skip
    folder = [f"s3://{bucket}/pq", str(tmp_path / "o2"), "--kind", "parquet"]
    rc, err = _convert_cli([*folder, "--data-key", "tokens", "--endpoint-url", endpoint], capsys)
    assert rc == 0, err
    _check_docs(tmp_path / "o2", 45)
    fs.pipe(f"{bucket}/bad/x.parquet", b"PAR1 not really")
    rc, err = _convert_cli([f"s3://{bucket}/bad/x.parquet", str(tmp_path / "o3"),
                            "--endpoint-url", endpoint], capsys)  # fmt: skip
    assert rc == 1 and f"s3://{bucket}/bad/x.parquet: not a readable Parquet file" in err, err


# ---------------------------------------------------------------------- Hugging Face datasets
@pytest.fixture
def hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``datasets``, offline, its cache in a temporary folder."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-home" / "datasets"))
    datasets = pytest.importorskip("datasets")
    yield datasets


def test_hf_value_list_classlabel_array2d(tmp_path: Path, hf: Any) -> None:
    F = hf.Features  # noqa: N806
    features = F({
        "input_ids": hf.List(hf.Value("int32")),
        "label": hf.ClassLabel(names=["neg", "pos"]),
        "text": hf.Value("string"),
        "score": hf.Value("float32"),
        "patch": hf.Array2D((2, 3), "float32"),
        "pair": hf.List(hf.Value("int64"), length=2),
    })  # fmt: skip
    n = 50
    rows = {
        "input_ids": [list(range(i % 6)) for i in range(n)],
        "label": [i % 2 for i in range(n)],
        "text": [f"t{i}" for i in range(n)],
        "score": [i / 4 for i in range(n)],
        "patch": [np.full((2, 3), i, np.float32) for i in range(n)],
        "pair": [[i, -i] for i in range(n)],
    }
    ds = hf.Dataset.from_dict(rows, features=features)
    res = feedpipe.convert(ds, tmp_path / "o", data_key="input_ids", workers=2, shard_bytes=500)
    assert res.records == n
    out = MemmapDataset(tmp_path / "o")
    assert out.classes == ["neg", "pos"]
    assert out.index.extra["class_labels"] == {"label": ["neg", "pos"]}
    batch = out.read_batch(list(range(n)))
    assert batch["data_lengths"].tolist() == [i % 6 for i in range(n)]
    assert batch["label"].tolist() == rows["label"] and batch["text"] == rows["text"]
    assert batch["patch"].shape == (n, 2, 3) and batch["patch"][7].eq(7).all()
    assert batch["pair"].tolist() == rows["pair"]
    assert batch["score"].tolist() == pytest.approx(rows["score"])
    # a shuffled and selected view converts in its own order
    view = ds.shuffle(seed=1).select(range(10))
    feedpipe.convert(view, tmp_path / "v", data_key="input_ids", workers=1)
    assert MemmapDataset(tmp_path / "v").read_batch(range(10))["text"] == view["text"]


def test_hf_image_records_and_parquet_metadata(
    tmp_path: Path, hf: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    image_mod = pytest.importorskip("PIL.Image", reason="the Image feature needs Pillow")
    images = [image_mod.new("RGB", (4 + i, 3), (i * 40, 0, 0)) for i in range(5)]
    features = hf.Features({"image": hf.Image(), "label": hf.ClassLabel(names=list("abcde"))})
    ds = hf.Dataset.from_dict({"image": images, "label": [4, 3, 2, 1, 0]}, features=features)
    feedpipe.convert(ds, tmp_path / "o", data_key="image", workers=1)
    out = MemmapDataset(tmp_path / "o")
    assert out.index.layout.kind == "bytes" and out.classes == list("abcde")
    for i in range(5):
        img = image_mod.open(io.BytesIO(bytes(out[i]["data"].numpy())))
        assert img.size == (4 + i, 3) and img.getpixel((0, 0)) == (i * 40, 0, 0)
        assert int(out[i]["label"]) == 4 - i
    # the Parquet files datasets writes carry the features: the CLI maps them the same way
    ds.to_parquet(str(tmp_path / "img.parquet"))
    rc, err = _convert_cli([str(tmp_path / "img.parquet"), str(tmp_path / "o2")], capsys)
    assert rc == 0, err
    out2 = MemmapDataset(tmp_path / "o2")
    assert out2.classes == list("abcde")
    assert bytes(out2[2]["data"].numpy()) == bytes(out[2]["data"].numpy())


def test_hf_from_generator_into_fields(tmp_path: Path, hf: Any) -> None:
    def gen() -> Iterator[dict[str, Any]]:
        for i in range(30):
            yield {"x": i, "meta": {"i": i, "tags": ["a"] * (i % 3)}, "blob": bytes([i]) * i}

    ds = hf.Dataset.from_generator(gen, cache_dir=str(tmp_path / "cache"))
    feedpipe.convert(ds, tmp_path / "o", workers=1)
    out = MemmapDataset(tmp_path / "o")
    assert out.index.layout.kind == "fixed"
    assert out.index.fields["meta"].kind == "json" and out.index.fields["blob"].kind == "ragged"
    assert out[7]["meta"] == {"i": 7, "tags": ["a"]} and bytes(out[7]["blob"].numpy()) == b"\7" * 7
    assert out.read_batch(range(30))["data"].tolist() == list(range(30))


def test_hf_nulls_are_named(tmp_path: Path, hf: Any) -> None:
    ds = hf.Dataset.from_dict({"x": [1, 2, 3], "text": ["a", None, "c"]})
    with pytest.raises(DatasetError, match=r"Dataset: record 1: column 'text' \(string\) is null"):
        feedpipe.convert(ds, tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists()


def test_hf_streaming_dataset_and_splits_are_refused_clearly(tmp_path: Path, hf: Any) -> None:
    ds = hf.Dataset.from_dict({"x": [1, 2, 3]})
    with pytest.raises(DatasetError, match=r"streaming dataset has no length.*from_generator"):
        feedpipe.convert(ds.to_iterable_dataset(), tmp_path / "o", workers=1)
    splits = hf.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(DatasetError, match=r"splits \['train', 'test'\].*dataset\['train'\]"):
        feedpipe.convert(splits, tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    feedpipe.convert(splits["test"].with_format("torch"), tmp_path / "o", workers=1)  # any format
    assert MemmapDataset(tmp_path / "o").read_batch([0, 2]).tolist() == [1, 3]


def test_hf_is_in_the_test_extra() -> None:
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    test = text.split("\ntest = [", 1)[1].split("\n]", 1)[0]
    assert '"pyarrow"' in test and '"datasets' in test


# ---------------------------------------------------------------------- hostile metadata
def _with_hf_features(table: Any, features: dict[str, Any]) -> Any:
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return table.replace_schema_metadata(meta)


def test_hf_array2d_from_parquet_is_fixed_and_its_shape_checked(tmp_path: Path) -> None:
    """In Parquet an ``Array2D`` is plain nested lists: the features give the fixed shape, and
    every list's length is checked against it (metadata is never trusted blindly)."""
    grid = [[[float(i)] * 3] * 2 for i in range(4)]
    typ = pa.list_(pa.list_(pa.float32()))
    features = {"g": {"shape": [2, 3], "dtype": "float32", "_type": "Array2D"}}
    good = _with_hf_features(pa.table({"x": [0, 1, 2, 3], "g": pa.array(grid, typ)}), features)
    pq.write_table(good, tmp_path / "good.parquet")
    feedpipe.convert(tmp_path / "good.parquet", tmp_path / "o", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    assert ds.index.fields["g"].kind == "fixed" and tuple(ds.index.fields["g"].shape) == (2, 3)
    assert ds.read_batch([3])["g"].tolist() == [grid[3]]
    grid[2] = [[2.0] * 3, [2.0] * 4]  # a row that lies about the shape
    bad = _with_hf_features(pa.table({"x": [0, 1, 2, 3], "g": pa.array(grid, typ)}), features)
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 2 \(record 2\): column 'g' holds"):
        feedpipe.convert(tmp_path / "bad.parquet", tmp_path / "o2", workers=1)
    assert not (tmp_path / "o2").exists()


def test_hostile_hf_metadata_is_not_trusted(tmp_path: Path) -> None:
    """An ``Image`` whose ``bytes`` are integers is not read as bytes (``bytes(5)`` would
    invent five zero bytes), and ``ClassLabel`` names that are not strings are not kept."""
    table = pa.table({
        "x": [1, 2],
        "img": pa.array([{"bytes": 5, "path": "a"}, {"bytes": 6, "path": "b"}]),
        "label": [0, 1],
    })  # fmt: skip
    features = {
        "img": {"_type": "Image"},
        "label": {"_type": "ClassLabel", "names": 7},
        "x": "not a dict",
    }
    pq.write_table(_with_hf_features(table, features), tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    assert ds.index.fields["img"].kind == "json" and ds[1]["img"] == {"bytes": 6, "path": "b"}
    assert "class_labels" not in ds.index.extra and ds.classes is None


def test_hf_image_stored_by_path_only_is_refused(tmp_path: Path, hf: Any) -> None:
    image_mod = pytest.importorskip("PIL.Image", reason="the Image feature needs Pillow")
    image_mod.new("RGB", (2, 2)).save(tmp_path / "a.png")
    features = hf.Features({"image": hf.Image(), "label": hf.Value("int64")})
    ds = hf.Dataset.from_dict({"image": [str(tmp_path / "a.png")], "label": [0]}, features=features)
    if ds.with_format("arrow")[0:1].column("image")[0]["bytes"].as_py() is not None:
        pytest.skip("this datasets version embeds the bytes of local images")
    with pytest.raises(DatasetError, match=r"record 0: column 'image' .*'bytes'.*by path"):
        feedpipe.convert(ds, tmp_path / "o", data_key="image", workers=1)
