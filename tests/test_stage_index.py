"""The dataset index a stage reads: names it may not list (temp prefixes, reserved names, control
characters) and indexes nested too deep are a ``DatasetError`` naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _helpers import relocate_dataset as _relocate
from test_stage import make_dataset

from feedpipe import MemmapDataset
from feedpipe.errors import DatasetError
from feedpipe.remote import transfer as _remote
from feedpipe.remote.stage import stage


def test_an_index_listing_a_temp_prefixed_file_is_refused(tmp_path: Path) -> None:
    make_dataset(tmp_path / "src", shards=1, nbytes=5000)
    _relocate(tmp_path / "src", {"shard-00000.data": _remote.TEMP_PREFIX + "1.2.ab.x"})
    with pytest.raises(DatasetError, match="temps"):
        stage(tmp_path / "src", tmp_path / "dst", progress=False)


@pytest.mark.parametrize("name", ["index.json", "a//b", "./x"])
def test_an_index_listing_a_reserved_name_is_refused(tmp_path: Path, name: str) -> None:
    """A hostile index (valid CRCs) must not make a shard overwrite the index itself."""
    make_dataset(tmp_path / "src", shards=1, nbytes=5000)
    doc = json.loads((tmp_path / "src" / "index.json").read_text())
    doc["shards"][0]["files"]["data"]["path"] = name
    (tmp_path / "src" / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match="not a valid dataset file name"):
        stage(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst" / "index.json").exists()


def test_a_deeply_nested_remote_index_is_a_dataset_error() -> None:
    """A hostile remote ``index.json`` nested past the JSON parser's limit names the URL."""
    raw = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(DatasetError, match="nested too deeply"):
        _remote.parse_index(raw, "memory://bucket/ds/index.json")


@pytest.mark.parametrize("name", ["x\x00y", "x\ny", "a/\rb", "x\x7f"])
def test_an_index_listing_a_control_character_name_is_a_clear_error(
    tmp_path: Path, name: str
) -> None:
    """A NUL raised a bare ValueError ('embedded null byte', no file named); a newline forged
    extra lines in error messages and logs."""
    make_dataset(tmp_path / "src0", shards=2, nbytes=5000)
    src = tmp_path / "src"
    shutil.copytree(tmp_path / "src0", src)
    doc = json.loads((src / "index.json").read_text())
    doc["shards"][1]["files"]["data"]["path"] = name
    (src / "index.json").write_text(json.dumps(doc))
    dst = tmp_path / "dst"
    stage(tmp_path / "src0", dst, progress=False)
    with pytest.raises(DatasetError, match=r"index\.json.*control characters"):
        stage(src, dst, progress=False)
    MemmapDataset(dst, verify=True)  # the old version is untouched
