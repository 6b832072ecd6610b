"""This process's open shard files of a :class:`~feedpipe.MemmapDataset`.

:class:`ShardFiles` is what the dataset reads through: one :class:`OpenShards` per file role,
the one-range map of a local fixed-record dataset (:class:`~._gather.ShardSpace`), where a
record is (:meth:`ShardFiles.locate`) and in which order to read a batch's shards
(:meth:`ShardFiles.order`: remote shards fetched ahead when they fit the cache). Its files come
from the dataset's :class:`~._memmap_files.ShardSource`; it is rebuilt in a forked child and
dropped when pickled (a worker opens its own).

:class:`OpenShards` keeps one role's open files in LRU order.

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
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from feedpipe.datasets._filemap import close_fd, map_file
from feedpipe.datasets._gather import ShardSpace, map_budget
from feedpipe.datasets._memmap_files import ShardSource
from feedpipe.datasets._shard_guard import ShardGuard
from feedpipe.errors import DatasetError
from feedpipe.io.forks import ForkLock, ForkStamp

__all__ = ["OpenShard", "OpenShards", "ShardFiles", "WatchedFiles"]

Opener = Callable[[int], tuple[int, Callable[[], None]]]
_PREAD_IDLE = 64  # descriptors kept open per role by read="pread" (the rest closed, LRU)


class OpenShard:
    """One open shard data file: its fd, its map (made on first use) and how to end its lease."""

    __slots__ = (
        "address",
        "fd",
        "locked",
        "nbytes",
        "release",
        "rows",
        "sid",
        "unlock",
        "users",
    )

    def __init__(self, sid: int, fd: int, nbytes: int, release: Callable[[], None]) -> None:
        self.sid, self.fd, self.nbytes, self.release = sid, fd, nbytes, release
        self.rows: np.ndarray | None = None
        self.address = 0  #: where the map starts (once :meth:`OpenShards.rows` made it)
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
            self.fd = close_fd(self.fd)
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
        shard, _drained = self.pin(sid)
        try:
            yield shard
        finally:
            self.unpin(shard)

    def pin(self, sid: int, drained: bool = False) -> tuple[OpenShard, bool]:
        """:meth:`use` without a block: shard ``sid`` open, checked by the guard and pinned
        until :meth:`unpin` (unpinned again if the check fails). ``drained`` and the second
        result: as :meth:`ShardGuard.check`'s (several members' shards of one batch drain the
        process's watcher once)."""
        shard = self._get(sid)
        try:
            if self._guard is not None:
                with self._lock:
                    drained = self._guard.check((sid,), drained)
        except BaseException:
            self.unpin(shard)
            raise
        return shard, drained

    def unpin(self, shard: OpenShard) -> None:
        """The read :meth:`pin` began is over (the shard may be closed now, LRU)."""
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
                    shard.rows = self._map(shard)
                    shard.address = int(shard.rows.ctypes.data)
                if record_bytes and shard.rows.ndim == 1:  # kept: dma registers this very array
                    shard.rows = shard.rows.reshape(-1, record_bytes)
                rows = shard.rows
        return rows if record_bytes or rows.ndim == 1 else rows.reshape(-1)

    def _map(self, shard: OpenShard) -> np.ndarray:
        """Map ``shard`` (holds no descriptor); one :meth:`close` closed meanwhile (a reader
        racing the dataset's close) is a :class:`DatasetError`, never an ``OSError``."""
        fd = shard.fd
        try:
            if fd < 0:
                raise OSError(9, "closed")
            return map_file(fd, shard.nbytes)
        except OSError as exc:
            if shard.fd >= 0 and fd >= 0:
                raise
            path = self._guard.table.paths[shard.sid] if self._guard else f"shard {shard.sid}"
            raise DatasetError(
                f"{path}: shard {shard.sid} file was closed while being read (the dataset was "
                "closed meanwhile); read again"
            ) from exc

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
        # a forked child's copy, which no thread here reads, skips the lock: it may have been
        # held at the fork
        with self._lock if mine else nullcontext():
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


class WatchedFiles:
    """One role's files read whole once and kept in memory (side fields, offsets): the same
    rule as every mapped file (:mod:`~._shard_guard`). Each file is opened once per process,
    checked at open (``guard.admit``/``guard.opened``: indexed size, stamp or CRC32C) and
    watched from then on; :meth:`check`, before every use of what was read, raises a
    :class:`~feedpipe.errors.DatasetError` naming the file if one changed since (a rewrite in
    place, a truncation). The file is not kept open (the watch is on the file itself)."""

    def __init__(self, opener: Opener, guard: ShardGuard, count: int) -> None:
        self.pid = os.getpid()
        self._opener, self._guard = opener, guard
        self._lock = threading.Lock()
        self._watched = np.zeros(count, bool)
        self._every = np.arange(count, dtype=np.intp)
        self._all = count == 0  # every file watched: check(None) does no per-shard work

    def check(self, sids: list[int] | None = None) -> None:
        """Raise if a file of ``sids`` (None: every shard) changed since it was read; a file
        not watched yet in this process is opened, checked and watched first."""
        if sids is None:
            if not self._all:
                for s in np.flatnonzero(~self._watched).tolist():
                    self._watch(s)
                self._all = True
            sids_arr: np.ndarray | list[int] = self._every
        else:
            for s in sids:
                if not self._watched[s]:
                    self._watch(s)
            sids_arr = sids
        with self._lock:
            self._guard.check(sids_arr)

    def _watch(self, sid: int) -> None:
        fd, release = self._opener(sid)
        try:
            admitted = self._guard.admit(sid, fd)  # outside the lock: may verify
            with self._lock:
                if not self._watched[sid]:
                    self._guard.opened(sid, fd, admitted)
                    self._watched[sid] = True
        finally:
            os.close(fd)
            release()

    def close(self) -> None:
        """Stop watching (a forked child's copy only forgets)."""
        with self._lock:
            self._guard.forget()
            self._watched[:] = False
            self._all = len(self._watched) == 0


class ShardFiles:
    """This process's open files of one dataset (see the module docstring); thread-safe."""

    def __init__(
        self, source: ShardSource, *, kind: str, read: str, starts: np.ndarray, record_bytes: int
    ) -> None:
        self.source = source
        self.kind, self.read, self.starts, self.record_bytes = kind, read, starts, record_bytes
        #: False: fixed records are read shard by shard even where one range could be mapped
        self.one_range = True
        # first reads may come from several threads at once; a child forked while another
        # thread held it finds it free
        self._mutex = ForkLock()
        #: made by the process the open files below belong to (None: none opened yet); a
        #: :class:`ForkStamp` tells a forked child without a system call per batch
        self._born: ForkStamp | None = None
        self._roles: dict[str, OpenShards] = {}
        self._whole: dict[str, WatchedFiles] = {}  # files read whole, by role
        self._space: ShardSpace | bool | None = None  # False: this dataset reads per shard

    # ------------------------------------------------------------------ where a record is
    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, record within it)`` of each global index."""
        if len(self.starts) == 2:  # one shard
            return np.zeros(len(idx), np.int64), idx
        sid = np.searchsorted(self.starts, idx, side="right") - 1
        return sid, idx - self.starts[sid]

    def order(self, shards: list[int]) -> list[int]:
        """The order to read a batch's ``shards`` in; fetches remote ones ahead when they fit."""
        source = self.source
        if not source.remote:
            return shards
        cache = source.cache()
        if cache.pressure_changed():  # a download somewhere waits for room: end idle leases
            self.release_idle()
        if len(shards) < 2:
            return shards
        limit = source.cache_limit_bytes
        rels = [rel for s in shards for rel in cache.shard_files(s)]
        need = sum(info.bytes for s in shards for info in source.index.shards[s].files.values())
        if limit is None or need <= limit // 2:
            cache.fetch(rels, on_wait=self.release_idle)  # in parallel, not one by one
            return shards
        # more than fits: read the open shards first, then the cached ones, fetch the rest last
        files = self.files()

        def rank(s: int) -> int:
            if files.is_open(s):
                return 0
            return 1 if os.path.exists(source.local_path(s, "data")) else 2

        return sorted(shards, key=rank)

    # ------------------------------------------------------------------ open files
    def files(self, role: str = "data") -> OpenShards:
        """This process's open files of ``role`` (``data``, or a variable-length field's)."""
        born = self._born
        if born is not None and born.here():
            files = self._roles.get(role)
            if files is not None:
                return files
        with self._mutex.lock:
            self._own()
            files = self._roles.get(role)
            if files is None:
                files = self._roles[role] = self._opener(role)
        return files

    def _own(self) -> None:
        """Under the lock: the open files are this process's from here. In a child forked since
        they were opened (or in a copy that opened none), none: the parent's are not its own."""
        born = self._born
        if born is None or not born.here():
            self._born, self._roles, self._whole = ForkStamp(), {}, {}

    def _opener(self, role: str) -> OpenShards:
        source = self.source
        shards = source.index.shards
        sizes = [s.files[role].bytes if role in s.files else 0 for s in shards]
        limit = source.cache_limit_bytes if source.remote else None
        pread = role == "data" and self.kind == "fixed" and self.read == "pread"
        has = bool(shards) and role in shards[0].files  # no data files: records=False
        release_idle = self.release_idle
        return OpenShards(
            lambda sid: source.open(sid, role, release_idle),
            sizes,
            None if limit is None else limit // 3,
            guard=ShardGuard(source.table(role)) if has else None,
            mapped=not pread,
            idle_count=_PREAD_IDLE if pread else max(64, map_budget() // 8),
        )

    def check_whole(self, role: str, sids: list[int] | None = None) -> None:
        """Raise a :class:`~feedpipe.errors.DatasetError` naming the file if a ``role`` file of
        shards ``sids`` (None: every shard), read whole and kept (side fields, offsets),
        changed since it was read (:class:`WatchedFiles`); call before every use. Remote
        datasets' cache files are checked when read only (the cache verifies them)."""
        if self.source.remote:
            return
        born = self._born
        whole = self._whole.get(role) if born is not None and born.here() else None
        if whole is None:
            with self._mutex.lock:
                self._own()
                whole = self._whole.get(role)
                if whole is None:
                    source = self.source
                    whole = self._whole[role] = WatchedFiles(
                        lambda sid: source.open(sid, role),
                        ShardGuard(source.table(role)),
                        len(source.index.shards),
                    )
        whole.check(sids)

    def rows(self, shard: OpenShard) -> np.ndarray:
        """A record shard's data mapped read-only: ``(records, record_bytes)`` uint8 (fixed)."""
        rb = self.record_bytes if self.kind == "fixed" else 0
        return self.files().rows(shard, rb)

    @contextmanager
    def mapped(self, role: str, sid: int) -> Iterator[np.ndarray]:
        """Shard ``sid``'s ``role`` file mapped read-only (flat uint8), open inside the block."""
        files = self.files(role)
        with files.use(sid) as shard:  # checked before every use (_shard_guard)
            yield files.rows(shard, 0)

    def space(self) -> ShardSpace | None:
        """This process's one-range map of every shard (:mod:`feedpipe.datasets._gather`), or
        ``None`` where batches are read shard by shard (remote, ``read="pread"``, not fixed
        records, more shards than the map budget)."""
        space = self._space
        if isinstance(space, ShardSpace) and space.here():  # no system call per batch
            return space
        if space is False or not self.one_range:
            return None
        with self._mutex.lock:
            space = self._space
            if isinstance(space, ShardSpace) and not space.here():
                space.forget()  # a forked child: the parent's maps, no other thread here
                space = None
            if space is None:
                if not self.source.remote and self.kind == "fixed" and self.read != "pread":
                    guard = ShardGuard(self.source.table("data"))
                    space = ShardSpace.create(guard, self.starts, self.record_bytes)
                self._space = space if space is not None else False
        return space if isinstance(space, ShardSpace) else None

    def release_idle(self) -> None:
        """End the idle shards' leases (a download waits for room in the cache)."""
        born = self._born
        if born is not None and born.here():
            for files in list(self._roles.values()):
                files.release_idle()

    # ------------------------------------------------------------------ lifetime
    def close(self, wait: bool) -> None:
        """Close every open file and map (``wait``: for a gather still running, a while)."""
        space, self._space = self._space, None
        if isinstance(space, ShardSpace):
            if space.pid == os.getpid():
                space.close(timeout=60.0 if wait else 0.0)
            else:
                space.forget()
        roles, self._roles = self._roles, {}
        for files in roles.values():
            files.close()
        whole, self._whole = self._whole, {}
        for w in whole.values():
            if w.pid == os.getpid():
                w.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_mutex=None, _born=None, _roles={}, _space=None, _whole={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mutex = ForkLock()
