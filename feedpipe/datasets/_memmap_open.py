"""This process's open shard data files of a :class:`~feedpipe.MemmapDataset`, in LRU order.

A shard is *in use* while a read is inside :meth:`OpenShards.use`; in-use shards are never
closed. Between reads a shard stays open (fd, read-only map and, for a cached remote dataset,
its cache lease) as long as the idle open shards fit ``idle_bytes``; beyond that the least
recently used idle shard is closed and its lease released, so a bounded cache can evict it;
``idle_count`` bounds their number too. :meth:`OpenShards.release_idle` closes every idle shard
at once (a download waiting for room).

Every shard opened is checked by the dataset's :class:`~feedpipe.datasets._shard_guard.ShardGuard`
(``guard.opened``) and re-checked before every use (``guard.check``): the one integrity rule of
every layout. With ``mapped=True`` a shard is mapped as soon as it is opened and its descriptor
closed (the map keeps the file), so open descriptors do not grow with the number of shards;
reads then copy from the map (``mapped=False`` keeps the descriptor, for ``os.preadv``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from feedpipe.datasets._filemap import map_file
from feedpipe.datasets._shard_guard import ShardGuard

__all__ = ["OpenShard", "OpenShards"]

Opener = Callable[[int], tuple[int, Callable[[], None]]]


class OpenShard:
    """One open shard data file: its fd, its map (made on first use) and how to end its lease."""

    __slots__ = ("fd", "locked", "nbytes", "release", "rows", "sid", "unlock", "users")

    def __init__(self, sid: int, fd: int, nbytes: int, release: Callable[[], None]) -> None:
        self.sid, self.fd, self.nbytes, self.release = sid, fd, nbytes, release
        self.rows: np.ndarray | None = None
        self.users = 0
        self.locked: Any = None  # the map registered with CUDA (feedpipe.device.dma)
        self.unlock: Any = None  # its feedpipe.device.hostreg.Registration

    def close(self, owner: bool = True) -> None:
        """Close the file; ``owner`` (this process opened it) also ends the CUDA registration
        and the cache lease, which a forked child leaves to its parent. The map is unmapped only
        once it is unregistered and its last view is gone (the registration holds the array,
        whose base is the map: :func:`~feedpipe.datasets._filemap.map_file`)."""
        self.rows = None  # first: feedpipe.device.dma registers no map of a closing shard
        try:
            dma = sys.modules.get("feedpipe.device.dma")  # not imported: nothing was registered
            if dma is not None and owner:  # not in a forked child: CUDA is the parent's
                dma.unlock(self)  # under the lock register takes: none in flight is missed
        finally:
            self.locked = None
            if self.fd >= 0:
                try:
                    os.close(self.fd)
                except OSError:
                    pass
                self.fd = -1
            if owner:
                self.release()


class OpenShards:
    """LRU of open shards (see the module docstring); thread-safe; one per process.

    ``opener(sid)`` opens (and leases) a shard's data file and returns ``(fd, release)``;
    ``sizes[sid]`` is its size in bytes; ``idle_bytes=None`` keeps every shard open (up to
    ``idle_count`` idle ones); ``guard`` checks each shard opened and before each use;
    ``mapped`` maps a shard when it is opened and closes its descriptor.
    """

    def __init__(
        self,
        opener: Opener,
        sizes: list[int],
        idle_bytes: int | None,
        *,
        guard: ShardGuard | None = None,
        mapped: bool = False,
        idle_count: int | None = None,
    ) -> None:
        self.pid = os.getpid()
        self._opener, self._sizes, self._idle_bytes = opener, sizes, idle_bytes
        self._guard, self._mapped, self._idle_count = guard, mapped, idle_count
        self._lock = threading.Lock()
        self._open: OrderedDict[int, OpenShard] = OrderedDict()

    @contextmanager
    def use(self, sid: int) -> Iterator[OpenShard]:
        """Open shard ``sid`` (or reuse it), checked, and keep it open and pinned inside the
        block."""
        shard = self._get(sid)
        try:
            if self._guard is not None:
                with self._lock:
                    self._guard.check((sid,))
            yield shard
        finally:
            with self._lock:
                shard.users -= 1
                closing = self._trim()
            self._close_all(closing)

    def _close_all(self, shards: list[OpenShard], owner: bool = True) -> None:
        for s in shards:
            s.close(owner=owner)
            if self._guard is not None and owner:
                with self._lock:
                    self._guard.closed(s.sid)

    def is_open(self, sid: int) -> bool:
        return sid in self._open

    def rows(self, shard: OpenShard, record_bytes: int) -> np.ndarray:
        """The shard mapped read-only: ``(records, record_bytes)`` uint8, or flat when 0."""
        rows = shard.rows
        if rows is None or (record_bytes and rows.ndim == 1):
            with self._lock:
                if shard.rows is None:
                    shard.rows = map_file(shard.fd, shard.nbytes)  # holds no descriptor
                if record_bytes and shard.rows.ndim == 1:  # kept: dma registers this very array
                    shard.rows = shard.rows.reshape(-1, record_bytes)
                rows = shard.rows
        return rows if record_bytes or rows.ndim == 1 else rows.reshape(-1)

    def release_idle(self) -> None:
        """Close every shard not in use now and end its lease."""
        with self._lock:
            idle = [s for s in self._open.values() if s.users == 0]
            for s in idle:
                del self._open[s.sid]
        self._close_all(idle)

    def close(self) -> None:
        """Close everything (in this process; after a fork the parent's leases are left alone)."""
        mine = self.pid == os.getpid()
        with self._lock:
            shards, self._open = list(self._open.values()), OrderedDict()
        self._close_all(shards, owner=mine)

    def _get(self, sid: int) -> OpenShard:
        with self._lock:
            shard = self._open.get(sid)
            if shard is not None:
                shard.users += 1
                self._open.move_to_end(sid)
                return shard
        fresh = self._open_one(sid)  # may download and verify: outside the lock
        with self._lock:
            shard = self._open.get(sid)
            if shard is None:  # no other thread opened it meanwhile
                shard = self._open[sid] = fresh
                fresh = None  # type: ignore[assignment]
            shard.users += 1
            self._open.move_to_end(sid)
        if fresh is not None:
            fresh.close()
        return shard

    def _open_one(self, sid: int) -> OpenShard:
        """Open shard ``sid``, check it (``guard.opened``) and, ``mapped``, map it and close
        its descriptor."""
        fd, release = self._opener(sid)
        shard = OpenShard(sid, fd, self._sizes[sid], release)
        try:
            if self._guard is not None:
                admitted = self._guard.admit(sid, fd)  # outside the lock: may verify
                with self._lock:
                    self._guard.opened(sid, fd, admitted)
            if self._mapped:
                self.rows(shard, 0)
                os.close(fd)
                shard.fd = -1
        except BaseException:
            shard.close()
            if self._guard is not None:
                with self._lock:
                    self._guard.closed(sid)
            raise
        return shard

    def _trim(self) -> list[OpenShard]:
        """Remove LRU idle shards until the idle ones fit the budget (call under the lock)."""
        if self._idle_bytes is None and (
            self._idle_count is None or len(self._open) <= self._idle_count
        ):
            return []
        idle = [s for s in self._open.values() if s.users == 0]  # LRU first
        total = sum(s.nbytes for s in idle)
        count = len(idle)
        most_bytes = total if self._idle_bytes is None else self._idle_bytes
        most = count if self._idle_count is None else self._idle_count
        out = []
        for s in idle:
            if total <= most_bytes and count <= most:
                break
            del self._open[s.sid]
            total -= s.nbytes
            count -= 1
            out.append(s)
        return out
