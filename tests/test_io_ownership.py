"""feedpipe.io.ownership: one rule for every directory a tool writes into."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from feedpipe.io import ForeignEntriesError, claim, owns
from feedpipe.io.ownership import foreign_entries, marker_name, owner_record


def _never(_p: Path) -> bool:
    return False


def test_a_missing_or_empty_directory_is_created_and_marked(tmp_path: Path) -> None:
    root = tmp_path / "new"
    assert claim(root, "ckpt", _never) is True
    assert owns(root, "ckpt")
    assert claim(root, "ckpt", _never) is False  # already ours: no second write
    empty = tmp_path / "empty"
    empty.mkdir()
    assert claim(empty, "stage", _never, record={"policy": {"keep_last": 3}})
    assert owner_record(empty, "stage")["policy"] == {"keep_last": 3}  # type: ignore[index]


def test_foreign_entries_are_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("user data")
    (tmp_path / "step-7").mkdir()
    with pytest.raises(ForeignEntriesError) as info:
        claim(tmp_path, "ckpt", lambda p: p.name == "step-7")
    assert info.value.entries == ["mine.txt"]
    assert "mine.txt" in str(info.value) and str(tmp_path) in str(info.value)
    assert not (tmp_path / marker_name("ckpt")).exists()


def test_a_directory_of_only_our_entries_is_adopted(tmp_path: Path) -> None:
    (tmp_path / "step-1").mkdir()
    assert foreign_entries(tmp_path, "ckpt", lambda p: p.name.startswith("step-")) == []
    assert claim(tmp_path, "ckpt", lambda p: p.name.startswith("step-"))


def test_another_tools_marker_is_a_foreign_entry(tmp_path: Path) -> None:
    claim(tmp_path, "stage", _never)
    with pytest.raises(ForeignEntriesError, match=r"\.stage-owner\.json"):
        claim(tmp_path, "ckpt", _never)


@pytest.mark.parametrize("kind", ["symlink", "directory", "garbage", "other-tool"])
def test_a_marker_that_is_not_ours_is_refused_not_followed(tmp_path: Path, kind: str) -> None:
    mark = tmp_path / marker_name("ckpt")
    if kind == "symlink":
        target = tmp_path.parent / "elsewhere.json"
        target.write_text(json.dumps({"tool": "ckpt"}))
        os.symlink(target, mark)
    elif kind == "directory":
        mark.mkdir()
    elif kind == "garbage":
        mark.write_bytes(b"\xff{")
    else:
        mark.write_text(json.dumps({"tool": "stage"}))
    with pytest.raises(ValueError, match="marker"):
        claim(tmp_path, "ckpt", lambda p: True)


def test_a_file_is_not_a_directory_to_claim(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        claim(f, "ckpt", _never)
