"""One directory fsync with one error rule for feedpipe and ckpt, and one atomic-replace helper
(``feedpipe.io.fsutil``; issue 17). Real filesystems: /proc is one that cannot sync a directory
(its fsync gives EINVAL)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from ckpt.saving import commit
from feedpipe.format import INDEX_NAME, read_index, write_index
from feedpipe.io import atomic_write, fsync_dir
from feedpipe.io.remote import TEMP_PREFIX

BOTH = [fsync_dir, commit.fsync_dir]


@pytest.mark.parametrize("sync", BOTH, ids=["feedpipe.io", "ckpt"])
def test_a_filesystem_that_cannot_sync_directories_is_not_an_error(sync: object) -> None:
    fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as info:
            os.fsync(fd)  # the premise: this kernel refuses it
    finally:
        os.close(fd)
    assert info.value.errno == errno.EINVAL
    sync("/proc")  # type: ignore[operator]


@pytest.mark.parametrize("sync", BOTH, ids=["feedpipe.io", "ckpt"])
def test_a_path_that_is_not_a_directory_raises(sync: object, tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        sync(tmp_path / "file")  # type: ignore[operator]
    with pytest.raises(FileNotFoundError):
        sync(tmp_path / "missing")  # type: ignore[operator]


@pytest.mark.parametrize("sync", BOTH, ids=["feedpipe.io", "ckpt"])
def test_an_io_error_of_the_sync_itself_raises(
    sync: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)  # a disk error cannot be produced on demand
    with pytest.raises(OSError) as info:
        sync(tmp_path)  # type: ignore[operator]
    assert info.value.errno == errno.EIO


def test_the_current_directory_is_the_empty_dirname(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    fsync_dir(os.path.dirname("bare-name.json"))
    atomic_write("bare-name.json", b"{}")  # fsyncs the directory "" = "."
    assert (tmp_path / "bare-name.json").read_bytes() == b"{}"


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_replaces_and_leaves_no_temp(
    durable: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    atomic_write(target, b"new", durable=durable)
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["f.bin"]
    assert len(synced) == (2 if durable else 0)  # the file, then its directory


def test_atomic_write_failure_keeps_the_old_file_and_removes_the_temp(tmp_path: Path) -> None:
    target = tmp_path / "d"
    target.mkdir()  # os.replace(file, directory) fails
    (target / "keep").write_bytes(b"1")
    with pytest.raises(IsADirectoryError):
        atomic_write(target, b"new")
    assert sorted(os.listdir(tmp_path)) == ["d"] and os.listdir(target) == ["keep"]


def test_write_index_goes_through_atomic_write(tmp_path: Path) -> None:
    from feedpipe import MemmapWriter

    with MemmapWriter(tmp_path / "ds", shape=(2,), dtype="uint8") as w:
        w.append_batch(np.zeros((3, 2), np.uint8))
    index = read_index(str(tmp_path / "ds"))
    os.unlink(tmp_path / "ds" / INDEX_NAME)
    write_index(tmp_path / "ds", index)
    assert read_index(str(tmp_path / "ds")).to_json() == index.to_json()
    assert not [n for n in os.listdir(tmp_path / "ds") if n.startswith((".", TEMP_PREFIX))]
