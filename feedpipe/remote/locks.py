"""``flock`` waits of the shard cache: bounded, cancellable, and given up once moot."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable

from feedpipe.io.dirfd import Dir

__all__ = [
    "POLL_S",
    "WaitCancelledError",
    "flock_wait",
    "lock_at",
    "open_lock",
    "try_exclusive_at",
]

POLL_S = 0.01  # the first pause between two tries; it grows to 0.2 s


class WaitCancelledError(Exception):
    """A background prefetch stopped because its cache was closed or the interpreter exits."""


def open_lock(lock_path: str) -> int:
    """Open (creating) a lock file, never through a symlink; returns its fd."""
    return os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def lock_at(where: Dir, name: str) -> int:
    """Open (creating) the lock file ``name`` in the open directory ``where`` (never through a
    symlink, :mod:`feedpipe.io.dirfd`); returns its fd."""
    return where.open(name, os.O_RDWR | os.O_CREAT)


def flock_wait(
    fd: int,
    op: int,
    timeout_s: float,
    what: str,
    *,
    cancel: threading.Event | None = None,
    moot: Callable[[], bool] | None = None,
) -> bool:
    """``flock`` with a timeout (polls without blocking); :class:`TimeoutError` names ``what``.

    Returns True once locked. With ``cancel``, the wait stops (:class:`WaitCancelledError`) as
    soon as the event is set; with ``moot``, it stops (returning False) once ``moot()`` is true.
    """
    deadline = time.monotonic() + timeout_s
    pause = POLL_S
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
        if moot is not None and moot():
            return False
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for the lock on {what}")
        if cancel is None:
            time.sleep(pause)
        elif cancel.wait(pause):
            raise WaitCancelledError(what)
        pause = min(pause * 1.5, 0.2)


def try_exclusive_at(where: Dir, name: str) -> int | None:
    """Open the lock file ``name`` in the open directory ``where`` (:func:`lock_at`) and take an
    exclusive lock without waiting; return the fd or None."""
    try:
        fd = lock_at(where, name)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
