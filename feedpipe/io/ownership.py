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

Standard library only (this module is part of ``feedpipe.io``, which ckpt imports).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from feedpipe.io.fsutil import atomic_write

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
        raise ValueError(f"{path}: the ownership marker is not a regular file; refusing it")
    try:
        record = json.loads(_regular_bytes(path))
    except (OSError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ValueError(f"{path}: the ownership marker is unreadable: {why}") from None
    if not isinstance(record, dict) or record.get("tool") != tool:
        raise ValueError(f"{path}: the ownership marker is not {tool}'s")
    return record


def _regular_bytes(path: Path) -> bytes:
    """The bytes of ``path`` if it still is a regular file (it may have been swapped since it
    was checked): never through a link, never waiting on a FIFO; else an ``OSError``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: no longer a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


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
) -> bool:
    """Make ``root`` ``tool``'s directory, by the rule in the module docstring.

    Returns ``True`` when the marker was written now (created or adopted), ``False`` when it was
    there already. ``record`` adds fields to a new marker. Raises :class:`ForeignEntriesError`
    (nothing written) when ``root`` holds entries ``is_ours`` does not accept, and
    ``NotADirectoryError`` when ``root`` is not a directory (a symlink to one is accepted only if
    the caller resolved it first)."""
    base = Path(root)
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        base.mkdir(parents=True, exist_ok=True)
        st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{base}: not a directory; refusing to use it for {tool}")
    if owner_record(base, tool) is not None:
        return False
    foreign = foreign_entries(base, tool, is_ours)
    if foreign:
        raise ForeignEntriesError(base, tool, foreign)
    body = {"tool": tool, "version": 1, "created": time.time(), **dict(record or {})}
    atomic_write(base / marker_name(tool), json.dumps(body, sort_keys=True).encode() + b"\n")
    return True
