"""feedpipe convert: every source kind, parallel parts, restart after a kill, CLI, bad input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _procs import run_cli as _cli

import feedpipe
from feedpipe import DatasetError, MemmapDataset
from feedpipe.cli import main as cli_main
from feedpipe.datasets.convert import convert
from feedpipe.datasets.writer import MemmapWriter


def _image_folder(root: Path) -> dict[str, bytes]:
    from PIL import Image

    files = {}
    rng = np.random.default_rng(0)
    for cls, n in (("cat", 5), ("dog", 7)):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (8, 8 + i, 3), dtype=np.uint8)).save(buf, "PNG")
            path = root / cls / f"{i:03d}.png"
            path.write_bytes(buf.getvalue())
            files[str(path)] = buf.getvalue()
    (root / "dog" / "notes.txt").write_text("not an image")
    return files


def test_image_folder(tmp_path: Path) -> None:
    files = _image_folder(tmp_path / "imgs")
    res = convert(tmp_path / "imgs", tmp_path / "out", workers=2, shard_bytes=1000)
    assert res.records == 12 and res.shards >= 2 and "12 records" in res.summary()
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == ["cat", "dog"]
    expected = sorted(files.items())  # cat/000..004, dog/000..006
    for i, (path, data) in enumerate(expected):
        s = ds[i]
        assert bytes(s["data"].numpy()) == data
        assert int(s["label"]) == (0 if "/cat/" in path else 1)
    assert not (tmp_path / "out.partial").exists()


def test_npy_files_and_npz(tmp_path: Path) -> None:
    a = np.arange(100 * 6, dtype=np.int32).reshape(100, 6)
    b = np.arange(50 * 6, dtype=np.int32).reshape(50, 6) + 10_000
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    res = convert(
        [tmp_path / "a.npy", tmp_path / "b.npy"], tmp_path / "o1", workers=2, shard_bytes=512
    )
    ds = MemmapDataset(tmp_path / "o1")
    assert res.records == 150 and torch.equal(
        ds.read_batch(range(150)), torch.from_numpy(np.concatenate([a, b]))
    )
    np.savez(tmp_path / "c.npz", x=a, y=np.arange(100) * 2)
    convert(tmp_path / "c.npz", tmp_path / "o2", data_key="x", workers=1)
    ds = MemmapDataset(tmp_path / "o2")
    assert torch.equal(ds[7]["data"], torch.from_numpy(a[7])) and int(ds[7]["y"]) == 14


def test_zarr_group(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    x = np.random.default_rng(1).random((90, 5)).astype(np.float32)
    g = zarr.open_group(tmp_path / "z", mode="w")
    g.create_array(
        "data",
        shape=x.shape,
        chunks=(10, 5),
        shards=(30, 5),
        dtype="float32",
        compressors=ZstdCodec(),
    )[:] = x
    g.create_array("label", shape=(90,), dtype="int16")[:] = np.arange(90)
    convert(tmp_path / "z", tmp_path / "o", workers=2, shard_bytes=700)
    ds = MemmapDataset(tmp_path / "o")
    b = ds.read_batch([89, 0, 45])
    assert torch.equal(b["data"], torch.from_numpy(x[[89, 0, 45]]))
    assert b["label"].dtype == torch.int16 and b["label"].tolist() == [89, 0, 45]


class _Tuples(torch.utils.data.Dataset):
    classes = ["a", "b", "c"]

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2, 3), i, dtype=torch.float16), i % 3


def test_torch_dataset_and_callable_package_name(tmp_path: Path) -> None:
    res = feedpipe.convert(_Tuples(), tmp_path / "o", workers=2, shard_bytes=64)
    ds = MemmapDataset(tmp_path / "o")
    assert res.records == 40 and ds.classes == ["a", "b", "c"]
    for i in (0, 39):
        assert torch.equal(ds[i]["data"], _Tuples()[i][0]) and int(ds[i]["label"]) == i % 3


def test_torch_dataset_bad_record_is_named(tmp_path: Path) -> None:
    class Ragged(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> np.ndarray:
            return np.zeros(4 if i != 6 else 5, np.uint8)

    with pytest.raises(DatasetError, match=r"record 6: expected uint8 \(4,\) like record 0"):
        convert(Ragged(), tmp_path / "o", workers=1)
    assert not (tmp_path / "o" / "index.json").exists()


_KILLED = """
import os, sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from feedpipe.datasets.convert import convert

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 200
    def __getitem__(self, i):
        if i == 150 and os.environ.get("FEEDPIPE_TEST_KILL"):
            os._exit(9)  # killed mid-conversion: 8 parts of 25 records; parts 0-5 done
        return np.full(16, i, np.int64)

res = convert(Slow(), {dest!r}, workers=1, shard_bytes=400 * 8)
print("RESUMED", res.resumed_parts, res.records)
"""


def test_restart_after_kill_resumes_complete_parts(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    code = _KILLED.format(tests=str(Path(__file__).parent), dest=str(dest))
    env = {**os.environ, "FEEDPIPE_TEST_KILL": "1"}
    killed = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=False)
    assert killed.returncode == 9
    assert (tmp_path / "out.partial").exists() and not dest.exists()
    with pytest.raises(DatasetError):
        MemmapDataset(dest)
    env.pop("FEEDPIPE_TEST_KILL")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        timeout=120,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "RESUMED 6 200" in done.stdout
    ds = MemmapDataset(dest, verify=True)
    assert torch.equal(ds.read_batch(range(200))[:, 0], torch.arange(200))


def test_existing_dataset_and_bad_sources(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros((4, 2), np.uint8))
    convert(tmp_path / "a.npy", tmp_path / "o", workers=1)
    with pytest.raises(DatasetError, match="already exists"):
        convert(tmp_path / "a.npy", tmp_path / "o", workers=1)
    np.save(tmp_path / "a.npy", np.ones((5, 2), np.uint8))
    res = convert(tmp_path / "a.npy", tmp_path / "o", workers=1, overwrite=True)
    assert res.records == 5 and int(MemmapDataset(tmp_path / "o")[4][0]) == 1
    with pytest.raises(DatasetError, match=r"missing\.npy: source does not exist"):
        convert(tmp_path / "missing.npy", tmp_path / "o2")
    np.save(tmp_path / "b.npy", np.zeros((4, 3), np.uint8))
    with pytest.raises(DatasetError, match=r"b\.npy: array uint8 \(4, 3\) does not match"):
        convert([tmp_path / "a.npy", tmp_path / "b.npy"], tmp_path / "o3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no class sub-directories"):
        convert(tmp_path / "empty", tmp_path / "o4")


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "a.npy", np.arange(64, dtype=np.uint16).reshape(16, 4))
    rc = cli_main(
        [
            "convert",
            str(tmp_path / "a.npy"),
            str(tmp_path / "o"),
            "--shard-size",
            "40B",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "16 records" in out and "shards" in out
    assert len(MemmapDataset(tmp_path / "o").index.shards) == 4
    rc = cli_main(["convert", str(tmp_path / "nope.npy"), str(tmp_path / "o5")])
    assert rc == 1 and "nope.npy" in capsys.readouterr().err


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


def test_npz_with_object_array_is_a_clear_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "o.npz", data=np.array([1, "a"], dtype=object))
    res = _cli("convert", "o.npz", "out", "--no-progress", cwd=tmp_path)
    assert res.returncode == 1 and "o.npz" in res.stderr and "Traceback" not in res.stderr


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
