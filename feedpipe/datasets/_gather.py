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

Integrity. A file truncated under a map would raise ``SIGBUS`` on the next read of a lost page.
The shards are watched with ``inotify`` (``IN_MODIFY``, which a truncation or a write raises),
through one inotify instance per process shared by every dataset; the watch is added through
``/proc/self/fd/N``, so it is on the very file mapped, even if the path was swapped meanwhile.
Before each gather one non-blocking read of its descriptor tells whether any watched file
changed, and only then are the changed files checked: a size other than the index's is an
error; the same size is checked against the index's CRC32C (``crcs``), so bytes rewritten in
place (a ``cp`` over the shard, a truncation then a sparse extension) are an error too, and a
restore of the indexed bytes is accepted again. A mapped file modified after its path was
swapped cannot be checked and is an error. So the check is one system call per batch, not one
per shard. Where inotify is unavailable (or out of watches), the shards it does not watch are
checked with ``os.stat`` per batch touching them: a path that now names another file (renamed
over, removed) leaves the map on the old file, which is safe to read; the same file with
another size, or another mtime and bytes that fail the CRC32C, is an error. As with any map, a
truncation racing the gather itself is not caught; ``read="pread"`` never maps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import stat
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from feedpipe.errors import DatasetError

__all__ = ["ROW_COPY_MIN", "ShardSpace", "indices_array", "inverse", "map_budget", "scratch"]

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_IN_MODIFY, _IN_Q_OVERFLOW = 0x00000002, 0x00004000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_MAX_SPAN = 1 << 44  # address space one dataset may reserve (user space is 128 TiB)
_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = lib
    return _libc


def map_budget() -> int:
    """How many shards one dataset may map: a quarter of ``vm.max_map_count`` (each mapped
    shard splits the reservation: up to two map areas)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            count = int(f.read())
    except (OSError, ValueError):
        count = 65530  # the kernel's default
    return max(0, count // 4)


class ShardSpace:
    """Shards of ``record_bytes``-sized records mapped side by side (see the module docstring).

    ``paths[s]`` is shard ``s``'s data file, ``sizes[s]`` its size in bytes from the index and
    ``starts`` the cumulative record counts (``len(paths) + 1`` entries); ``watch=False`` checks
    sizes with ``os.stat`` per batch instead of inotify. ``crcs`` (an attribute, optional: set it
    before the first :meth:`take`) holds each shard's CRC32C hex from the index, to re-check a
    shard seen modified with its size unchanged; ``opened`` (optional too) is called with a
    shard's number once its file is open, before it is mapped, to refuse it (raise). Use
    :meth:`create`, which returns ``None`` where this layout cannot be had (not Linux, too many
    shards, too much address space).
    """

    def __init__(
        self,
        paths: Sequence[str],
        sizes: Sequence[int],
        starts: np.ndarray,
        record_bytes: int,
        watch: bool = True,
    ) -> None:
        self.pid = os.getpid()
        self._paths, self._sizes, self._rb = list(paths), list(sizes), int(record_bytes)
        unit = math.lcm(self._rb, mmap.PAGESIZE)
        size_arr = np.asarray(self._sizes, np.int64)
        padded = -(-size_arr // unit) * unit
        self._offset = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        self._span = int(padded.sum())
        self._starts = starts
        self._one = len(self._paths) == 1
        # row of global index g is g + delta[sid(g)]
        self._delta = (self._offset // self._rb - starts[:-1]).astype(np.int64)
        self._mapped = np.zeros(len(self._paths), bool)
        self._unwatched = np.zeros(len(self._paths), bool)  # mapped, checked by stat per batch
        self._any_unwatched = False
        self._bad: dict[int, str] = {}  # sid -> error, once a watched file was seen to change
        self._ident: dict[int, tuple[int, int, int]] = {}  # sid -> mapped (dev, ino, mtime_ns)
        self.crcs: list[str] | None = None
        self.opened: Callable[[int], None] | None = None
        self._dirty: list[int] = []  # shards the process's watcher saw change (to re-check)
        self._wds: set[int] = set()
        self._watching = watch
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        lib = _lib()
        base = lib.mmap(
            None,
            max(self._span, mmap.PAGESIZE),
            _PROT_NONE,
            _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE,
            -1,
            0,
        )
        if base is None or base == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "cannot reserve address space for the shards")
        self._base = int(base)
        rows = self._span // self._rb
        self._view = np.asarray(_Window(self._base, rows, self._rb))

    @classmethod
    def create(
        cls,
        paths: Sequence[str],
        sizes: Sequence[int],
        starts: np.ndarray,
        record_bytes: int,
        watch: bool = True,
    ) -> ShardSpace | None:
        """A space for these shards, or ``None`` where the per-shard path must serve."""
        if not sys.platform.startswith("linux") or record_bytes <= 0 or not paths:
            return None
        if len(paths) > map_budget():
            return None
        unit = math.lcm(record_bytes, mmap.PAGESIZE)
        if sum(-(-int(s) // unit) * unit for s in sizes) > _MAX_SPAN:
            return None
        try:
            return cls(paths, sizes, starts, record_bytes, watch)
        except OSError:
            return None

    # ------------------------------------------------------------------ reads
    def take(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Gather global records ``idx`` into ``out`` (``(len(idx), record_bytes)`` uint8)."""
        if self._one:
            sid = np.zeros(len(idx), np.intp)
            rows = idx + self._delta[0]
        else:
            sid = np.searchsorted(self._starts, idx, side="right") - 1
            rows = idx + self._delta[sid]
        with self._lock:
            if self._closed:
                raise ValueError("the dataset's shard maps are closed")
            if not self._mapped[sid].all():
                self._map(np.unique(sid[~self._mapped[sid]]).tolist())
            self._check(sid)
            self._active += 1
        try:
            np.take(self._view, rows, axis=0, out=out, mode="clip")
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def _map(self, sids: list[int]) -> None:
        """Map shards ``sids`` (under the lock); each fd is closed once mapped."""
        lib = _lib()
        for s in sids:
            path = self._paths[s]
            try:  # non-blocking: a FIFO planted in place of a shard must not hang the open
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                raise DatasetError(f"{path}: shard {s} file is missing") from None
            try:
                if self.opened is not None:
                    self.opened(s)
                self._watch(s, fd)  # before the size check: a later truncation is seen
                st = os.fstat(fd)
                self._ident[s] = (st.st_dev, st.st_ino, st.st_mtime_ns)
                if not stat.S_ISREG(st.st_mode):
                    raise DatasetError(f"{path}: shard {s} file is not a regular file")
                size = st.st_size
                if size != self._sizes[s]:
                    raise DatasetError(_changed(path, s, size, self._sizes[s], "is"))
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
                            f"{path}: shard {s} cannot be mapped: {os.strerror(err)}"
                        )
            finally:
                os.close(fd)
            self._mapped[s] = True

    def _watch(self, sid: int, fd: int) -> None:
        # through the descriptor: the watch is on the file mapped, not on what the path names now
        wd = _watcher().add(f"/proc/self/fd/{fd}", self._dirty, sid) if self._watching else -1
        if wd < 0:  # no inotify (watch=False, none to be had, out of watches): stat per batch
            self._unwatched[sid] = True
            self._any_unwatched = True
        else:
            self._wds.add(wd)

    def _check(self, sid: np.ndarray) -> None:
        """Raise if a shard of this batch changed size since it was mapped (under the lock)."""
        if self._wds:
            _watcher().drain()
            while self._dirty:
                self._restat(self._dirty.pop(), modified=True)
        if self._any_unwatched:
            for s in np.unique(sid[self._unwatched[sid]]).tolist():
                self._restat(s, modified=False)
        if self._bad:
            for s in np.unique(sid).tolist():
                if s in self._bad:
                    raise DatasetError(self._bad[s])

    def _restat(self, s: int, modified: bool) -> None:
        """Re-check shard ``s``; ``modified``: inotify saw the mapped file written."""
        path = self._paths[s]
        dev, ino, mtime = self._ident.get(s, (-1, -1, -1))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != (dev, ino):
            if modified:  # the mapped file itself was written, and its path names another now
                self._bad[s] = (
                    f"{path}: shard {s} file was modified while mapped, after its path was "
                    "replaced or removed (the bytes mapped cannot be checked); reopen the dataset"
                )
            return  # renamed over or removed: the map keeps the old file, which is safe
        if st.st_size != self._sizes[s]:
            self._bad[s] = _changed(path, s, st.st_size, self._sizes[s], "is now")
            return
        if (modified or st.st_mtime_ns != mtime) and self.crcs is not None:
            from feedpipe.io.crc import crc32c_file, to_hex

            try:
                value, size = crc32c_file(path)
            except OSError as exc:
                self._bad[s] = f"{path}: shard {s} file cannot be re-checked: {exc}"
                return
            want = self.crcs[s]
            if size != self._sizes[s] or to_hex(value) != want:
                self._bad[s] = (
                    f"{path}: shard {s} file was rewritten in place while mapped (CRC32C "
                    f"{to_hex(value)}, the index says {want}); reopen the dataset"
                )
                return
        self._ident[s] = (dev, ino, st.st_mtime_ns)
        self._bad.pop(s, None)

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
        if self._wds and self.pid == os.getpid():  # a child's watcher never held them
            _watcher().remove(self._dirty, self._wds)
        self._wds = set()
        if self._base:
            _lib().munmap(self._base, max(self._span, mmap.PAGESIZE))
            self._base = 0


class _Watcher:
    """This process's one inotify instance, shared by every :class:`ShardSpace` (instances are
    few: 128 per user by default). A change event appends the shard to its space's ``dirty``
    list; the space re-checks those shards under its own lock (the watcher never takes it)."""

    def __init__(self) -> None:
        try:
            self.fd = int(_lib().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        except AttributeError:  # pragma: no cover - not glibc
            self.fd = -1
        self._lock = threading.Lock()
        self._owners: dict[int, list[tuple[list[int], int]]] = {}  # wd -> (dirty list, shard)

    def add(self, path: str, dirty: list[int], sid: int) -> int:
        """Watch ``path`` for shard ``sid`` of the space owning ``dirty``; the wd, or -1."""
        if self.fd < 0:
            return -1
        with self._lock:
            wd = int(_lib().inotify_add_watch(self.fd, os.fsencode(path), _IN_MODIFY))
            if wd >= 0:  # hard links (and other datasets) on one file share its watch
                self._owners.setdefault(wd, []).append((dirty, sid))
            return wd

    def remove(self, dirty: list[int], wds: set[int]) -> None:
        """Forget one space's watches (the watch itself goes with its last owner)."""
        with self._lock:
            for wd in wds:
                left = [o for o in self._owners.get(wd, ()) if o[0] is not dirty]
                if left:
                    self._owners[wd] = left
                elif self._owners.pop(wd, None) is not None:
                    _lib().inotify_rm_watch(self.fd, wd)

    def drain(self) -> None:
        """Read the pending events (one system call when there are none)."""
        with self._lock:
            while True:
                try:
                    buf = os.read(self.fd, 64 << 10)
                except BlockingIOError:
                    return
                except InterruptedError:  # pragma: no cover
                    continue
                pos = 0
                while pos + _EVENT.size <= len(buf):
                    wd, mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                    pos += _EVENT.size + length
                    # lost events (queue overflow): every watched shard is re-checked
                    lost = mask & _IN_Q_OVERFLOW
                    for owners in self._owners.values() if lost else [self._owners.get(wd, [])]:
                        for dirty, sid in owners:
                            dirty.append(sid)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


_WATCHER: _Watcher | None = None
_WATCHER_LOCK = threading.Lock()


def _watcher() -> _Watcher:
    """This process's :class:`_Watcher` (made on first use; a forked child makes its own)."""
    global _WATCHER
    w = _WATCHER
    if w is None:
        with _WATCHER_LOCK:
            w = _WATCHER
            if w is None:
                w = _WATCHER = _Watcher()
                if not _HOOKED:
                    _hook()
    return w


_HOOKED = False


def _hook() -> None:
    global _HOOKED
    os.register_at_fork(after_in_child=_after_fork)
    _HOOKED = True


def _after_fork() -> None:
    """In a forked child: never read the parent's events; a fresh watcher on first use."""
    global _WATCHER, _WATCHER_LOCK
    if _WATCHER is not None:
        _WATCHER.close()  # the child's copy of the descriptor only
    _WATCHER, _WATCHER_LOCK = None, threading.Lock()


class _Window:
    """A numpy array interface over the reserved range: ``(rows, record_bytes)`` uint8."""

    def __init__(self, base: int, rows: int, record_bytes: int) -> None:
        self.__array_interface__ = {
            "data": (base, True),  # read-only
            "shape": (rows, record_bytes),
            "typestr": "|u1",
            "version": 3,
        }


def _changed(path: str, sid: int, size: int, want: int, verb: str) -> str:
    while_open = " while open" if verb == "is now" else ""
    return (
        f"{path}: shard {sid} file {verb} {size} bytes but the index says {want} "
        f"(truncated or modified{while_open})"
    )


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


def indices_array(indices: Any, length: int, out_of_range: Callable[[int], str]) -> np.ndarray:
    """A batch's indices (a sequence, numpy array or tensor of integers) as a 1-D int64 array in
    ``[0, length)``, negatives wrapped; an index outside ``[-length, length)`` is an
    ``IndexError`` with ``out_of_range(index)`` as its message. Booleans are refused (a mask is
    not a batch of indices), and a ``uint64`` index too large for ``int64`` is out of range
    (never wrapped into a negative one). The result may be the caller's array: never write it."""
    if hasattr(indices, "tolist") and not isinstance(indices, np.ndarray):  # a tensor
        indices = indices.tolist()
    idx = np.asarray(indices)
    if idx.size == 0:
        return np.empty(0, np.int64)
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise TypeError(
            f"indices must be a 1-D sequence of integers, got {idx.dtype} {idx.shape}"
        )
    if idx.dtype == np.uint64:
        huge = idx > np.iinfo(np.int64).max
        if huge.any():
            raise IndexError(out_of_range(int(idx[np.argmax(huge)])))
    idx = idx.astype(np.int64, copy=False)
    if (idx.view(np.uint64) >= length).any():  # negatives look huge: look closer
        bad = (idx < -length) | (idx >= length)
        if bad.any():
            raise IndexError(out_of_range(int(idx[np.argmax(bad)])))
        idx = np.where(idx < 0, idx + length, idx)
    return idx
