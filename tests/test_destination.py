"""feedpipe.datasets.destination: ``stage`` and ``convert`` claim their destination by the one
ownership rule (issue 25 item 3).

The matrix: each tool x (a user's own ``index.json``, user files, a symlink entry, the tool's own
previous output). A destination holding anything the tool did not write is refused by name and
left byte for byte as it was (no lock file, no marker, no ``.partial``); the tool's own previous
output is resumed / replaced.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_stage import make_dataset

import feedpipe
from feedpipe import MemmapDataset
from feedpipe.datasets.convert import convert
from feedpipe.errors import DatasetError
from feedpipe.io.ownership import owns
from feedpipe.remote.stage import stage


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (links not followed): a file's bytes or a link's target."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (
            ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
        )
    return out


def _user_index(dst: Path, outside: Path) -> str:
    (dst / "index.json").write_text('{"my": "own config"}')
    return "index.json"


def _user_files(dst: Path, outside: Path) -> str:
    (dst / "notes.txt").write_text("my notes")
    (dst / "shard-00000.data").write_bytes(b"my own bytes")  # a listed name among user files
    return "notes.txt"


def _symlink(dst: Path, outside: Path) -> str:
    target = outside / "mine.data"
    target.write_bytes(b"keep")
    (dst / "shard-00000.data").symlink_to(target)
    return "shard-00000.data (a symlink)"


def _run_stage(src: Path, dst: Path, overwrite: bool = False) -> None:
    stage(src, dst, progress=False)


def _run_convert(src: Path, dst: Path, overwrite: bool = False) -> None:
    convert(src.parent / "x.npy", dst, workers=1, overwrite=overwrite, progress_bar=False)


TOOLS: dict[str, Callable[..., None]] = {"stage": _run_stage, "convert": _run_convert}
FOREIGN = {"user index.json": _user_index, "user files": _user_files, "symlink": _symlink}


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """``tmp_path/src`` (a dataset, for stage) and ``tmp_path/x.npy`` (for convert)."""
    make_dataset(tmp_path / "src", shards=2, nbytes=4000)
    np.save(tmp_path / "x.npy", np.arange(40, dtype=np.int32).reshape(10, 4))
    return tmp_path / "src"


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_destination_holding_foreign_entries_is_refused_and_untouched(
    tmp_path: Path, sources: Path, tool: str, case: str
) -> None:
    (tmp_path / "outside").mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    named = FOREIGN[case](dst, tmp_path / "outside")
    before, outside = _snapshot(dst), _snapshot(tmp_path / "outside")
    with pytest.raises(DatasetError, match="did not write") as info:
        TOOLS[tool](sources, dst, overwrite=True)
    assert named in str(info.value) and str(dst) in str(info.value)
    assert _snapshot(dst) == before
    assert _snapshot(tmp_path / "outside") == outside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "outside", "src", "x.npy"]


@pytest.mark.parametrize(
    ("tool", "marked"),
    [("stage", True), ("stage", False), ("convert", False)],
    ids=["stage-marked", "stage-older-unmarked", "convert"],
)
def test_the_tools_own_previous_output_is_resumed_or_replaced(
    tmp_path: Path, sources: Path, tool: str, marked: bool
) -> None:
    """stage marks its folder; an older unmarked one holding only a dataset is adopted.
    convert writes no marker (a dataset's bytes depend on its source alone) and replaces a
    folder holding only a dataset's files."""
    dst = tmp_path / "dst"
    TOOLS[tool](sources, dst)
    assert owns(dst, tool) == (tool == "stage")
    if tool == "stage" and not marked:
        os.unlink(dst / ".stage-owner.json")
    if tool == "stage":
        (dst / "shard-00001.data").unlink()  # an interrupted stage: resumed
        _run_stage(sources, dst)
    else:
        with pytest.raises(DatasetError, match="already exists"):
            _run_convert(sources, dst)
        _run_convert(sources, dst, overwrite=True)
    assert owns(dst, tool) == (tool == "stage")
    assert len(MemmapDataset(dst)) > 0
    (dst / "notes.txt").write_text("mine, added later")  # the marker is no licence
    with pytest.raises(DatasetError, match=r"notes\.txt"):
        TOOLS[tool](sources, dst, overwrite=True)
    assert (dst / "notes.txt").read_text() == "mine, added later"


def test_stage_never_takes_over_a_dataset_it_did_not_write(tmp_path: Path, sources: Path) -> None:
    """A dataset that convert (or a user) wrote holds no stage marker and no stage lock: stage
    refuses it by name rather than replacing its shards, even when it is a copy of the source."""
    dst = tmp_path / "dst"
    _run_convert(sources, dst)
    before = {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()}
    with pytest.raises(DatasetError, match=r"index\.json"):
        _run_stage(sources, dst)
    assert {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()} == before
    assert not owns(dst, "stage")


def test_a_restage_of_fewer_shards_after_an_interrupted_one_resumes(tmp_path: Path) -> None:
    """v1 (3 shards) staged; a stage of v2 (2 shards) removed the index and was killed: v1's
    third shard is listed nowhere now, but in stage's marked folder it is stage's own."""
    make_dataset(tmp_path / "v1", shards=3, nbytes=4000, seed=1)
    make_dataset(tmp_path / "v2", shards=2, nbytes=4000, seed=2)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    (dst / "index.json").unlink()
    stage(tmp_path / "v2", dst, progress=False)
    assert (dst / "index.json").read_bytes() == (tmp_path / "v2" / "index.json").read_bytes()


def test_stage_into_a_symlink_to_a_folder_writes_into_that_folder(
    tmp_path: Path, sources: Path
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    stage(sources, tmp_path / "link", progress=False)
    assert (tmp_path / "link").is_symlink() and owns(tmp_path / "real", "stage")
    assert len(MemmapDataset(tmp_path / "real")) > 0


@pytest.mark.parametrize("name", [".stage-owner.json", "sub/.cache-owner.json"])
def test_a_source_index_listing_a_marker_name_is_refused(
    tmp_path: Path, sources: Path, name: str
) -> None:
    """A hostile (CRC-valid) index listing ``.stage-owner.json`` as a shard file made stage
    write the shard's bytes over its own marker: every later stage into that folder failed
    on an unreadable marker. No dataset file may have a marker's name."""
    import json
    import shutil

    src = tmp_path / "hostile"
    shutil.copytree(sources, src)
    doc = json.loads((src / "index.json").read_text())
    info = next(iter(doc["shards"][0]["files"].values()))
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    os.rename(src / info["path"], src / name)
    info["path"] = name
    (src / "index.json").write_text(json.dumps(doc))
    dst = tmp_path / "dst"
    with pytest.raises(DatasetError, match=r"hostile/index\.json: shard 0 .*ownership marker"):
        stage(src, dst, progress=False)
    assert not dst.exists() or not any(dst.iterdir())
    stage(sources, dst, progress=False)  # the folder is still stage's
    assert owns(dst, "stage")


def _row(i: int) -> np.ndarray:
    return np.full(3, i, np.int64)


@pytest.mark.parametrize("index", [b'{"pages": ["a.html"]}', None], ids=["user-index", "dataset"])
def test_a_remote_destination_follows_the_local_rule(tmp_path: Path, index: bytes | None) -> None:
    """The remote sibling of the destination rule: a prefix holding any ``index.json`` was
    taken for a dataset without a look at the rest. ``convert(fn)`` with ``overwrite=True``
    deleted the user's own ``index.json`` (and any of their files named like a shard) and
    mixed its shards with their ``notes.txt``. Now a foreign index or entry is refused by
    name, as locally."""
    import fsspec

    from feedpipe.datasets.convert_fn import convert_fn

    fs = fsspec.filesystem("memory")
    root = f"/atk-{tmp_path.name}"
    url = f"memory://{root}"
    if index is None:
        convert_fn(_row, list(range(4)), url, num_workers=1, progress_bar=False)
    else:
        fs.pipe_file(f"{root}/index.json", index)
    fs.pipe_file(f"{root}/notes.txt", b"mine")
    before = {p: fs.cat_file(p) for p in fs.find(root)}
    what = r"index\.json: not a feedpipe dataset" if index else r"did not write \('notes\.txt'\)"
    try:
        for ow in (False, True):
            with pytest.raises(DatasetError, match=what):
                convert_fn(
                    _row, list(range(5)), url, overwrite=ow, num_workers=1, progress_bar=False
                )
            with pytest.raises(DatasetError, match=what), feedpipe.MemmapWriter(url, overwrite=ow):
                pass
        assert {p: fs.cat_file(p) for p in fs.find(root)} == before
        if index is None:  # the prefix holds only its dataset again: replaced as before
            fs.rm_file(f"{root}/notes.txt")
            convert_fn(_row, list(range(5)), url, overwrite=True, num_workers=1, progress_bar=False)
    finally:
        fs.rm(root, recursive=True)


def test_stage_of_a_dataset_into_itself_is_refused(tmp_path: Path, sources: Path) -> None:
    """``stage SRC SRC`` (or through a link to it) adopted the source as its destination; with
    one shard file damaged, it removed the source's own index.json before its copy failed."""
    (tmp_path / "link").symlink_to(sources, target_is_directory=True)
    shard = next(p for p in sorted(sources.iterdir()) if p.name.startswith("shard-"))
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    before = _snapshot(sources)
    for src in (sources, tmp_path / "link"):
        with pytest.raises(DatasetError, match="is the source dataset itself"):
            stage(src, sources, progress=False)
    assert _snapshot(sources) == before
