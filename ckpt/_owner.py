"""What ckpt may delete or overwrite: the one predicate that every deleting path asks.

ckpt deletes or overwrites only what it can prove it wrote. The proof, per entry of a checkpoint
root (``ckpt._layout`` spells every name):

- the root: ckpt's marker ``.ckpt-owner.json`` (``feedpipe.io.ownership``), written by
  ``claim_root`` before the first save, download or DCP commit. A non-empty directory without it
  is adopted only when ``is_ours`` accepts every entry (a root written by an earlier version holds
  only ckpt steps); otherwise ``ForeignEntriesError`` names the other entries and nothing is
  written;
- ``step-N``, ``step-N.tmp-*``, ``step-N.del-*``: real directories holding only ckpt data files
  (``data.bin``, ``rank-NNNNN.bin``, regular files) and at most a manifest that is ckpt's
  (``is_ckpt_dir``); a ``step-N`` cut short by an eviction has no manifest left, and the
  manifest of a temporary directory may be torn by a crash (empty, or cut after its first
  bytes: what is there must be ckpt's head);
- ``latest`` and ``latest.tmp-*``: a regular file holding ``step-N`` (or, for the temp, nothing);
- ``.lock``: a regular file holding nothing or ``pid N``; ``upload-status.json``,
  ``retention.json``, ``runs.json``: ckpt's JSON; their temporary files and the marker's:
  regular files.

A symlink is never ours. Even inside a claimed root, every deleting path (leftover cleanup,
``ckpt.saving.commit.settle``, eviction, replacing ``step-N`` or ``latest``, ``ckpt gc``, the
siblings of ``ckpt.save(PATH)``, the remote tier's retention) asks this module first and leaves
what it does not accept where it is. Reading a manifest here checks only that ckpt wrote it (its
canonical head and ``"format":"ckpt"``), not that it is intact: a corrupt ckpt step is still
ckpt's to delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt import _layout
from feedpipe.io import temp_target
from feedpipe.io.dirfd import read_regular
from feedpipe.io.ownership import claim, foreign_entries, marker_name, owns

__all__ = [
    "TOOL",
    "claim_root",
    "foreign",
    "is_ckpt_dir",
    "is_ckpt_manifest",
    "is_ours",
    "owned",
]

TOOL = "ckpt"
_HEAD = re.compile(rb'\A\{"crc32c":"[0-9a-f]{8}","body":\{')  # format.write_manifest's bytes
_LOCK = re.compile(rb"\A(pid [0-9]+)?\Z")
_SMALL = 4096  # latest, .lock: ckpt writes a few bytes; anything longer is not its


_TEMPLATE = b'{"crc32c":"........","body":{'  # "." stands for a hex digit


def is_ckpt_manifest(raw: bytes, torn: bool = False) -> bool:
    """Whether ``raw`` are the bytes of a manifest that ckpt wrote (its checksum unchecked);
    with ``torn``, also the start of one that a crash cut short (nothing, or ckpt's head)."""
    if _HEAD.match(raw) is not None:
        return torn or b'"format":"ckpt"' in raw
    if not torn or len(raw) >= len(_TEMPLATE):
        return False
    hexdigits = b"0123456789abcdef"
    pairs = zip(_TEMPLATE[: len(raw)], raw, strict=True)
    return all(t == c or (t == ord(".") and c in hexdigits) for t, c in pairs)


def _read(name: str | Path, dir_fd: int | None = None, limit: int | None = None) -> bytes | None:
    """The bytes of a regular file (never through a symlink), ``None`` if it is not one, if it
    is longer than ``limit`` or if reading it fails."""
    try:
        return read_regular(name, dir_fd=dir_fd, limit=limit)
    except OSError:
        return None


def _dir_ok(fd: int, torn: bool) -> bool:
    """Whether the directory open at ``fd`` holds only ckpt data files and a ckpt manifest
    (``torn``: or what a crash left of one)."""
    with os.scandir(fd) as it:
        names = [e.name for e in it]
    for name in names:
        if name == _layout.MANIFEST:
            raw = _read(name, fd)
            if raw is None or not is_ckpt_manifest(raw, torn):
                return False
            continue
        if not _layout.is_data_name(name):
            return False
        try:
            if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                return False
        except FileNotFoundError:  # deleted under us (a concurrent cleanup): not a verdict
            continue
    return True


def is_ckpt_dir(path: Path, fd: int | None = None, *, scratch: bool = False) -> bool:
    """Whether ``path`` (or the directory open at ``fd``) is a real directory of ckpt's: only
    ckpt data files and at most a ckpt manifest (a step, the output of ``ckpt.save``; an empty
    directory holds nothing to lose and qualifies too). ``scratch``: a temporary or retired
    directory, whose manifest may be torn by a crash."""
    if fd is not None:
        return _dir_ok(fd, scratch)
    try:
        own = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, a file or a symlink
        return False
    try:
        return _dir_ok(own, scratch)
    except OSError:
        return False
    finally:
        os.close(own)


def _is_json_of(path: Path, check: str) -> bool:
    raw = _read(path, limit=64 << 20)
    if raw is None:
        return False
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply (not ckpt's)
        return False
    if not isinstance(doc, dict):
        return False
    return doc.get("tool") == TOOL if check == "tool" else isinstance(doc.get("steps"), dict)


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_ours(path: Path) -> bool:
    """Whether the entry ``path`` of a checkpoint root is one that ckpt wrote (module docstring).
    Symlinks are never followed and never ours. An entry gone since it was listed (a temporary
    file renamed by a concurrent writer) holds nothing to protect: it counts as ours."""
    return _is_ours(path) or not os.path.lexists(path)


def _is_latest(path: Path) -> bool:
    """``latest``: ``step-N``; its temporary: the same, or nothing (cut before its write)."""
    raw = _read(path, limit=_SMALL)
    if raw is None:
        return False
    if raw == b"" and path.name != _layout.LATEST:  # a temp cut before its write
        return True
    try:
        return _layout.latest_step(raw) is not None
    except UnicodeDecodeError:
        return False


def _is_lock(path: Path) -> bool:
    raw = _read(path, limit=_SMALL)
    return raw is not None and _LOCK.match(raw.strip()) is not None


def _is_atomic_temp(path: Path) -> bool:
    """``feedpipe.io.atomic_write``'s temp of the marker or the policy: a regular file."""
    found = temp_target(path.name)
    return (
        found is not None
        and found[0] in (marker_name(TOOL), _layout.RETENTION_FILE, _layout.RUNS_FILE)
        and (_is_regular(path))
    )


_FILES: dict[str, Callable[[Path], bool]] = {
    _layout.LATEST: _is_latest,
    _layout.LOCK: _is_lock,
    _layout.STATUS_FILE: lambda path: _is_json_of(path, "steps"),
    _layout.RETENTION_FILE: lambda path: _is_json_of(path, "tool"),
    _layout.RUNS_FILE: lambda path: _is_json_of(path, "tool"),
}
"""The check of each file of a root that ckpt names exactly."""


def _is_ours(path: Path) -> bool:
    name = path.name
    if _layout.is_step_name(name) or _layout.is_step_scratch(name):
        return is_ckpt_dir(path, scratch=_layout.is_step_scratch(name))
    check = _FILES.get(name)
    if check is not None:
        return check(path)
    if _layout.is_latest_tmp(name):
        return _is_latest(path)
    if _layout.is_status_tmp(name):
        return _is_regular(path)
    return _is_atomic_temp(path)


def claim_root(root: str | os.PathLike[str], record: Mapping[str, Any] | None = None) -> bool:
    """Make ``root`` ckpt's (``feedpipe.io.ownership.claim`` with ``is_ours``): a missing or
    empty directory is created and marked, a root of ckpt's own steps is adopted; any other
    entry raises ``ForeignEntriesError`` naming it, and nothing is written."""
    return claim(os.path.realpath(root), TOOL, is_ours, record)  # DIR may link to a fast disk


def owned(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds ckpt's marker."""
    return owns(root, TOOL)


def foreign(root: str | os.PathLike[str]) -> list[str]:
    """The names in ``root`` that ckpt did not write (sorted; ``[]`` if ``root`` is missing)."""
    with contextlib.suppress(FileNotFoundError):
        return foreign_entries(root, TOOL, is_ours)
    return []
