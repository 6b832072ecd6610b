"""One integrity rule for every shard file a dataset reads, whatever its layout.

Every read of a shard file goes through one of three holders: :class:`~._gather.ShardSpace`
(fixed records mapped side by side), :class:`~._memmap_open.OpenShards` (every other mapped
file: bytes records, typed columns' data, ragged records, the token column of
``TokenWindows``, and fixed records read shard by shard) or :class:`~._memmap_open.WatchedFiles`
(files read whole and kept in memory: side fields, offsets; checked before every use of what
was kept, so a rewrite after the read is refused as a mapped file's is). All call the same
:class:`ShardGuard`, so the rule is stated and kept here only:

1. **At open** (:meth:`ShardGuard.admit`, with the file's descriptor, before it is mapped or
   read, outside the holder's lock so that threads check shards in parallel; then
   :meth:`ShardGuard.opened` starts watching it; in every process, so in every forked or
   spawned worker too): the file is a regular
   file of the indexed size, the dataset was not rewritten since it was opened (``version``),
   and it is the very file stat'ed when the dataset was opened (same device, inode and mtime:
   :class:`ShardTable` ``stamps``). A file that is not (rewritten in place, swapped by rename,
   restored from a backup) is read whole and checked against the index's CRC32C; it is served
   only if it matches. With ``verify_first_use`` (the default, ``verify="first-use"``) every
   file is also checked against its CRC32C once before its first record is served; the result
   is shared with forked workers through :class:`SharedFlags`, so one process tree checks each
   file once (a spawned worker, which unpickles the dataset, checks again).
2. **While open** (:meth:`ShardGuard.check`, before every read): the file is watched with
   ``inotify`` (``IN_MODIFY``, which a truncation or a write raises), one instance per process
   shared by every dataset; the watch is added through ``/proc/self/fd/N``, so it is on the very
   file mapped even if the path was swapped meanwhile. One non-blocking read of that instance
   per batch tells whether any watched file changed (a watch's removal, ``IN_IGNORED``: the
   file is gone, nothing can change it); only those are re-checked: another size
   is an error, the same size is checked against the CRC32C (bytes rewritten in place are an
   error; a restore of the indexed bytes is accepted again). A mapped file modified after its
   path was swapped cannot be checked and is an error. Where inotify is unavailable (or out of
   watches), the files it does not watch are stat'ed per read: a path that now names another
   file leaves the map on the old file, which is safe to read; the same file with another
   size, or another mtime and bytes that fail the CRC32C, is an error.

As with any map, a truncation racing the read itself is not caught (``read="pread"`` never maps
fixed records). Errors name the file and the shard.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from feedpipe.datasets._filemap import close_fd, libc
from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c, to_hex

__all__ = [
    "ShardGuard",
    "ShardTable",
    "SharedFlags",
    "Stamp",
    "changed",
    "stamp_of",
    "watcher",
]

Stamp = tuple[int, int, int]  # (device, inode, mtime_ns)

_IN_MODIFY, _IN_Q_OVERFLOW, _IN_IGNORED = 0x00000002, 0x00004000, 0x00008000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_CHUNK = 8 << 20
_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = libc()
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = lib
    return _libc


def stamp_of(st: os.stat_result) -> Stamp:
    """What identifies one version of a file: ``(device, inode, mtime_ns)``."""
    return st.st_dev, st.st_ino, st.st_mtime_ns


def changed(path: str, sid: int, size: int, want: int, verb: str) -> str:
    """The message for a shard file of the wrong size (``verb``: ``is`` or ``is now``)."""
    while_open = " while open" if verb == "is now" else ""
    return (
        f"{path}: shard {sid} file {verb} {size} bytes but the index says {want} "
        f"(truncated or modified{while_open})"
    )


class SharedFlags:
    """One byte per file, in memory shared with forked children (an anonymous shared map);
    unpickled as a fresh, all-zero set (a spawned process checks for itself)."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._mm = mmap.mmap(-1, max(count, 1))  # MAP_SHARED | MAP_ANONYMOUS

    def __getitem__(self, i: int) -> bool:
        return bool(self._mm[i])

    def set(self, i: int) -> None:
        self._mm[i] = 1

    def __getstate__(self) -> dict[str, Any]:
        return {"count": self._count}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["count"])  # type: ignore[misc]


class ShardTable:
    """What the shard files of one role must be (plain and picklable): ``paths``, ``sizes`` and
    ``crcs`` (CRC32C hex) from the index, ``stamps`` taken when the dataset was opened (None: not
    known, e.g. a remote dataset's cache files), whether each file is verified before its first
    use, and ``version(sid)``, which raises if the dataset was rewritten since it was opened."""

    def __init__(
        self,
        paths: Sequence[str],
        sizes: Sequence[int],
        crcs: Sequence[str] | None,
        *,
        stamps: Sequence[Stamp | None] | None = None,
        verified: SharedFlags | None = None,
        version: Callable[[int], None] | None = None,
    ) -> None:
        self.paths, self.sizes = list(paths), list(sizes)
        self.crcs = None if crcs is None else list(crcs)
        self.stamps = list(stamps) if stamps is not None else [None] * len(self.paths)
        self.verified = verified  # None: no verification before first use
        self.version = version


class ShardGuard:
    """This process's checks of one :class:`ShardTable`'s files (see the module docstring):
    :meth:`opened` once per open, :meth:`check` before every read, :meth:`closed` when a file is
    unmapped. Callers serialise calls (their own lock)."""

    def __init__(self, table: ShardTable, watch: bool = True) -> None:
        self.pid = os.getpid()
        self.table = table
        self.watching = watch
        n = len(table.paths)
        self._unwatched = np.zeros(n, bool)  # open, checked by stat per read
        self._any_unwatched = False
        self._bad: dict[int, str] = {}  # sid -> error, once an open file was seen to change
        self._ident: dict[int, Stamp] = {}  # sid -> the open file's stamp
        self._dirty: list[int] = []  # files the process's watcher saw change (to re-check)
        self._wds: dict[int, int] = {}  # sid -> watch descriptor

    # ------------------------------------------------------------------ at open
    def admit(self, sid: int, fd: int) -> Stamp:
        """The checks of shard ``sid``'s file, open as ``fd``, that touch no state of this
        guard (so callers run them outside their lock, several at once): the version indexed,
        a regular file of the indexed size, the file stamped at open or its CRC32C, the
        first-use CRC32C. Raises a :class:`DatasetError` naming the file; returns the stamp
        checked, for :meth:`opened`."""
        t = self.table
        path = t.paths[sid]
        if t.version is not None:
            t.version(sid)  # after the open: the file is the version indexed
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(f"{path}: shard {sid} file is not a regular file")
        if st.st_size != t.sizes[sid]:
            raise DatasetError(changed(path, sid, st.st_size, t.sizes[sid], "is"))
        now = stamp_of(st)
        want = t.stamps[sid]
        if want is not None and now != want:
            why = "was replaced or rewritten since the dataset was opened"
            self._crc(sid, fd, st.st_size, why)
        elif t.verified is not None and not t.verified[sid]:
            self._crc(sid, fd, st.st_size, "is corrupt")
            t.verified.set(sid)
        return now

    def opened(self, sid: int, fd: int, admitted: Stamp | None = None) -> None:
        """Shard ``sid``'s file, open as ``fd``, is about to be mapped or read: watch it from
        now on (call under the holder's lock). ``admitted``: what :meth:`admit` returned for
        this descriptor (run here when ``None``); a file changed since is checked again."""
        if admitted is None:
            admitted = self.admit(sid, fd)
        self._watch(sid, fd)  # from here a change is seen; one before it is seen below
        st = os.fstat(fd)
        t = self.table
        if st.st_size != t.sizes[sid]:
            raise DatasetError(changed(t.paths[sid], sid, st.st_size, t.sizes[sid], "is now"))
        if stamp_of(st) != admitted:
            self._crc(sid, fd, st.st_size, "was rewritten while it was being opened")
        self._ident[sid] = stamp_of(st)

    def _crc(self, sid: int, fd: int, size: int, why: str) -> None:
        t = self.table
        if t.crcs is None:
            return
        # read, not mapped: a truncation racing the check is an error here, never a SIGBUS
        buf = memoryview(bytearray(min(size, _CHUNK)))
        value, pos = 0, 0
        while pos < size:
            got = os.preadv(fd, [buf[: min(_CHUNK, size - pos)]], pos)
            if not got:
                break
            value = crc32c(buf[:got], value)
            pos += got
        if pos != size or to_hex(value) != t.crcs[sid]:
            raise DatasetError(
                f"{t.paths[sid]}: shard {sid} file {why} (CRC32C {to_hex(value)} over {pos} "
                f"bytes, the index says {t.crcs[sid]}); its records are not served"
            )

    def verify_bytes(self, sid: int, data: bytes | memoryview) -> None:
        """Check a file read whole (offsets, side columns) against its CRC32C."""
        t = self.table
        if t.crcs is not None and to_hex(crc32c(data)) != t.crcs[sid]:
            raise DatasetError(
                f"{t.paths[sid]}: shard {sid} file is corrupt (CRC32C {to_hex(crc32c(data))}, "
                f"the index says {t.crcs[sid]}); its records are not served"
            )

    def _watch(self, sid: int, fd: int) -> None:
        # through the descriptor: the watch is on the file mapped, not on what the path names now
        wd = watcher().add(f"/proc/self/fd/{fd}", self._dirty, sid) if self.watching else -1
        if wd < 0:  # no inotify (watch=False, none to be had, out of watches): stat per read
            self._unwatched[sid] = True
            self._any_unwatched = True
        else:
            self._wds[sid] = wd

    # ------------------------------------------------------------------ before each read
    def check(self, sid: np.ndarray | Sequence[int], drained: bool = False) -> bool:
        """Raise if a file of this read changed since it was opened (see the module docstring).
        ``drained``: this process's watcher was drained since the read began (by another
        guard's check of the same read), so its events are in every guard already. Returns
        whether the watcher is drained now."""
        if self._wds and not drained:
            watcher().drain()
            drained = True
        if self._wds:
            while self._dirty:
                self._restat(self._dirty.pop(), modified=True)
        if self._any_unwatched:
            arr = np.asarray(sid, np.intp)
            for s in np.unique(arr[self._unwatched[arr]]).tolist():
                self._restat(s, modified=False)
        if self._bad:
            for s in np.unique(np.asarray(sid, np.intp)).tolist():
                if s in self._bad:
                    raise DatasetError(self._bad[s])
        return drained

    def _restat(self, s: int, modified: bool) -> None:
        """Re-check shard ``s``; ``modified``: inotify saw the open file written."""
        t = self.table
        path = t.paths[s]
        if s not in self._ident:
            return  # an event for a file since closed
        dev, ino, mtime = self._ident[s]
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
        if st.st_size != t.sizes[s]:
            self._bad[s] = changed(path, s, st.st_size, t.sizes[s], "is now")
            return
        if (modified or st.st_mtime_ns != mtime) and t.crcs is not None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                try:
                    self._crc(s, fd, t.sizes[s], "was rewritten in place while mapped")
                finally:
                    os.close(fd)
            except DatasetError as exc:
                self._bad[s] = f"{exc}; reopen the dataset"
                return
            except OSError as exc:
                self._bad[s] = f"{path}: shard {s} file cannot be re-checked: {exc}"
                return
        self._ident[s] = (dev, ino, st.st_mtime_ns)
        self._bad.pop(s, None)

    # ------------------------------------------------------------------ lifetime
    def closed(self, sid: int) -> None:
        """Shard ``sid``'s file is no longer open or mapped here: stop watching it."""
        self._ident.pop(sid, None)
        self._bad.pop(sid, None)
        self._unwatched[sid] = False
        wd = self._wds.pop(sid, None)
        if wd is not None and self.pid == os.getpid():
            watcher().remove(self._dirty, {wd})

    def forget(self) -> None:
        """Drop every watch (in a forked child, whose watcher never held them, just forget)."""
        if self._wds and self.pid == os.getpid():
            watcher().remove(self._dirty, set(self._wds.values()))
        self._wds = {}
        self._ident = {}


class _Watcher:
    """This process's one inotify instance, shared by every guard (instances are few: 128 per
    user by default). A change event appends the shard to its guard's ``dirty`` list; the guard
    re-checks those shards under its caller's lock (the watcher never takes it)."""

    def __init__(self) -> None:
        try:
            self.fd = int(_lib().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        except AttributeError:  # pragma: no cover - not glibc
            self.fd = -1
        # re-entrant: a dataset collected during drain() (its __del__ closes) removes watches
        self._lock = threading.RLock()
        self._poll = select.poll()  # used under the lock (one poll() at a time)
        if self.fd >= 0:
            self._poll.register(self.fd, select.POLLIN)
        self._owners: dict[int, list[tuple[list[int], int]]] = {}  # wd -> (dirty list, shard)

    def add(self, path: str, dirty: list[int], sid: int) -> int:
        """Watch ``path`` for shard ``sid`` of the guard owning ``dirty``; the wd, or -1."""
        if self.fd < 0:
            return -1
        with self._lock:
            wd = int(_lib().inotify_add_watch(self.fd, os.fsencode(path), _IN_MODIFY))
            if wd >= 0:  # hard links (and other datasets) on one file share its watch
                self._owners.setdefault(wd, []).append((dirty, sid))
            return wd

    def remove(self, dirty: list[int], wds: set[int]) -> None:
        """Forget one guard's watches (the watch itself goes with its last owner)."""
        with self._lock:
            for wd in wds:
                left = [o for o in self._owners.get(wd, ()) if o[0] is not dirty]
                if left:
                    self._owners[wd] = left
                elif self._owners.pop(wd, None) is not None:
                    _lib().inotify_rm_watch(self.fd, wd)

    def drain(self) -> None:
        """Read the pending events (one ``poll`` when there are none: cheaper than a read
        that fails)."""
        with self._lock:
            if not self._poll.poll(0):
                return
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
                    if mask & _IN_IGNORED:  # the file is gone (deleted, unlinked and closed):
                        continue  # nothing can write it any more; what was read stays valid
                    # lost events (queue overflow): every watched shard is re-checked
                    lost = mask & _IN_Q_OVERFLOW
                    every = list(self._owners.values()) if lost else [self._owners.get(wd, [])]
                    for owners in every:
                        for dirty, sid in list(owners):
                            dirty.append(sid)

    def close(self) -> None:
        if self.fd >= 0:
            self._poll.unregister(self.fd)
        self.fd = close_fd(self.fd)


_WATCHER: _Watcher | None = None
_WATCHER_LOCK = threading.Lock()
_HOOKED = False


def watcher() -> _Watcher:
    """This process's inotify watcher (made on first use; a forked child makes its own)."""
    global _WATCHER, _HOOKED
    w = _WATCHER
    if w is None:
        with _WATCHER_LOCK:
            w = _WATCHER
            if w is None:
                w = _WATCHER = _Watcher()
                if not _HOOKED:
                    os.register_at_fork(after_in_child=_after_fork)
                    _HOOKED = True
    return w


def _after_fork() -> None:
    """In a forked child: never read the parent's events; a fresh watcher on first use."""
    global _WATCHER, _WATCHER_LOCK
    if _WATCHER is not None:
        _WATCHER.close()  # the child's copy of the descriptor only
    _WATCHER, _WATCHER_LOCK = None, threading.Lock()
