"""Which names a manifest may give its files, and how those files are opened: never through a
symlink, never a FIFO, a device or a directory, never outside the checkpoint directory."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

from ckpt.errors import CheckpointError, CorruptCheckpointError

__all__ = ["inside", "open_data", "open_regular", "safe_relpath"]

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def safe_relpath(name: Any) -> str:
    """Return ``name`` if it is a relative path of plain components (no ``..``, not absolute)."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest")
    if not all(_NAME.match(part) for part in name.split("/")):
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest")
    return name


def inside(directory: Path, name: str) -> Path:
    """``directory/name``, refusing a symlink at any component of ``name`` (never followed out of
    the checkpoint directory); the last component is opened with ``O_NOFOLLOW`` as well."""
    path = directory
    for part in safe_relpath(name).split("/"):
        path = path / part
        if path.is_symlink():
            raise CorruptCheckpointError(f"{path}: data file is a symlink")
    return path


def open_regular(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o644,
    error: type[CheckpointError] = CorruptCheckpointError,
) -> int:
    """``os.open`` of a regular file only: never through a symlink (``ELOOP``), and a FIFO,
    device or directory is an ``error`` naming ``path`` (opened ``O_NONBLOCK``, so a FIFO never
    blocks the open; the flag changes nothing for regular files)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except IsADirectoryError:
        raise error(f"{path}: not a regular file (a directory)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        kind = stat.filemode(os.fstat(fd).st_mode)
        os.close(fd)
        raise error(f"{path}: not a regular file ({kind})")
    return fd


def open_data(path: Path) -> int:
    """Open a data file for reading (``open_regular``); a missing file or a symlink is a
    ``CorruptCheckpointError`` naming it."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # never read through a symlink out of the checkpoint
            raise CorruptCheckpointError(f"{path}: data file is a symlink") from None
        raise
