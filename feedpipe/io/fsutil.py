"""Local file helpers shared by feedpipe's writers: directory fsync and atomic replace."""

from __future__ import annotations

import contextlib
import os

from feedpipe.io.remote import temp_name

__all__ = ["atomic_write", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str], *, best_effort: bool = False) -> None:
    """``fsync`` a directory so that a rename or create inside it is durable.

    With ``best_effort``, a platform or filesystem that cannot open or sync a directory is
    ignored; otherwise its ``OSError`` propagates.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if best_effort:  # pragma: no cover - platforms without directory fds
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not best_effort:  # pragma: no cover
            raise
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a :func:`~feedpipe.io.remote.temp_name` file.

    The temp is written, fsynced and renamed over ``path`` (a failure removes it), then the
    directory is fsynced: a reader sees the old content or the new, never a torn file.
    """
    tmp = temp_name(path, len(data))
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))
