"""feedpipe.io.dirfd, attacked on a real filesystem: a symlink planted at each level, a file where
a directory is expected, a directory replaced after it was opened and between two operations, a
temp replaced before its rename, permissions. The invariant: nothing lands outside the tree."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from feedpipe.io import dirfd
from feedpipe.io.dirfd import Dir, Tree, UnsafePathError


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    return out


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "keep"


def _swap_for_link(path: Path, target: Path) -> Path:
    """The attacker: move the directory at ``path`` aside and put a link to ``target`` there."""
    aside = path.with_name(path.name + ".aside")
    os.rename(path, aside)
    path.symlink_to(target, target_is_directory=True)
    return aside


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_symlink_at_each_level_is_refused_by_name(
    tmp_path: Path, outside: Path, level: int
) -> None:
    root = tmp_path / "root"
    (root / "a" / "b" / "c").mkdir(parents=True)
    linked = root.joinpath(*["a", "b", "c"][:level])
    shutil.rmtree(linked)
    linked.symlink_to(outside, target_is_directory=True)
    with Tree.open(root) as tree:
        with pytest.raises(UnsafePathError, match=r"is a symlink \(never followed\)") as info:
            tree.dir("a/b/c", create=True)
        assert info.value.filename == str(linked)
    _untouched(outside)


def test_a_file_where_a_directory_is_expected_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_text("a file")
    with Tree.open(root) as tree:
        with pytest.raises(UnsafePathError, match="is not a directory") as info:
            tree.parent("a/x.data", create=True)
        assert info.value.filename == str(root / "a")
    assert (root / "a").read_text() == "a file"
    with pytest.raises(UnsafePathError, match="is not a directory"):
        Dir.at(root / "a")


def test_a_directory_swapped_after_it_was_opened_is_never_written_through(
    tmp_path: Path, outside: Path
) -> None:
    root = tmp_path / "root"
    with Tree.open(root, create=True) as tree:
        sub = tree.dir("sub", create=True)
        aside = _swap_for_link(root / "sub", outside)
        sub.write_atomic("x.data", b"bytes")
        tmp = sub.temp("y.data", 3)
        os.write(tmp.fd, b"abc")
        tmp.commit()
        tmp.discard()
        assert sub.touch("x.data") and sub.unlink("x.data")
        sub.fsync()
        assert tree.dir("sub") is sub  # opened once: never looked up again
    _untouched(outside)
    assert sorted(p.name for p in aside.iterdir()) == ["y.data"]


def test_a_removed_directory_takes_no_new_entries(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "root"
    with Tree.open(root, create=True) as tree:
        sub = tree.dir("sub", create=True)
        shutil.rmtree(root / "sub")
        (root / "sub").symlink_to(outside, target_is_directory=True)
        with pytest.raises(UnsafePathError, match="removed or replaced while in use") as info:
            sub.temp("x.data", 1)
        assert str(root / "sub") in str(info.value)
    _untouched(outside)


def test_a_directory_replaced_between_the_write_and_the_rename(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap happens inside the rename call itself (a hook on os.replace)."""
    root = tmp_path / "root"
    real: Callable[..., None] = os.replace
    moved: list[Path] = []

    def _swap_then_replace(*args: object, **kwargs: object) -> None:
        if not moved:
            moved.append(_swap_for_link(root / "sub", outside))
        real(*args, **kwargs)

    with Tree.open(root, create=True) as tree:
        sub = tree.dir("sub", create=True)
        monkeypatch.setattr(os, "replace", _swap_then_replace)
        sub.write_atomic("index.json", b"{}")
    _untouched(outside)
    assert (moved[0] / "index.json").read_bytes() == b"{}"


def test_a_temp_replaced_before_its_rename_is_refused(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "root"
    with Tree.open(root, create=True) as tree:
        tmp = tree.root.temp("x.data", 4)
        with open(tmp.fd_path, "wb") as f:
            f.write(b"mine")
        os.unlink(root / tmp.name)  # the attacker puts a link in the temp's place
        (root / tmp.name).symlink_to(outside / "keep.txt")
        with pytest.raises(UnsafePathError, match="removed or replaced before its rename"):
            tmp.commit()
        tmp.discard()
        assert (root / tmp.name).is_symlink()  # not ours: left alone, never followed
    assert not (root / "x.data").exists()
    _untouched(outside)


def test_the_fd_path_writes_the_open_file_not_the_name(tmp_path: Path, outside: Path) -> None:
    """What a library given ``TempFile.fd_path`` writes reaches the temp even after its name was
    replaced by a link: no directory entry is looked up."""
    root = tmp_path / "root"
    with Tree.open(root, create=True) as tree:
        tmp = tree.root.temp("x.data", 4)
        os.unlink(root / tmp.name)
        (root / tmp.name).symlink_to(outside / "keep.txt")
        with open(tmp.fd_path, "wb") as f:
            f.write(b"mine")
        assert os.pread(tmp.fd, 4, 0) == b"mine"
        tmp.discard()
    _untouched(outside)


def test_a_link_to_the_root_is_the_folder_it_names(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with Tree.open(tmp_path / "link") as tree:
        tree.root.write_atomic("f", b"1")
    assert (real / "f").read_bytes() == b"1"


def _read_only(path: Path) -> Callable[[], object]:
    """Make the directory ``path`` refuse new entries; returns the undo. Root ignores modes, so
    as root the directory is made immutable (``chattr +i``), or the test is skipped."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        return lambda: path.chmod(0o700)
    import subprocess

    made = subprocess.run(["chattr", "+i", str(path)], check=False, capture_output=True)
    if made.returncode != 0:
        pytest.skip("running as root without chattr +i: directory permissions do not apply")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_directory_refusing_writes_is_an_error_naming_the_path(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ro").mkdir(parents=True)
    undo = _read_only(root / "ro")
    try:
        with Tree.open(root) as tree:
            with pytest.raises(PermissionError) as info:
                tree.dir("ro").temp("x.data", 1)
            assert str(root / "ro") in str(info.value)
            with pytest.raises(PermissionError, match=str(root / "ro" / "new")):
                tree.dir("ro/new", create=True)
    finally:
        undo()
    assert list((root / "ro").iterdir()) == []


def test_close_closes_every_directory_it_opened(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    tree = Tree.open(tmp_path / "root", create=True)
    tree.dir("a/b/c", create=True)
    tree.dir("a/d", create=True)
    assert len(os.listdir("/proc/self/fd")) == before + 5
    tree.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_fd_path_names_the_open_file(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.path.samefile(dirfd.fd_path(fd), tmp_path / "f")
    finally:
        os.close(fd)


@pytest.mark.parametrize("rel", ["..", "a/../..", "a//b", "./a", "a/"])
def test_a_path_leading_out_of_the_tree_is_refused(tmp_path: Path, rel: str) -> None:
    tree = Tree.open(tmp_path / "root", create=True)
    with tree, pytest.raises(ValueError, match="not a path below"):
        tree.dir(rel, create=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    assert list((tmp_path / "root").iterdir()) == []


def _unblocked(fifo: Path, fn: Callable[[], object], wait_s: float = 20.0) -> dict[str, object]:
    """Run ``fn`` on a thread; if it is still blocked after ``wait_s`` (an open of the FIFO
    waiting for a writer), unblock it by opening the FIFO for writing. ``"hung"`` says so."""
    import threading

    got: dict[str, object] = {}

    def body() -> None:
        try:
            got["value"] = fn()
        except Exception as exc:
            got["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(wait_s)
    got["hung"] = t.is_alive()
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the open returns
        t.join(wait_s)
    return got


def test_a_fifo_planted_where_a_file_is_read_is_none_never_a_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "index.json")
    with Dir.at(tmp_path) as d:
        got = _unblocked(tmp_path / "index.json", lambda: d.read("index.json"))
    assert not got["hung"], "Dir.read blocked on a FIFO planted in the tree"
    assert got.get("value") is None and "error" not in got
