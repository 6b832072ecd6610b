"""The remote tier's download (``ckpt.tiers.store.RemoteStore.download``, the restore and fetch
of a remote step) never writes through a symlink: the write-path matrix of
tests/test_stage_destination.py, for ckpt. A directory on the way is swapped for a symlink to
``outside`` at the moment of a write (a hook on the write itself, a real ``file://`` remote);
nothing lands outside, and the error is a ``CheckpointError`` naming the path."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec.implementations.local as fs_local
import pytest
from _helpers import small_state as _state

from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions
from ckpt.tiers.store import RemoteStore
from feedpipe.io.dirfd import TempFile
from feedpipe.io.ownership import claim, marker_name, owns

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _remote(tmp_path: Path, *, sub: bool = False) -> RemoteOptions:
    """A ``file://`` remote holding step 1 (``sub``: its data file moved to ``sub/``, with a
    manifest, CRC-valid, naming it there)."""
    url = f"file://{tmp_path}/remote/run"
    opts = RemoteOptions(url, deadline_s=10)
    with CheckpointManager(tmp_path / "writer", remote=opts) as m:
        m.save(1, _state(1)).result(30)
        m.wait(uploads=True)
    step = tmp_path / "remote" / "run" / "step-1"
    if sub:
        body = fmt.read_manifest(step)
        (rec,) = body["files"]
        (step / "sub").mkdir()
        (step / rec["name"]).rename(step / "sub" / rec["name"])
        for entry in body["entries"]:
            entry["file"] = f"sub/{rec['name']}"
        rec["name"] = f"sub/{rec['name']}"
        fmt.write_manifest(step, body)
    return opts


def _aside(path: Path, outside: Path, aside: Path | None = None) -> Path:
    """The attacker: move the directory ``path`` to ``aside`` (or remove it) and link it to
    ``outside``."""
    if aside is None:
        shutil.rmtree(path)
    else:
        os.rename(path, aside)
    path.symlink_to(outside, target_is_directory=True)
    return path


def _on_get_file(monkeypatch: pytest.MonkeyPatch, attack: Callable[[str], object]) -> None:
    """Run ``attack(rpath)`` once, just before fsspec writes the first downloaded data file."""
    real = fs_local.LocalFileSystem.get_file
    done: list[bool] = []

    def hooked(self: Any, rpath: str, lpath: str, *args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            attack(rpath)
        return real(self, rpath, lpath, *args, **kwargs)

    monkeypatch.setattr(fs_local.LocalFileSystem, "get_file", hooked)


def _into(tmp_path: Path) -> Path:
    into = tmp_path / "local" / "step-1.tmp-remote-x"
    into.mkdir(parents=True)
    return into


def _restore_dir(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    """A fresh node restores step 1; its download directory is moved aside and linked out."""
    opts = _remote(tmp_path)
    node = tmp_path / "node"

    def attack(_rpath: str) -> None:
        (tmp,) = node.glob("step-1.tmp-remote*")
        _aside(tmp, outside, tmp_path / "aside")

    _on_get_file(mp, attack)
    match = r"node/step-1\.tmp-remote\S*: was replaced"
    with CheckpointManager(node, remote=opts) as m, pytest.raises(CheckpointError, match=match):
        m.restore(1)
    assert not list(node.glob("step-1*"))  # the link was removed, never what it reaches


def _store_sub_removed(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    """``sub/`` of the download is removed while its file downloads: nothing lands anywhere."""
    store = RemoteStore(_remote(tmp_path, sub=True))
    into = _into(tmp_path)
    _on_get_file(mp, lambda _r: _aside(into / "sub", outside))
    with pytest.raises(CheckpointError, match=r"step-1\.tmp-remote-x/sub: was replaced"):
        store.download(1, into)


def _store_sub_moved(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    """``sub/`` is moved aside while its file downloads: the file lands in the moved folder."""
    store = RemoteStore(_remote(tmp_path, sub=True))
    into = _into(tmp_path)
    _on_get_file(mp, lambda _r: _aside(into / "sub", outside, tmp_path / "aside"))
    with pytest.raises(CheckpointError, match=r"step-1\.tmp-remote-x/sub: was replaced"):
        store.download(1, into)
    (landed,) = (tmp_path / "aside").iterdir()  # the file went where its fd was: the folder
    assert landed.stat().st_size > 0


def _store_into_before(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    """``into`` itself is a symlink by the time the download opens it: refused, not followed."""
    store = RemoteStore(_remote(tmp_path))
    into = _into(tmp_path)
    real = store.manifest

    def manifest(step: int) -> bytes | None:
        _aside(into, outside)
        return real(step)

    mp.setattr(store, "manifest", manifest)
    with pytest.raises(CheckpointError, match=r"step-1\.tmp-remote-x: is a symlink"):
        store.download(1, into)


def _store_planted(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    """A link planted in ``into`` under a name the download writes: never written through."""
    store = RemoteStore(_remote(tmp_path))
    into = _into(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (into / fmt.MANIFEST).symlink_to(victim)
    with pytest.raises(CheckpointError, match=r"step-1\.tmp-remote-x/manifest\.json"):
        store.download(1, into)
    assert victim.read_bytes() == b"precious"


def _root_claim(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    """A new checkpoint root is swapped for a link as ckpt's marker is written: refused by name,
    the marker went to the directory claimed, not through the link."""
    root = tmp_path / "run"
    real = TempFile.commit
    done: list[bool] = []

    def commit(self: TempFile, *, durable: bool = True) -> None:
        if not done and self.final == marker_name("ckpt"):
            done.append(True)
            _aside(root, outside, tmp_path / "aside")
        real(self, durable=durable)

    mp.setattr(TempFile, "commit", commit)
    match = r"run: was replaced while ckpt claimed it"
    with pytest.raises(NotADirectoryError, match=match), CheckpointManager(root) as m:
        m.save(1, _state(1)).result(30)
    assert done and owns(tmp_path / "aside", "ckpt")


_DOWNLOADS = {
    "ckpt: the root's claim (first save)": _root_claim,
    "restore: the download directory": _restore_dir,
    "download: a subdirectory removed": _store_sub_removed,
    "download: a subdirectory moved aside": _store_sub_moved,
    "download: the directory itself, before it is opened": _store_into_before,
    "download: a link planted under a file's name": _store_planted,
}


@pytest.mark.parametrize("path", list(_DOWNLOADS))
def test_a_download_never_writes_through_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    _DOWNLOADS[path](tmp_path, outside, monkeypatch)
    assert list(outside.iterdir()) == []


def test_a_download_is_complete_and_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unattacked, the download holds the manifest and every file, each fsynced (recorded by a
    hook on os.fsync) before ``download`` returns; a subdirectory works as well."""
    store = RemoteStore(_remote(tmp_path, sub=True))
    into = _into(tmp_path)
    synced: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.download(1, into)
    monkeypatch.undo()
    body = fmt.read_manifest(into)
    for rec in body["files"]:
        fmt.verify_file(into, rec)
    for p in (into / fmt.MANIFEST, into / body["files"][0]["name"], into / "sub", into):
        st = p.stat()
        assert (st.st_dev, st.st_ino) in synced, p


def test_claim_never_follows_a_symlinked_root(tmp_path: Path) -> None:
    """``claim`` opens its root with O_NOFOLLOW: a root that is a symlink is refused by name and
    its target is never marked."""
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(NotADirectoryError, match=r"link: a symlink \(never followed\)"):
        claim(link, "ckpt", lambda p: True)
    assert list(target.iterdir()) == []
    assert claim(target, "ckpt", lambda p: False) and owns(target, "ckpt")
