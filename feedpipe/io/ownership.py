"""One ownership rule for every directory we write: ckpt roots, ``stage`` and ``convert``
destinations, caches.

A tool may create, overwrite or delete an entry of a directory only when it can prove it wrote
it. The proof is a marker file, ``.TOOL-owner.json``, written when the tool first claims the
directory. Claiming follows one rule (:func:`claim`):

- a missing or empty directory is created and marked;
- a directory that holds the tool's marker is the tool's already;
- a non-empty directory without the marker is adopted (marked) only when every entry in it is one
  the tool recognises as its own (the ``is_ours`` predicate, e.g. "a ``step-N`` directory whose
  manifest is ckpt's"); otherwise :class:`ForeignEntriesError` names the directory and the
  entries that are not the tool's, and nothing is written.

Even inside a marked directory a tool deletes only entries it recognises: the marker says "this is
my directory", not "everything here is mine". A marker is a regular file; a symlink, a directory
or unreadable JSON under the marker's name is refused, never followed.

The claim never writes through a symlink: the root is opened once (``O_NOFOLLOW``, or the
caller's open directory) and the marker is created and renamed relative to that fd
(:mod:`feedpipe.io.dirfd`); a root that no longer is that directory when the marker is about to
be written, or once it is, is refused by name (tests/test_stage_destination.py, the write-path
matrix).

Standard library only (this module is part of ``feedpipe.io``, which ckpt imports).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from feedpipe.io.dirfd import Dir, TempFile, read_regular

__all__ = [
    "ForeignEntriesError",
    "claim",
    "foreign_entries",
    "is_marker_name",
    "marker_name",
    "owner_record",
    "owns",
]

_MARKER = re.compile(r"\.[A-Za-z0-9-]+-owner\.json")
_SHOWN = 10  # foreign entries named in an error; the rest are counted
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_REGULAR = "the ownership marker is not a regular file; refusing it"


class ForeignEntriesError(FileExistsError):
    """A directory holds entries that the tool claiming it did not write."""

    def __init__(self, root: Path, tool: str, entries: list[str]) -> None:
        shown = ", ".join(repr(e) for e in entries[:_SHOWN])
        more = f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else ""
        super().__init__(
            f"{root}: refusing to use this directory for {tool}: it holds "
            f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} that {tool} did not "
            f"write ({shown}{more}); choose an empty directory, or move them away"
        )
        self.root = root
        self.tool = tool
        self.entries = entries


def marker_name(tool: str) -> str:
    """The marker file's name for ``tool``: ``.TOOL-owner.json``."""
    if not tool or not tool.replace("-", "").isalnum():
        raise ValueError(f"tool must be a short alphanumeric name, got {tool!r}")
    return f".{tool}-owner.json"


def is_marker_name(name: str) -> bool:
    """Whether ``name`` has the form of some tool's marker (``.TOOL-owner.json``): a name no
    dataset file may have, so that copying a dataset never writes over a marker."""
    return _MARKER.fullmatch(name) is not None


def owner_record(root: str | os.PathLike[str], tool: str) -> dict[str, Any] | None:
    """The JSON record of ``tool``'s marker in ``root``, or ``None`` if there is none.

    Raises ``ValueError`` naming the path if something else sits under the marker's name (a
    symlink, a directory, bytes that are not a JSON object for this tool)."""
    path = Path(root) / marker_name(tool)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: {_NOT_REGULAR}")
    return _checked(str(path), tool, lambda: _regular_now(path))


def _checked(shown: str, tool: str, read: Callable[[], bytes]) -> dict[str, Any]:
    """The marker record ``read()`` returns, once it is a JSON object for ``tool``."""
    try:
        record = json.loads(read())
    except (OSError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ValueError(f"{shown}: the ownership marker is unreadable: {why}") from None
    if not isinstance(record, dict) or record.get("tool") != tool:
        raise ValueError(f"{shown}: the ownership marker is not {tool}'s")
    return record


def _regular_now(path: Path) -> bytes:
    """The marker's bytes if it still is a regular file (it may have been swapped since it was
    checked), else an ``OSError``."""
    raw = read_regular(path)
    if raw is None:
        raise OSError(f"{path}: no longer a regular file")
    return raw


def owns(root: str | os.PathLike[str], tool: str) -> bool:
    """Whether ``root`` holds ``tool``'s marker (a malformed marker raises, see
    :func:`owner_record`)."""
    return owner_record(root, tool) is not None


def foreign_entries(
    root: str | os.PathLike[str], tool: str, is_ours: Callable[[Path], bool]
) -> list[str]:
    """The sorted names in ``root`` that are neither ``tool``'s marker nor accepted by
    ``is_ours`` (called with each entry's path; it must not follow symlinks out of ``root``)."""
    base = Path(root)
    mark = marker_name(tool)
    with os.scandir(base) as it:
        names = sorted(e.name for e in it)
    return [n for n in names if n != mark and not is_ours(base / n)]


def claim(
    root: str | os.PathLike[str],
    tool: str,
    is_ours: Callable[[Path], bool],
    record: Mapping[str, Any] | None = None,
    *,
    at: Dir | None = None,
) -> bool:
    """Make ``root`` ``tool``'s directory, by the rule in the module docstring.

    Returns ``True`` when the marker was written now (created or adopted), ``False`` when it was
    there already. ``record`` adds fields to a new marker. Raises :class:`ForeignEntriesError`
    (nothing written) when ``root`` holds entries ``is_ours`` does not accept, and
    ``NotADirectoryError`` when ``root`` is not a directory (a symlink to one is accepted only if
    the caller resolved it first).

    The root is opened once (``O_NOFOLLOW``; ``at``: the caller's open :class:`Dir` of it) and
    the marker is created relative to that fd (:mod:`feedpipe.io.dirfd`): a root swapped for a
    symlink meanwhile is never written through, and a root that no longer is the directory
    opened, before or after the write, is a ``NotADirectoryError`` naming it."""
    base = Path(root)
    if at is not None:
        return _claim_in(at, base, tool, is_ours, record)
    with _open_root(base, tool) as where:
        return _claim_in(where, base, tool, is_ours, record)


def _claim_in(
    where: Dir,
    base: Path,
    tool: str,
    is_ours: Callable[[Path], bool],
    record: Mapping[str, Any] | None,
) -> bool:
    """:func:`claim` of the open directory ``where``, which ``base`` names."""
    if _record_in(where, tool) is not None:
        return False
    mark = marker_name(tool)
    foreign = sorted(n for n in os.listdir(where.fd) if n != mark and not is_ours(base / n))
    if foreign:
        raise ForeignEntriesError(base, tool, foreign)
    body = {"tool": tool, "version": 1, "created": time.time(), **dict(record or {})}
    data = json.dumps(body, sort_keys=True).encode() + b"\n"
    _still(where, base, tool)  # is_ours looked by path: that path must still be this directory
    _write_marker(where, mark, data)
    _still(where, base, tool)
    return True


def _write_marker(where: Dir, name: str, data: bytes) -> None:
    """``name`` replaced by ``data`` in ``where`` through a temp there, durably (the file fsynced
    before its rename, the directory after it)."""
    tmp = TempFile.create(where, name, len(data))
    try:
        with os.fdopen(os.dup(tmp.fd), "wb") as f:
            f.write(data)
        tmp.commit()
    finally:
        tmp.discard()
    where.fsync()


def _open_root(base: Path, tool: str) -> Dir:
    """``base`` opened as a directory, never through a symlink (made first when missing)."""
    try:
        fd = _open_dir(base, tool)
    except FileNotFoundError:
        base.mkdir(parents=True, exist_ok=True)
        fd = _open_dir(base, tool)
    return Dir(fd, str(base))


def _open_dir(base: Path, tool: str) -> int:
    try:
        return os.open(base, _ROOT_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise
        what = "a symlink (never followed), " if os.path.islink(base) else ""
        raise NotADirectoryError(
            f"{base}: {what}not a directory; refusing to use it for {tool}"
        ) from None


def _still(where: Dir, base: Path, tool: str) -> None:
    """Refuse, naming ``base``, when it no longer is the directory ``where`` holds open."""
    try:
        now = os.lstat(base)
    except OSError:
        now = None
    held = os.fstat(where.fd)
    if now is None or not stat.S_ISDIR(now.st_mode) or _ident(now) != _ident(held):
        raise NotADirectoryError(
            f"{base}: was replaced while {tool} claimed it (a symlink or another directory now "
            "stands there); nothing was written through it"
        )


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _record_in(where: Dir, tool: str) -> dict[str, Any] | None:
    """:func:`owner_record` of the open directory ``where`` (never through a symlink)."""
    name = marker_name(tool)
    st = where.stat(name)
    if st is None:
        return None
    raw = where.read(name) if stat.S_ISREG(st.st_mode) else None
    if raw is None:  # not a regular file (or no longer one)
        raise ValueError(f"{where.entry(name)}: {_NOT_REGULAR}")
    return _checked(where.entry(name), tool, lambda: raw)
