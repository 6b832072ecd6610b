"""The leases one shard cache holds: an fd with a shared ``flock`` per :meth:`acquire`."""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["Leases"]


class Leases:
    """Per relative path, the fds whose shared locks keep the file from eviction (this process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, list[int]] = {}

    def add(self, relpath: str, fd: int) -> None:
        with self._lock:
            self._fds.setdefault(relpath, []).append(fd)

    def pop(self, relpath: str) -> int:
        """One lease's fd (the caller closes it); ValueError when ``relpath`` is not leased."""
        with self._lock:
            fds = self._fds.get(relpath)
            if not fds:
                raise ValueError(f"{relpath!r} is not acquired")
            fd = fds.pop()
            if not fds:
                del self._fds[relpath]
            return fd

    def holds(self, relpath: str) -> bool:
        with self._lock:
            return relpath in self._fds

    def files(self) -> list[str]:
        with self._lock:
            return sorted(self._fds)

    def end_all(self) -> None:
        """Close every lease's fd (closing the only fd of an open file drops its lock)."""
        with self._lock:
            leases, self._fds = self._fds, {}
        for fds in leases.values():
            for fd in fds:
                os.close(fd)

    def forget(self) -> None:
        """After a fork: close the parent's fds here (its own fds keep its locks)."""
        for fds in self._fds.values():
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds = {}
