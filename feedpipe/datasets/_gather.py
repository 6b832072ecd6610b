"""Gathers for the datasets' batched reads: every shard of a fixed-record dataset mapped into one
reserved address range (:class:`ShardSpace`), and the scratch buffer and inverse permutation of
the shard-by-shard path (shared by ``MemmapDataset`` and ``ZarrDataset``).

A batch touching many shards is then one ``np.take`` over one ``(rows, record_bytes)`` view,
whatever the number of shards it touches: the per-batch work is vectorised and O(records).

Layout. One ``PROT_NONE`` reservation (anonymous, ``MAP_NORESERVE``: address space only) holds
the shards side by side. Shard ``s`` is mapped with ``MAP_FIXED`` at byte ``V[s]`` of it, where
``V[s]`` is a multiple of ``lcm(record_bytes, page)``: page-aligned (as ``mmap`` needs) and a
whole number of rows from the start, so record ``i`` of shard ``s`` is row
``V[s] / record_bytes + i`` of the view. Global index ``g`` is row ``g + delta[sid(g)]``, with
``sid`` from ``np.searchsorted`` on the cumulative record counts. Gaps between shards stay
``PROT_NONE`` and are never addressed.

Opening. A shard is mapped on the first batch that touches it; its file descriptor is closed
right after (the map keeps the file), so open descriptors do not grow with the number of
shards. Each mapped shard costs up to two kernel map areas (``vm.max_map_count``); a dataset
with more shards than :func:`map_budget` allows is read the per-shard way instead.

Integrity. Each shard is checked when it is opened and before every gather by the dataset's
:class:`~feedpipe.datasets._shard_guard.ShardGuard`, the one rule every layout's reads go
through (size, the file stamped at open or its CRC32C, first-use verification, inotify while
mapped, stat where inotify is not to be had): see :mod:`feedpipe.datasets._shard_guard`. The
check is one system call per batch, not one per shard.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from feedpipe.datasets._filemap import libc
from feedpipe.datasets._shard_guard import ShardGuard, Stamp
from feedpipe.errors import DatasetError
from feedpipe.io.forks import ForkStamp

__all__ = [
    "ROW_COPY_MIN",
    "MapsClosedError",
    "ShardSpace",
    "indices_array",
    "inverse",
    "map_budget",
    "scratch",
    "window",
    "word_rows",
]

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAX_SPAN = 1 << 44  # address space one dataset may reserve (user space is 128 TiB)
_HUGE = 2 << 20  # a PMD huge page on x86-64 and arm64 (4 KiB pages)
_ZERO = np.zeros(1, np.intp)  # the shard of every record of a one-shard space
_INT64, _UINT64 = np.dtype(np.int64), np.dtype(np.uint64)
_MAX = np.maximum.reduce


def _unit(record_bytes: int, biggest: int) -> int:
    """Where shards start in a space: a multiple of this many bytes, a whole number of records
    and pages; of huge pages too when a shard fills one and that wastes no more than 64 MiB of
    address space per shard, so the kernel may map its page cache with huge pages (as it aligns
    a large ``mmap`` of its own choosing): fewer TLB misses on a shuffled gather."""
    unit = math.lcm(record_bytes, mmap.PAGESIZE)
    huge = math.lcm(record_bytes, _HUGE)
    return huge if biggest >= _HUGE and huge <= 32 * _HUGE else unit


def map_budget() -> int:
    """How many shards one dataset may map: a quarter of ``vm.max_map_count`` (each mapped
    shard splits the reservation: up to two map areas)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            count = int(f.read())
    except (OSError, ValueError):
        count = 65530  # the kernel's default
    return max(0, count // 4)


def word_rows(rows: np.ndarray, address: int) -> np.ndarray:
    """``rows`` (uint8 rows starting at ``address``) as rows of the widest unsigned word that
    divides a row and the address (``take`` copies words: 8-byte ones are ~7% faster than bytes
    at 512 B records); ``rows`` itself where that is the byte."""
    rb = rows.shape[1]
    for word in (np.uint64, np.uint32, np.uint16):
        size = np.dtype(word).itemsize
        if rb % size == 0 and address % size == 0:
            return rows.view(word)
    return rows


class MapsClosedError(ValueError):
    """A read of a :class:`ShardSpace` whose maps :meth:`ShardSpace.close` has unmapped (by
    another thread, meanwhile): the caller falls back to the path that reopens the dataset.
    A ``ValueError`` still, for callers that caught the bare one this was before."""


class ShardSpace:
    """Shards of ``record_bytes``-sized records mapped side by side (see the module docstring).

    ``guard`` knows the shards' data files (``guard.table``: paths, sizes from the index) and
    checks each one when it is mapped and before each gather; ``starts`` are the cumulative
    record counts (one more than the shards); ``watch=False`` makes the guard check by
    ``os.stat`` per batch instead of inotify. Use
    :meth:`create`, which returns ``None`` where this layout cannot be had (not Linux, too many
    shards, too much address space).
    """

    def __init__(
        self, guard: ShardGuard, starts: np.ndarray, record_bytes: int, watch: bool = True
    ) -> None:
        self.pid = os.getpid()
        self._born = ForkStamp()  # here(): these maps are this process's, not a fork's copy
        self.guard = guard
        self._paths, self._sizes = guard.table.paths, guard.table.sizes
        self._rb = int(record_bytes)
        if not watch:
            self.guard.watching = False
        unit = _unit(self._rb, max(self._sizes, default=0))
        size_arr = np.asarray(self._sizes, np.int64)
        padded = -(-size_arr // unit) * unit
        self._offset = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        self._span = int(padded.sum())
        self._starts = starts
        self._one = len(self._paths) == 1
        # row of global index g is g + delta[sid(g)]
        self._delta = (self._offset // self._rb - starts[:-1]).astype(np.int64)
        self._same = self._one and not self._delta[0]  # one shard at 0: row g is record g
        self._mapped = np.zeros(len(self._paths), bool)
        self._complete = False  # every shard mapped (none is ever unmapped but by close)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        # reserved one unit over, the range starts at a multiple of ``unit``: every space of
        # this record size is then row-aligned with every other (see :func:`window`)
        self._reserved = max(self._span, mmap.PAGESIZE) + unit
        base = libc().mmap(
            None,
            self._reserved,
            _PROT_NONE,
            _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE,
            -1,
            0,
        )
        if base is None or base == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "cannot reserve address space for the shards")
        self._raw = int(base)
        self._base = -(-self._raw // unit) * unit
        rows = self._span // self._rb
        self._view = np.asarray(_Window(self._base, rows, self._rb))
        #: exactly the records of a one-shard space (``take`` bounds-checks against it)
        self._records = self._view[: int(starts[-1])] if self._same else None
        #: the same records in the widest word that divides a record (:func:`word_rows`)
        self._words = None if self._records is None else word_rows(self._records, self._base)
        #: row of this space's first byte counted from address 0 (see :meth:`rows`)
        self.first_row = self._base // self._rb
        self.end_row = self.first_row + rows

    @classmethod
    def create(
        cls, guard: ShardGuard, starts: np.ndarray, record_bytes: int, watch: bool = True
    ) -> ShardSpace | None:
        """A space for these shards, or ``None`` where the per-shard path must serve."""
        paths, sizes = guard.table.paths, guard.table.sizes
        if not sys.platform.startswith("linux") or record_bytes <= 0 or not paths:
            return None
        if len(paths) > map_budget():
            return None
        unit = _unit(record_bytes, max(sizes, default=0))
        if sum(-(-int(s) // unit) * unit for s in sizes) > _MAX_SPAN:
            return None
        try:
            return cls(guard, starts, record_bytes, watch)
        except OSError:
            return None

    # ------------------------------------------------------------------ reads
    def here(self) -> bool:
        """Whether these maps are this process's own (not a forked child's copy of them)."""
        return self._born.here()

    @property
    def record_bytes(self) -> int:
        """Bytes per row of this space."""
        return self._rb

    def row_shift(self) -> np.ndarray:
        """Per shard, what turns a global record index of it into its row counted from address
        0 (``index + row_shift()[sid]``; record ``i`` lies at ``row * record_bytes``):
        :func:`window` reads several spaces' rows at once, between :meth:`enter` and
        :meth:`leave`, after :meth:`ensure`."""
        shift: np.ndarray = self._delta + self.first_row
        return shift

    @property
    def starts(self) -> np.ndarray:
        """Cumulative record counts of the shards (one more than the shards)."""
        return self._starts

    @property
    def complete(self) -> bool:
        """Every shard is mapped (none is unmapped but by :meth:`close`)."""
        return self._complete

    def ensure(self, sids: np.ndarray | list[int]) -> None:
        """Map (opening and checking each) shards ``sids`` not mapped yet."""
        if self._complete:
            return
        sids = np.asarray(sids, np.intp)
        if not self._mapped[sids].all():  # checked outside the lock: threads verify in parallel
            self._map(self._admit(sids[~self._mapped[sids]].tolist()))
        self._complete = bool(self._mapped.all())

    def _local(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(sid, rows of this space's view)`` of global records ``idx``, shards mapped."""
        if self._one:
            if not self._complete:
                self._map(self._admit([0]))
                self._complete = True
            return _ZERO, idx if self._same else idx + self._delta[0]
        sid = np.searchsorted(self._starts, idx, side="right") - 1
        rows = idx + self._delta[sid]
        if not self._complete and not self._mapped[sid].all():  # outside the lock: threads
            self._map(self._admit(np.unique(sid[~self._mapped[sid]]).tolist()))  # verify at once
            self._complete = bool(self._mapped.all())
        return sid, rows

    def enter(self, sid: np.ndarray | list[int], drained: bool = False) -> bool:
        """A read of shards ``sid`` begins: raise if a file changed (the guard's one check per
        batch) or the maps are closed; until :meth:`leave`, :meth:`close` waits. ``drained``
        and the result: as :meth:`ShardGuard.check`'s (one watcher drain per batch of several
        spaces)."""
        with self._lock:
            if self._closed:
                raise MapsClosedError("the dataset's shard maps are closed")
            drained = self.guard.check(sid, drained)
            self._active += 1
        return drained

    @property
    def reading(self) -> int:
        """Reads of these maps in progress (begun by :meth:`enter`, not yet ended by
        :meth:`leave`): :meth:`close` waits for none."""
        return self._active

    def leave(self) -> None:
        """The read :meth:`enter` began is over."""
        with self._lock:
            self._active -= 1
            if not self._active and self._closed:  # only close() waits for it
                self._idle.notify_all()

    def take(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Gather global records ``idx`` into ``out`` (``(len(idx), record_bytes)`` uint8): the
        guard's one check, then one ``take`` (``enter`` inlined: the per-batch path of small
        batches is as short as a hand-written ``np.take``)."""
        if self._same and self._complete:
            sid, rows = _ZERO, idx
        else:
            sid, rows = self._local(idx)
        with self._lock:
            if self._closed:
                raise MapsClosedError("the dataset's shard maps are closed")
            self.guard.check(sid)
            self._active += 1
        try:
            self._view.take(rows, axis=0, out=out, mode="clip")
        finally:
            self.leave()

    @property
    def one_file(self) -> bool:
        """Every record is in one shard, row ``i`` of the space being record ``i``
        (:meth:`take_new` serves it)."""
        return self._records is not None

    def take_new(self, idx: np.ndarray) -> np.ndarray:
        """Records ``idx`` (``int64``; a negative one counts from the end) of a :attr:`one_file`
        space as a new ``(len(idx), record_bytes)`` uint8 array: the guard's check, then one
        ``take`` that allocates the batch and checks each index as it copies (an ``IndexError``
        for one out of range), as a hand-written ``np.take`` over a memmap does: no separate
        pass over the indices, no copy through a temporary (``take`` makes one only when
        given ``out``)."""
        words = self._words
        assert words is not None, "take_new needs a one-file space"
        if not self._complete:
            self.ensure(_ZERO)
        self.enter(_ZERO)
        try:
            got: np.ndarray = words.take(idx, axis=0)
        finally:
            self.leave()
        return got.view(np.uint8)

    def _admit(self, sids: list[int]) -> list[tuple[int, int, Stamp | None]]:
        """Open shards ``sids`` and check them (``guard.admit``, no lock held): ``(sid, fd,
        stamp)`` each, for :meth:`_map`; nothing stays open if one fails."""
        admitted: list[tuple[int, int, Stamp | None]] = []
        try:
            for s in sids:
                path = self._paths[s]
                try:  # non-blocking: a FIFO planted in place of a shard must not hang the open
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                except FileNotFoundError:
                    raise DatasetError(f"{path}: shard {s} file is missing") from None
                admitted.append((s, fd, None))
                admitted[-1] = (s, fd, self.guard.admit(s, fd))
        except BaseException:
            for _s, fd, _stamp in admitted:
                os.close(fd)
            raise
        return admitted

    def _map(self, admitted: list[tuple[int, int, Stamp | None]]) -> None:
        """Map the shards :meth:`_admit` opened (unless mapped meanwhile); close every fd."""
        lib = libc()
        try:
            with self._lock:
                if self._closed:
                    raise MapsClosedError("the dataset's shard maps are closed")
                for s, fd, stamp in admitted:
                    if self._mapped[s]:
                        continue
                    self.guard.opened(s, fd, stamp)  # watched from here
                    size = self._sizes[s]
                    if size:
                        got = lib.mmap(
                            self._base + int(self._offset[s]),
                            size,
                            _PROT_READ,
                            _MAP_SHARED | _MAP_FIXED,
                            fd,
                            0,
                        )
                        if got is None or got != self._base + int(self._offset[s]):
                            err = ctypes.get_errno()
                            raise DatasetError(
                                f"{self._paths[s]}: shard {s} cannot be mapped: {os.strerror(err)}"
                            )
                    self._mapped[s] = True
        finally:
            for _s, fd, _stamp in admitted:
                os.close(fd)

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout: float = 60.0) -> None:
        """Unmap everything, once no gather is running (waits up to ``timeout`` seconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._idle.wait_for(lambda: not self._active, timeout):
                return  # a gather still runs: leave the maps (address space only) in place
        self.forget()

    def forget(self) -> None:
        """Release the maps and the watches without waiting (after a fork, where no other
        thread of this process can be inside a gather)."""
        self._closed = True
        self.guard.forget()
        if self._base:
            libc().munmap(self._raw, self._reserved)
            self._base = 0


def window(first_row: int, end_row: int, record_bytes: int) -> np.ndarray:
    """Rows ``[first_row, end_row)`` of ``record_bytes`` bytes counted from address 0, as one
    read-only ``(rows, record_bytes)`` uint8 view: the rows of several spaces of this record size
    (:meth:`ShardSpace.row_shift`) at once. Only rows mapped (between :meth:`ShardSpace.enter` and
    :meth:`ShardSpace.leave` of their space) may be read; the rest of the range is not."""
    return np.asarray(_Window(first_row * record_bytes, end_row - first_row, record_bytes))


class _Window:
    """A numpy array interface over the reserved range: ``(rows, record_bytes)`` uint8."""

    def __init__(self, base: int, rows: int, record_bytes: int) -> None:
        self.__array_interface__ = {
            "data": (base, True),  # read-only
            "shape": (rows, record_bytes),
            "typestr": "|u1",
            "version": 3,
        }


# ------------------------------------------------------------ the shard-by-shard path
ROW_COPY_MIN = 64 << 10  # records this large are copied one by one (no scratch + scatter)


def scratch(tls: threading.local, like: np.ndarray) -> np.ndarray:
    """A per-thread buffer shaped like ``like``, reused across batches (a fresh one per batch
    is faulted in page by page, which costs more than the gather itself)."""
    buf = getattr(tls, "buf", None)
    if buf is None or buf.nbytes < like.nbytes:
        buf = tls.buf = np.empty(like.nbytes, np.uint8)
    return buf[: like.nbytes].view(like.dtype).reshape(like.shape)


def inverse(order: np.ndarray) -> np.ndarray:
    """The inverse permutation of ``order``: ``inverse(order)[order] == arange(len(order))``."""
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    return inv


def _in_range(indices: Any, length: int) -> bool:
    """Whether ``indices`` is a non-empty 1-D ``int64`` array of indices in ``[0, length)``:
    one reduction (negatives look huge as ``uint64``)."""
    return (
        type(indices) is np.ndarray
        and indices.dtype is _INT64
        and indices.ndim == 1
        and indices.size > 0
        and bool(_MAX(indices.view(_UINT64)) < length)
    )


def indices_array(indices: Any, length: int, out_of_range: Callable[[int], str]) -> np.ndarray:
    """A batch's indices (a sequence, numpy array or tensor of integers) as a 1-D int64 array in
    ``[0, length)``, negatives wrapped; an index outside ``[-length, length)`` is an
    ``IndexError`` with ``out_of_range(index)`` as its message. Booleans are refused (a mask is
    not a batch of indices), and a ``uint64`` index too large for ``int64`` is out of range
    (never wrapped into a negative one). The result may be the caller's array: never write it.
    An ``int64`` array in range (what the loader passes) is checked by one reduction."""
    if _in_range(indices, length):
        same: np.ndarray = indices
        return same
    if hasattr(indices, "tolist") and not isinstance(indices, np.ndarray):  # a tensor
        indices = indices.tolist()
    idx = np.asarray(indices)
    if idx.size == 0:
        return np.empty(0, np.int64)
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise TypeError(f"indices must be a 1-D sequence of integers, got {idx.dtype} {idx.shape}")
    if idx.dtype == np.uint64:
        huge = idx > np.iinfo(np.int64).max
        if huge.any():
            raise IndexError(out_of_range(int(idx[np.argmax(huge)])))
    idx = idx.astype(np.int64, copy=False)
    if idx.view(np.uint64).max() >= length:  # negatives look huge: look closer
        bad = (idx < -length) | (idx >= length)
        if bad.any():
            raise IndexError(out_of_range(int(idx[np.argmax(bad)])))
        idx = np.where(idx < 0, idx + length, idx)
    return idx
