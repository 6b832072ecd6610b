"""Adversarial review of issue 16 points 11-13: attacks on `feedpipe stage`, the index parser and
redaction that the first implementation missed. Each test failed before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_stage import make_dataset

from feedpipe import MemmapDataset
from feedpipe.errors import DatasetError
from feedpipe.stage import stage


def test_no_verify_existing_never_serves_v2_index_over_v1_shards(tmp_path: Path) -> None:
    """v1 and v2 have shards of the same sizes: trusting sizes over another version's files
    wrote v2's index over v1's bytes, and the default open served them."""
    make_dataset(tmp_path / "v1", shards=2, nbytes=5000, seed=1)
    v2 = make_dataset(tmp_path / "v2", shards=2, nbytes=5000, seed=2)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    stage(tmp_path / "v2", dst, progress=False, verify_existing=False)
    for name, data in v2.items():
        assert (dst / name).read_bytes() == data, name
    assert len(MemmapDataset(dst, verify=True)) > 0


def test_no_verify_existing_after_an_interruption_rechecks_crcs(tmp_path: Path) -> None:
    """No index in dst (an interrupted stage): leftovers of the same size are not trusted."""
    make_dataset(tmp_path / "v1", shards=2, nbytes=5000, seed=1)
    v2 = make_dataset(tmp_path / "v2", shards=2, nbytes=5000, seed=2)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    (dst / "index.json").unlink()  # what a stage of v2 killed after its first step leaves
    stage(tmp_path / "v2", dst, progress=False, verify_existing=False)
    for name, data in v2.items():
        assert (dst / name).read_bytes() == data, name
    MemmapDataset(dst, verify=True)


def test_no_verify_existing_still_skips_a_complete_same_version(tmp_path: Path) -> None:
    make_dataset(tmp_path / "v1", shards=2, nbytes=5000, seed=1)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    result = stage(tmp_path / "v1", dst, progress=False, verify_existing=False)
    assert result.copied == 0 and result.skipped > 0


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
    with pytest.raises(DatasetError, match="index.json.*control characters"):
        stage(src, dst, progress=False)
    MemmapDataset(dst, verify=True)  # the old version is untouched
