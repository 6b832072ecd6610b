"""``flock`` waits of the shard cache: bounded, cancellable, and given up once moot."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable

__all__ = ["POLL_S", "WaitCancelledError", "flock_wait", "open_lock", "try_exclusive"]

POLL_S = 0.01  # the first pause between two tries; it grows to 0.2 s


class WaitCancelledError(Exception):
    """A background prefetch stopped because its cache was closed or the interpreter exits."""


def open_lock(lock_path: str) -> int:
    """Open (creating) a lock file; returns its fd."""
    return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)


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


def try_exclusive(lock_path: str) -> int | None:
    """Open ``lock_path`` and take an exclusive lock without waiting; return the fd or None."""
    try:
        fd = open_lock(lock_path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
