"""The one ``file://`` rule (:func:`feedpipe.io.local_file_path`) and every entry point that
follows it: a ``file://`` URL reads as its path, another host is refused naming it, and no
module outside ``feedpipe.io`` strips the scheme itself."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import file_url_fixtures as _fixtures

import feedpipe
from feedpipe import DatasetError, MemmapDataset, MemmapWriter

FILE_URLS = [
    ("file:///abs/x", "/abs/x"),
    ("file://localhost/abs/x", "/abs/x"),
    ("FILE://LocalHost/abs/x", "/abs/x"),  # the scheme and the host name are case-insensitive
    ("file:///a%20b/c?d#e", "/a%20b/c?d#e"),  # literal, as fsspec's local filesystem
    ("file:///abs/x/", "/abs/x/"),
    ("file:name", "file:name"),  # no slash: a relative path whose name has a colon
    ("/abs/x", "/abs/x"),
    ("rel/x", "rel/x"),
    ("s3://bucket/x", "s3://bucket/x"),
]


BAD_FILE_URLS = [
    ("file://otherhost/abs", "another host"),
    ("file://relative/path", "another host"),  # RFC 8089: what follows file:// is a host
    ("file://user:TOPSECRET@localhost/abs", "another host"),
    ("file://", "no path"),
    ("file:///", "no path"),
    ("file://localhost", "no path"),
    ("file:/abs", "ambiguous"),  # what Path() makes of file:///abs and file://localhost/abs
]


@pytest.mark.parametrize(("url", "path"), FILE_URLS)
def test_local_file_path(url: str, path: str) -> None:
    from feedpipe.io import local_file_path

    assert local_file_path(url) == path
    assert local_file_path(Path("/abs/x")) == "/abs/x"  # a PathLike


@pytest.mark.parametrize(("url", "why"), BAD_FILE_URLS)
def test_local_file_path_refuses(url: str, why: str) -> None:
    from feedpipe.io import local_file_path

    with pytest.raises(ValueError, match=why) as err:
        local_file_path(url)
    assert "TOPSECRET" not in str(err.value)


def test_no_file_url_stripping_outside_feedpipe_io() -> None:
    """Every entry point reaches ``file://`` through the one helper, never by slicing."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted([*root.glob("feedpipe/**/*.py"), *root.glob("ckpt/**/*.py")]):
        text = path.read_text()
        if path.relative_to(root).as_posix() != "feedpipe/io/remote.py" and re.search(
            r"""(startswith\(|len\()\s*["']file:""", text
        ):
            found.append(path.relative_to(root).as_posix())
    assert found == []


def _small_dataset(path: Path) -> np.ndarray:
    x = np.arange(24, dtype=np.int32).reshape(6, 4)
    with MemmapWriter(f"FILE://localhost{path}", shape=(4,), dtype="int32") as w:
        w.append_batch(x)
    return x


def test_every_entry_point_uses_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writer, reader, converter, ``feedpipe inspect``, ckpt and fsspec resolution: one rule."""
    from feedpipe import cli as feedpipe_cli
    from feedpipe.io import resolve

    monkeypatch.chdir(tmp_path)
    x = _small_dataset(tmp_path / "ds")
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # not a folder named FILE: or localhost
    ds = MemmapDataset(f"file://localhost{tmp_path}/ds")
    assert np.array_equal(np.stack([ds[i].numpy() for i in range(len(ds))]), x)
    assert resolve(f"FILE://localhost{tmp_path}/ds")[1] == f"{tmp_path}/ds"
    for bad in (f"file://otherhost{tmp_path}/ds", f"file:{tmp_path}/ds"):
        with pytest.raises(ValueError, match="file:"):
            MemmapDataset(bad)
        with pytest.raises(ValueError, match="file:"):
            MemmapWriter(bad, shape=(4,), dtype="int32")
        with pytest.raises(ValueError, match="file:"):
            resolve(bad)
        assert feedpipe_cli.main(["inspect", bad]) == 1  # the CLI's one error handler
        assert re.search("another host|ambiguous", capsys.readouterr().err)
    from ckpt import CheckpointManager

    with CheckpointManager(f"FILE://{tmp_path}/run") as m:
        assert m.directory == tmp_path / "run"
    assert sorted(os.listdir(tmp_path)) == ["ds", "run"]


def _targets(root: Path, paths: dict[str, Path]) -> dict[str, Path]:
    names = {"out": "o1", "out2": "o2", "staged": "staged", "ck": "ck"}
    return {**paths, **{k: root / v for k, v in names.items()}}


def _entry_points(f: dict[str, Any], out: Path) -> dict[str, Any]:
    """Each entry point that takes a local path, called with the (URL) paths ``f``."""
    import ckpt
    from ckpt.cli import main as ckpt_main

    return {
        "MemmapDataset": lambda: len(feedpipe.MemmapDataset(f["mm"])),
        "ZarrDataset": lambda: len(feedpipe.ZarrDataset(f["zarr"])),
        "TarDataset": lambda: len(feedpipe.TarDataset(f["tar"])),
        "convert npy": lambda: feedpipe.convert(f["npy"], f["out"], workers=1).records,
        "convert tar": lambda: feedpipe.convert(f["tar"], f["out2"], workers=1).records,
        "stage": lambda: feedpipe.stage(f["mm"], f["staged"]) and len(os.listdir(out / "staged")),
        "CheckpointManager": lambda: str(ckpt.CheckpointManager(f["ck"]).directory),
        "ckpt CLI": lambda: ckpt_main(["ls", str(f["ck"])]),
    }


@pytest.mark.parametrize("prefix", ["file://", "file://localhost", "FILE://LocalHost"])
def test_every_entry_point_reads_a_file_url_as_its_path(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TarDataset read ``file:///x.tar`` as the relative path ``file:/x.tar``, convert took a
    ``file://`` folder for Zarr, and stage wrote into ``./file:/abs``: now every entry point
    gives the same answer for the URL as for the plain path."""
    monkeypatch.chdir(tmp_path)
    paths = _fixtures(tmp_path)
    plain = _targets(tmp_path, paths)
    urls = {k: f"{prefix}{v}" for k, v in plain.items()}
    want = {name: call() for name, call in _entry_points(plain, tmp_path).items()}
    for p in ("o1", "o2", "staged"):
        import shutil

        shutil.rmtree(tmp_path / p)
    got = {name: call() for name, call in _entry_points(urls, tmp_path).items()}
    assert got == want
    assert not any(p.name.lower().startswith("file:") for p in tmp_path.iterdir())


def test_every_entry_point_refuses_a_file_url_of_another_host_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _fixtures(tmp_path)
    plain = _targets(tmp_path, paths)
    urls = {k: f"file://server{v}" for k, v in plain.items()}
    for name, call in _entry_points(urls, tmp_path).items():
        if name == "ckpt CLI":
            assert call() == 2
            assert f"file://server{tmp_path / 'ck'}" in capsys.readouterr().err
            continue
        with pytest.raises(ValueError, match="names another host") as err:
            call()
        assert f"file://server{tmp_path}" in str(err.value), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a b.tar", "mm", "x.npy", "z.zarr"]


def test_stage_reads_the_relative_file_colon_form_like_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``file:name`` is the relative path ``./file:name`` (the documented rule); fsspec read it
    as ``./name``, so stage copied another dataset than the one named."""
    monkeypatch.chdir(tmp_path)
    _fixtures(tmp_path)
    with pytest.raises(DatasetError, match="file:mm"):
        feedpipe.stage("file:mm", tmp_path / "staged")  # ./file:mm does not exist
    os.rename(tmp_path / "mm", tmp_path / "file:mm")
    feedpipe.stage("file:mm", tmp_path / "staged")
    assert len(feedpipe.MemmapDataset(tmp_path / "staged")) == 3
