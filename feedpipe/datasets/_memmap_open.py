"""This process's open shard data files of a :class:`~feedpipe.MemmapDataset`, in LRU order.

A shard is *in use* while a read is inside :meth:`OpenShards.use`; in-use shards are never
closed. Between reads a shard stays open (fd, read-only map and, for a cached remote dataset,
its cache lease) as long as the idle open shards fit ``idle_bytes``; beyond that the least
recently used idle shard is closed and its lease released, so a bounded cache can evict it.
:meth:`OpenShards.release_idle` closes every idle shard at once (a download waiting for room).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["OpenShard", "OpenShards"]

Opener = Callable[[int], tuple[int, Callable[[], None]]]


class OpenShard:
    """One open shard data file: its fd, its map (made on first use) and how to end its lease."""

    __slots__ = ("fd", "locked", "mm", "nbytes", "release", "rows", "sid", "unlock", "users")

    def __init__(self, sid: int, fd: int, nbytes: int, release: Callable[[], None]) -> None:
        self.sid, self.fd, self.nbytes, self.release = sid, fd, nbytes, release
        self.mm: mmap.mmap | None = None
        self.rows: np.ndarray | None = None
        self.users = 0
        self.locked: Any = None  # the map registered with CUDA (feedpipe.device.dma)
        self.unlock: Any = None  # its feedpipe.device.hostreg.Registration

    def close(self, owner: bool = True) -> None:
        """Close the file; ``owner`` (this process opened it) also ends the CUDA registration
        and the cache lease, which a forked child leaves to its parent. The map is unmapped only
        once it is unregistered (its registration holds it mapped until then)."""
        self.rows = None  # first: feedpipe.device.dma registers no map of a closing shard
        try:
            dma = sys.modules.get("feedpipe.device.dma")  # not imported: nothing was registered
            if dma is not None and owner:  # not in a forked child: CUDA is the parent's
                dma.unlock(self)  # under the lock register takes: none in flight is missed
        finally:
            self.locked = None
            if self.mm is not None:
                try:
                    self.mm.close()
                except BufferError:  # a view (or a registration) holds it: unmapped when it goes
                    pass
                self.mm = None
            try:
                os.close(self.fd)
            except OSError:
                pass
            if owner:
                self.release()


class OpenShards:
    """LRU of open shards (see the module docstring); thread-safe; one per process.

    ``opener(sid)`` opens (and leases) a shard's data file and returns ``(fd, release)``;
    ``sizes[sid]`` is its size in bytes; ``idle_bytes=None`` keeps every shard open.
    """

    def __init__(self, opener: Opener, sizes: list[int], idle_bytes: int | None) -> None:
        self.pid = os.getpid()
        self._opener, self._sizes, self._idle_bytes = opener, sizes, idle_bytes
        self._lock = threading.Lock()
        self._open: OrderedDict[int, OpenShard] = OrderedDict()

    @contextmanager
    def use(self, sid: int) -> Iterator[OpenShard]:
        """Open shard ``sid`` (or reuse it) and keep it open and pinned inside the block."""
        shard = self._get(sid)
        try:
            yield shard
        finally:
            with self._lock:
                shard.users -= 1
                closing = self._trim()
            for s in closing:
                s.close()

    def is_open(self, sid: int) -> bool:
        return sid in self._open

    def rows(self, shard: OpenShard, record_bytes: int) -> np.ndarray:
        """The shard mapped read-only: ``(records, record_bytes)`` uint8, or flat when 0."""
        rows = shard.rows
        if rows is None:
            with self._lock:
                if shard.rows is None:
                    if shard.nbytes == 0:
                        flat = np.empty(0, np.uint8)
                    else:
                        shard.mm = mmap.mmap(shard.fd, shard.nbytes, prot=mmap.PROT_READ)
                        flat = np.frombuffer(shard.mm, dtype=np.uint8)
                    shard.rows = flat.reshape(-1, record_bytes) if record_bytes else flat
                rows = shard.rows
        return rows

    def release_idle(self) -> None:
        """Close every shard not in use now and end its lease."""
        with self._lock:
            idle = [s for s in self._open.values() if s.users == 0]
            for s in idle:
                del self._open[s.sid]
        for s in idle:
            s.close()

    def close(self) -> None:
        """Close everything (in this process; after a fork the parent's leases are left alone)."""
        mine = self.pid == os.getpid()
        with self._lock:
            shards, self._open = list(self._open.values()), OrderedDict()
        for s in shards:
            s.close(owner=mine)

    def _get(self, sid: int) -> OpenShard:
        with self._lock:
            shard = self._open.get(sid)
            if shard is not None:
                shard.users += 1
                self._open.move_to_end(sid)
                return shard
        fd, release = self._opener(sid)  # may download: outside the lock
        fresh = OpenShard(sid, fd, self._sizes[sid], release)
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

    def _trim(self) -> list[OpenShard]:
        """Remove LRU idle shards until the idle ones fit the budget (call under the lock)."""
        if self._idle_bytes is None:
            return []
        idle = [s for s in self._open.values() if s.users == 0]  # LRU first
        total = sum(s.nbytes for s in idle)
        out = []
        for s in idle:
            if total <= self._idle_bytes:
                break
            del self._open[s.sid]
            total -= s.nbytes
            out.append(s)
        return out
