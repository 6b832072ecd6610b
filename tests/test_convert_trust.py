"""feedpipe convert and MemmapWriter never delete what they did not write, write URLs through
fsspec, and refuse datasets that could not be read back (issue 16, points 6, 7 and 8)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import json_paths as _paths
from _helpers import json_values
from _procs import run_cli as _cli
from feedpipe.convert import convert
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedpipe import DatasetError, MemmapDataset
from feedpipe.datasets.writer import MemmapWriter


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------- point 6
def test_non_dataset_destination_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(40, dtype=np.int32).reshape(10, 4))
    user = tmp_path / "mine"
    (user / "src").mkdir(parents=True)
    (user / "notes.txt").write_text("my notes")
    (user / "src" / "a.py").write_text("print(1)")
    before = _tree(user)
    for extra in ([], ["--overwrite"]):
        res = _cli("convert", "x.npy", "mine", "--no-progress", *extra, cwd=tmp_path)
        assert res.returncode == 1, res
        assert "notes.txt" in res.stderr and "Traceback" not in res.stderr
        assert _tree(user) == before
    with pytest.raises(DatasetError, match="did not write"):
        convert(tmp_path / "x.npy", user, overwrite=True)
    with pytest.raises(DatasetError, match="did not write"):
        MemmapWriter(user, shape=(4,), dtype="int32", overwrite=True)
    assert _tree(user) == before
    assert sorted(os.listdir(tmp_path)) == ["mine", "x.npy"]


def test_dataset_with_extra_user_file_is_not_replaced(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(40, dtype=np.int32).reshape(10, 4))
    convert(tmp_path / "x.npy", tmp_path / "ds", workers=1)
    (tmp_path / "ds" / "README").write_text("keep me")
    with pytest.raises(DatasetError, match="README"):
        convert(tmp_path / "x.npy", tmp_path / "ds", workers=1, overwrite=True)
    assert (tmp_path / "ds" / "README").read_text() == "keep me"
    (tmp_path / "ds" / "README").unlink()
    # a plain dataset is replaced with --overwrite, and an empty folder is used as is
    convert(tmp_path / "x.npy", tmp_path / "ds", workers=1, overwrite=True)
    (tmp_path / "empty").mkdir()
    res = convert(tmp_path / "x.npy", tmp_path / "empty", workers=1)
    assert len(MemmapDataset(res.path)) == 10


def test_forgotten_dest_never_renames_a_source(tmp_path: Path) -> None:
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, np.zeros((4, 2), np.float32))
    np.save(b, np.ones((4, 2), np.float32))
    before = _tree(tmp_path)
    res = _cli("convert", "a.npy", "b.npy", "--no-progress", cwd=tmp_path)
    assert res.returncode == 1 and "b.npy" in res.stderr and "Traceback" not in res.stderr
    res = _cli("convert", "a.npy", "b.npy", "--no-progress", "--overwrite", cwd=tmp_path)
    assert res.returncode == 1
    assert _tree(tmp_path) == before  # no *.old-PID, no *.partial


def test_destination_overlapping_a_source_is_refused(tmp_path: Path) -> None:
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "0.png").write_bytes(b"png")
    before = _tree(tmp_path)
    for dest in ("imgs", "imgs/out", "."):
        with pytest.raises(DatasetError):
            convert(tmp_path / "imgs", tmp_path / dest, kind="images", overwrite=True)
    assert _tree(tmp_path) == before


def test_foreign_partial_folder_is_not_deleted(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    (tmp_path / "ds.partial").mkdir()
    (tmp_path / "ds.partial" / "thesis.tex").write_text("years of work")
    with pytest.raises(DatasetError, match=r"ds\.partial"):
        convert(tmp_path / "x.npy", tmp_path / "ds")
    assert (tmp_path / "ds.partial" / "thesis.tex").read_text() == "years of work"


def test_symlinked_destination_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    convert(tmp_path / "x.npy", tmp_path / "real", workers=1)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(DatasetError, match="link"):
        convert(tmp_path / "x.npy", tmp_path / "link", overwrite=True)
    assert (tmp_path / "real" / "index.json").exists()


# ---------------------------------------------------------------------- point 7
def test_convert_to_s3_writes_through_fsspec(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    monkeypatch.chdir(tmp_path)
    data = np.arange(400, dtype=np.int32).reshape(100, 4)
    np.save(tmp_path / "x.npy", data)
    url = f"s3://{bucket}/ds"
    endpoint = opts["client_kwargs"]["endpoint_url"]
    # 400-byte shards: 4 of them (before issue 19 the 4 came from 2 parts per worker)
    args = ("convert", "x.npy", url, "--no-progress", "--workers", "2", "--shard-size", "400",
            "--endpoint-url", endpoint)  # fmt: skip
    res = _cli(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "4 shards" in res.stdout
    assert url in res.stdout
    assert sorted(os.listdir(tmp_path)) == ["x.npy"]  # no local "s3:" folder
    fs = fsspec.filesystem("s3", **opts)
    ds = MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "cache")
    assert np.array_equal(ds.read_batch(np.arange(100)).numpy(), data)
    # an existing remote dataset needs --overwrite; a foreign prefix is refused even with it
    res = _cli(*args, cwd=tmp_path)
    assert res.returncode == 1 and "already exists" in res.stderr
    fs.pipe_file(f"{bucket}/other/notes.txt", b"mine")
    with pytest.raises(DatasetError, match="not empty"):
        convert(tmp_path / "x.npy", f"s3://{bucket}/other", overwrite=True, storage_options=opts)
    assert fs.cat_file(f"{bucket}/other/notes.txt") == b"mine"
    # overwrite with fewer shards: the old index goes first, the old extra shards are removed
    small = convert(
        tmp_path / "x.npy",
        url,
        overwrite=True,
        storage_options=opts,
        shard_bytes=1 << 20,
        workers=1,
    )
    assert small.path == url and small.shards == 1  # before issue 19: 2 parts per worker
    index = json.loads(fs.cat_file(f"{bucket}/ds/index.json"))
    listed = {f["path"] for s in index["shards"] for f in s["files"].values()}
    assert {p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/ds")} == listed | {"index.json"}
    assert sorted(os.listdir(tmp_path)) == ["cache", "x.npy"]


def test_memmap_writer_to_s3(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, opts = s3_bucket
    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/w"
    with MemmapWriter(url, shape=(3,), dtype="float32", storage_options=opts) as w:
        w.append_batch(np.ones((5, 3), np.float32))
    assert os.listdir(tmp_path) == []
    ds = MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "c")
    assert ds.read_batch([0, 4]).sum().item() == 6.0
    # an aborted writer publishes nothing
    with (
        pytest.raises(RuntimeError),
        MemmapWriter(
            f"s3://{bucket}/aborted", shape=(3,), dtype="float32", storage_options=opts
        ) as w,
    ):
        w.append_batch(np.ones((5, 3), np.float32))
        raise RuntimeError("boom")
    import fsspec

    assert not fsspec.filesystem("s3", **opts).exists(f"{bucket}/aborted/index.json")
    assert sorted(os.listdir(tmp_path)) == ["c"]


# ---------------------------------------------------------------------- point 8
def test_string_side_field_is_refused_at_write_time(tmp_path: Path) -> None:
    np.savez(tmp_path / "s.npz", data=np.zeros((6, 2), np.float32), name=np.array(["ab"] * 6))
    res = _cli("convert", "s.npz", "out", "--no-progress", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "'name'" in res.stderr and "<U2" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": (2,), "dtype": object}, "object"),
        ({"shape": (2,), "dtype": "U4"}, "<U4"),
        ({"shape": (2**32, 2**32), "dtype": "uint8"}, "too large"),
        ({"shape": (-1,), "dtype": "uint8"}, "negative"),
        ({"shape": (2,), "dtype": ">i4"}, "byte order"),
        ({"shape": None, "fields": {"f": ("int64", (-2,))}}, "negative"),
        ({"shape": None, "fields": {"f": "S3"}}, "S3"),
        ({"shape": None, "fields": {"f": ("float32", (2**40, 2**40))}}, "too large"),
    ],
)
def test_writer_refuses_unreadable_layouts(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(DatasetError, match=match):
        MemmapWriter(tmp_path / "w", **kwargs)
    assert not (tmp_path / "w").exists()


def test_npz_with_object_array_is_a_clear_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "o.npz", data=np.array([1, "a"], dtype=object))
    res = _cli("convert", "o.npz", "out", "--no-progress", cwd=tmp_path)
    assert res.returncode == 1 and "o.npz" in res.stderr and "Traceback" not in res.stderr


def _index(tmp_path: Path, n: int, **changes: Any) -> Path:
    with MemmapWriter(tmp_path / "ds", shape=(2,), dtype="int32", fields={"y": "int64"}) as w:
        w.append_batch(np.zeros((n, 2), np.int32), y=np.arange(n))
    doc = json.loads((tmp_path / "ds" / "index.json").read_text())
    for path, value in changes.items():
        node = doc
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[keys[-1]] = value
    (tmp_path / "ds" / "index.json").write_text(json.dumps(doc))
    return tmp_path / "ds"


@pytest.mark.parametrize(
    ("n", "changes"),
    [
        (0, {"layout__dtype": "object"}),  # an empty dataset: no size check can catch these
        (0, {"layout__dtype": "<U3"}),
        (0, {"layout__shape": [2**32, 2**32]}),
        (0, {"fields__y__shape": [-1]}),
        (0, {"fields__y__dtype": "<U3"}),
        (3, {"shards__0__files__data__path": "."}),
        (3, {"shards__0__files__data__path": "a/./b"}),
        (3, {"shards__0__files__data__path": "index.json"}),
        (3, {"shards__0__records": 3.0}),
        (3, {"num_records": 3.0}),
    ],
)
def test_open_refuses_unreadable_index(tmp_path: Path, n: int, changes: dict[str, Any]) -> None:
    ds = _index(tmp_path, n, **changes)
    with pytest.raises(DatasetError, match=r"index\.json"):
        MemmapDataset(ds)


# ---------------------------------------------------------------------- point 9
_JSON = json_values()


@pytest.fixture(scope="module")
def dataset_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tpl") / "ds"
    with MemmapWriter(root, shape=None, fields={"y": ("int16", (2,))}, shard_bytes=64) as w:
        for i in range(12):
            w.append(bytes([i]) * (i + 1), y=[i, -i])
    return root


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_malformed_index_raises_only_dataset_error(dataset_template: Path, data: Any) -> None:
    """Any mutation of a valid index: open and read give a result or a DatasetError naming it."""
    import tempfile

    good = json.loads((dataset_template / "index.json").read_text())
    path = data.draw(st.sampled_from(_paths(good)))
    value = data.draw(_JSON)
    doc = json.loads(json.dumps(good))
    if path:
        node = doc
        for k in path[:-1]:
            node = node[k]
        if data.draw(st.booleans()) and isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = value
    else:
        doc = value
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        root.mkdir()
        for f in dataset_template.iterdir():
            if f.name != "index.json":
                os.symlink(f, root / f.name)
        (root / "index.json").write_text(json.dumps(doc))  # Infinity/NaN included
        try:
            ds = MemmapDataset(root)
            ds.read_batch(np.arange(len(ds)))
        except DatasetError as exc:
            assert str(root) in str(exc)


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"format": "feedpipe.memmap", "version": 1, "layout": {"kind": "bytes"}, '
        '"fields": {}, "num_records": Infinity, "shards": []}',
        '{"format": "feedpipe.memmap", "version": 1, "layout": {"kind": "fixed", "shape": '
        '[1e999], "dtype": "uint8"}, "fields": {}, "num_records": 0, "shards": []}',
    ],
)
def test_hostile_index_text(tmp_path: Path, raw: str) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "index.json").write_text(raw)
    with pytest.raises(DatasetError, match=r"ds/index\.json"):
        MemmapDataset(tmp_path / "ds")
    res = _cli("inspect", "ds", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "index.json" in res.stderr


# ---------------------------------------------------------------------- issue 25 item 15
def test_unclear_sources_give_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from feedpipe.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "arrays").mkdir()
    for i in range(3):
        np.save(tmp_path / "arrays" / f"{i}.npy", np.full((2, 3), i, np.float32))
    for source, needle in (
        ("arrays", "a folder of .npy/.npz files; name the files"),
        ("nothere", "source does not exist"),
    ):
        assert main(["convert", source, "out", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{source}: {needle}" in err, err
    assert sorted(os.listdir(tmp_path)) == ["arrays"]


def test_a_list_of_dicts_is_a_dataset_of_samples(tmp_path: Path) -> None:
    """It was taken for a list of paths (TypeError: expected str... not dict)."""
    res = convert([{"a": 1, "b": "x"}, {"a": 2, "b": "yy"}], tmp_path / "ds", progress_bar=False)
    ds = MemmapDataset(res.path)
    assert len(ds) == 2 and ds[1]["a"].item() == 2 and ds[1]["b"] == "yy"
