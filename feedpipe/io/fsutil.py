"""Local file helpers shared by feedpipe's writers and readers and ckpt: directory fsync, atomic
replace, and positioned reads of exactly ``n`` bytes (:func:`read_exactly`,
:func:`readinto_exactly`: a short read goes on; only the end of the file stops it, and the
caller names the error).

One durability rule for both packages (docs/architecture.md, "Durability"): a file is durable
once its own ``fsync`` and then an ``fsync`` of its directory have returned. :func:`fsync_dir`
raises every error except the one a filesystem gives when it cannot sync a directory at all
(``EINVAL``, ``ENOTSUP``/``EOPNOTSUPP``): there a rename is as durable as the filesystem makes
it, and refusing to write would help nobody. A directory that cannot be opened (missing, not a
directory, no permission) always raises.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from typing import Any

from feedpipe.io.remote import temp_name

__all__ = ["atomic_write", "fsync_dir", "read_exactly", "readinto_exactly"]

# fsync(2) on a directory fd: "EINVAL: fd is bound to a special file which does not support
# synchronization" (some FUSE, CIFS and 9p mounts); ENOTSUP/EOPNOTSUPP on others.
_CANNOT_SYNC_DIRS = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a directory so that a rename or create inside it is durable.

    ``""`` is the current directory (``os.path.dirname`` of a bare file name). The directory may
    be reached through a symlink (fsync writes nothing). Raises ``OSError`` when the directory
    cannot be opened or synced, except on a filesystem that cannot sync directories at all
    (module docstring).
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(os.fspath(path) or ".", flags)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT_SYNC_DIRS:
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` through a :func:`~feedpipe.io.remote.temp_name` file.

    A reader sees the old content or the new, never a torn file; a failure removes the temp.
    ``durable`` (default): the temp is fsynced before the rename and the directory after it, so
    the new content survives a power loss once this returns. ``durable=False`` skips both fsyncs
    (scratch files that a crash makes worthless anyway).
    """
    target = os.fspath(path)
    tmp = temp_name(target, len(data))
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(target))


def read_exactly(fd: int, nbytes: int, offset: int) -> bytes:
    """``nbytes`` bytes of ``fd`` from ``offset`` (``pread``, going on after a short read); fewer
    only when the file ends first (the caller says what that means)."""
    data = os.pread(fd, nbytes, offset)
    while len(data) < nbytes:
        more = os.pread(fd, nbytes - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def readinto_exactly(fd: int, buffers: Sequence[Any], offset: int, nbytes: int) -> int:
    """Fill ``buffers`` (``nbytes`` bytes in all) from ``fd`` at ``offset`` (``preadv``, going on
    after a short read); returns the bytes read, fewer than ``nbytes`` only at the end of the
    file."""
    if not nbytes:
        return 0
    got = os.preadv(fd, buffers, offset)
    while 0 < got < nbytes:
        n = os.preadv(fd, _after(buffers, got), offset + got)
        if n == 0:
            break
        got += n
    return got


def _after(buffers: Sequence[Any], skip: int) -> list[memoryview]:
    """The parts of ``buffers`` after their first ``skip`` bytes."""
    out: list[memoryview] = []
    for buf in buffers:
        view = memoryview(buf).cast("B")
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out
