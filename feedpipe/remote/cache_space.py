"""The space of a shard cache's directory: what lives there, what may be evicted, and the
reservation a download makes before it starts (see :mod:`feedpipe.remote.cache`).

A ``cache_dir`` holds version folders (``<16 hex digits>``, one per dataset version, each with
its ``.locks`` folder), the cache-wide lock ``.cache.lock`` and the ``.pressure`` file. Only
version folders are scanned and evicted from; a temp whose lock is free belongs to a dead
downloader and is removed by the scan.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.io.dirfd import Dir, TempFile, Tree, UnsafePathError
from feedpipe.io.ownership import ForeignEntriesError, claim
from feedpipe.remote import transfer as _remote
from feedpipe.remote.locks import flock_wait, lock_at, open_lock, try_exclusive_at
from feedpipe.remote.plan import AccessPlan
from feedpipe.remote.transfer import INDEX_NAME, FileEntry

__all__ = [
    "CACHE_LOCK",
    "LOCKS",
    "PRESSURE",
    "CacheSpace",
    "claim_cache_dir",
    "is_cache_entry",
    "is_version_dir",
    "open_version",
    "unsafe_error",
    "version_tree",
]

log = logging.getLogger("feedpipe.cache")

LOCKS = ".locks"
CACHE_LOCK = ".cache.lock"
PRESSURE = ".pressure"
VERSION = re.compile(r"[0-9a-f]{16}")  # a version folder: the key of (url, index CRC)

#: A complete file found by a scan: (mtime, size, path, lock path).
Found = tuple[float, int, str, str]


def _mode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


def is_version_dir(path: Path) -> bool:
    """A cache version folder: ``cache_dir/<16 hex digits>``, a real directory holding the
    cache's ``.locks`` directory (made with it), or empty (a crash between the two). The name
    alone is no proof: a user's folder named by a commit hash or run id is not the cache's."""
    mode = _mode(path)
    if VERSION.fullmatch(path.name) is None or mode is None or not stat.S_ISDIR(mode):
        return False
    locks = _mode(path / LOCKS)
    if locks is None:
        try:
            with os.scandir(path) as it:
                if next(it, None) is None:
                    return True
        except FileNotFoundError:
            return True  # gone meanwhile
        # not empty: a cache opening this version makes .locks first, maybe since the look
        # above (another thread or process at once), so look again before calling it foreign
        locks = _mode(path / LOCKS)
        if locks is None:
            return False
    return stat.S_ISDIR(locks)


def is_cache_entry(path: Path) -> bool:
    """What a cache writes at the top of its ``cache_dir``: version folders, its lock and
    pressure files, temps (of the ownership marker); an entry gone meanwhile."""
    mode = _mode(path)
    if mode is None:
        return True
    if path.name in (CACHE_LOCK, PRESSURE) or _remote.is_temp(path.name):
        return stat.S_ISREG(mode)
    return is_version_dir(path)


def claim_cache_dir(cache_dir: str) -> None:
    """The one ownership rule (:func:`feedpipe.io.ownership.claim`): a ``cache_dir`` holding
    anything a cache did not write is refused by name, since eviction deletes files there."""
    try:  # a cache_dir that is a link to a folder (/scratch -> /mnt/nvme) claims that folder
        claim(os.path.realpath(cache_dir), "cache", is_cache_entry)
    except (ForeignEntriesError, NotADirectoryError, ValueError) as exc:  # ValueError: marker
        raise DatasetError(str(exc)) from None


def open_version(cache_dir: str, url: str, raw_index: bytes, timeout_s: float) -> Tree:
    """The version folder of ``url`` at this index (made, with its ``index.json``, if new),
    held open: every write into it goes through the tree (:mod:`feedpipe.io.dirfd`)."""
    key = hashlib.sha1(f"{url}\0{to_hex(crc32c(raw_index))}".encode()).hexdigest()[:16]
    tree = version_tree(cache_dir, key, create=True)
    try:
        _write_index(tree, raw_index, timeout_s)
    except BaseException:
        tree.close()
        raise
    return tree


def version_tree(cache_dir: str, key: str, *, create: bool = False) -> Tree:
    """The version folder ``key`` of ``cache_dir`` opened as a tree, itself never through a
    link; :class:`DatasetError` names a link or a file on the way."""
    try:
        with Dir.at(cache_dir, create=create) as root:
            return Tree(root.child(key, create=create))
    except UnsafePathError as exc:
        raise unsafe_error(exc) from None


def unsafe_error(exc: UnsafePathError) -> DatasetError:
    """The :class:`DatasetError` of a link, a file or a replaced directory on a cache path."""
    return DatasetError(
        f"cache {exc.filename}: {exc.strerror} (the cache never writes through links in its "
        "directory)"
    )


def _write_index(tree: Tree, raw_index: bytes, timeout_s: float) -> None:
    """The version's ``index.json``, written once, durably."""
    try:
        locks = tree.dir(LOCKS, create=True)
        if tree.root.stat(INDEX_NAME) is not None:
            return
        # under the index's own lock, as a download holds its file's: another cache's scan
        # (a thread or process opening the same version) takes an unlocked temp for a dead one
        fd = lock_at(locks, INDEX_NAME + ".lock")
        try:
            flock_wait(fd, fcntl.LOCK_EX, timeout_s, tree.root.entry(INDEX_NAME))
            if tree.root.stat(INDEX_NAME) is None:
                tree.root.write_atomic(INDEX_NAME, raw_index)
        finally:
            os.close(fd)
    except UnsafePathError as exc:
        raise unsafe_error(exc) from None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def eviction_order(
    complete: list[Found], version: str, plan: AccessPlan, incoming: str | None = None
) -> list[Found]:
    """Complete files, first to evict first: those no planned read uses (``plan``, of the
    ``version`` folder; every file of other versions), least recently used first; then planned
    ones, the next use farthest away first (Belady). Without a plan: LRU. For a prefetch of
    ``incoming``, only the files needed later than it."""
    if not plan:
        return sorted(complete)
    mine = version + os.sep
    rels = {c[2]: os.path.relpath(c[2], version) for c in complete if c[2].startswith(mine)}
    ranks = plan.ranks([*rels.values(), *([incoming] if incoming else [])])

    def next_use(c: Found) -> int | None:
        rel = rels.get(c[2])
        return None if rel is None else ranks[rel]

    def key(c: Found) -> tuple[int, float]:
        nxt = next_use(c)
        return (0, c[0]) if nxt is None else (1, -nxt)

    order = sorted(complete, key=key)
    if incoming is None:
        return order
    mine_next = ranks[incoming]  # None: not planned, so only unplanned files may go

    def later(c: Found) -> bool:
        nxt = next_use(c)
        return nxt is None or (mine_next is not None and nxt > mine_next)

    return [c for c in order if later(c)]


class CacheSpace:
    """The bytes of one ``cache_dir`` under ``limit_bytes``: scans, evictions, reservations.

    ``count(name)`` is told of each eviction (``"evictions"``) and each dead temp removed
    (``"stale_temps_removed"``).
    """

    def __init__(
        self,
        cache_dir: str,
        limit_bytes: int | None,
        timeout_s: float,
        room_timeout_s: float,
        count: Callable[[str], None],
    ) -> None:
        self.cache_dir = cache_dir
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        self.room_timeout_s = room_timeout_s
        self._count = count

    # ---------------------------------------------------------------- reservations
    def reserve(
        self,
        entry: FileEntry,
        dest: tuple[Dir, str],
        version: str,
        name: str,
        plan: AccessPlan,
        *,
        on_wait: Callable[[], None] | None = None,
        wait_room: bool = True,
        cancel: threading.Event | None = None,
    ) -> TempFile:
        """Make room for ``entry`` of the ``version`` folder (shown as ``name``) under the
        cache-wide lock; create its reserving temp file beside ``dest`` (an open directory and
        the final name there) and return it, open."""
        if self.limit_bytes is not None and entry.nbytes > self.limit_bytes:
            raise DatasetError(
                f"{name}: file of {entry.nbytes} bytes does not fit the cache limit of "
                f"{self.limit_bytes} bytes"
            )
        start = time.monotonic()
        rounds = 0
        while True:
            rounds += 1
            # a prefetch evicts only files needed later than itself (Belady); a read waiting
            # for its file evicts whatever the order puts first
            incoming = None if wait_room else entry.relpath
            tmp, short = self._try_reserve(entry, dest, version, plan, incoming, cancel)
            if tmp is not None:
                return tmp
            waited = time.monotonic() - start
            if not wait_room or waited >= self.room_timeout_s:
                raise DatasetError(
                    f"cache {self.cache_dir}: cannot make room for {name} ({entry.nbytes} "
                    f"bytes) under the limit of {self.limit_bytes} bytes: the rest is leased by "
                    f"readers (still {short} bytes short after {waited:.1f} s)"
                )
            self.signal_pressure()
            if on_wait is not None:
                on_wait()
            if rounds > 1 or on_wait is None:  # right after on_wait, look again at once
                time.sleep(0.05)

    def _try_reserve(  # noqa: PLR0917 - reserve's arguments, passed on
        self,
        entry: FileEntry,
        dest: tuple[Dir, str],
        version: str,
        plan: AccessPlan,
        incoming: str | None,
        cancel: threading.Event | None,
    ) -> tuple[TempFile | None, int]:
        """One round: (the temp, 0) when ``entry`` fits, else (None, bytes still short)."""
        fd = open_lock(os.path.join(self.cache_dir, CACHE_LOCK))
        try:
            flock_wait(fd, fcntl.LOCK_EX, self.timeout_s, self.cache_dir, cancel=cancel)
            short = self.scan(entry.nbytes, version, plan, incoming)
            if short > 0:
                return None, short
            where, final = dest
            try:
                return where.temp(final, entry.nbytes), 0
            except UnsafePathError as exc:
                raise unsafe_error(exc) from None
        finally:
            os.close(fd)

    def signal_pressure(self) -> None:
        """Tell readers in every process that a download waits for room."""
        path = os.path.join(self.cache_dir, PRESSURE)  # never through a link planted there
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            # non-blocking: a FIFO planted there meanwhile is refused (ENXIO), never waited on
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            with contextlib.suppress(OSError):
                os.close(os.open(path, flags))

    def pressure_ns(self) -> int | None:
        """The ``.pressure`` file's mtime (ns), or None while no download ever waited."""
        try:
            return os.stat(os.path.join(self.cache_dir, PRESSURE)).st_mtime_ns
        except FileNotFoundError:
            return None

    # ---------------------------------------------------------------- scans
    def scan(self, need: int, version: str, plan: AccessPlan, incoming: str | None = None) -> int:
        """Remove dead temps; evict files not leased until ``need`` more bytes fit the limit
        (in :func:`eviction_order` of ``plan`` for the ``version`` folder; for a prefetch of
        ``incoming``, only files its plan needs later than ``incoming``, or not at all when
        ``incoming`` is not planned either).

        Returns how many bytes are still missing (<= 0: it fits). Call under the cache-wide lock
        (or with ``need=0``, which only removes dead temps and evicts nothing).
        """
        complete, used = self._inventory()
        if self.limit_bytes is None:
            return 0
        short = used + need - self.limit_bytes
        if need == 0:
            return short
        for _mtime, size, path, lock_path in eviction_order(complete, version, plan, incoming):
            if short <= 0:
                break
            if self._evict(path, lock_path, size):
                short -= size
        return short

    def _inventory(self) -> tuple[list[Found], int]:
        """The complete files of every version folder, and the bytes used (temps included)."""
        complete: list[Found] = []
        used = 0
        for key in _listdir(self.cache_dir):
            top = os.path.join(self.cache_dir, key)
            if not is_version_dir(Path(top)):
                continue  # evict only from the cache's own version folders
            for dirpath, dirnames, files in os.walk(top):
                if dirpath == top and LOCKS in dirnames:
                    dirnames.remove(LOCKS)
                for name in files:
                    path = os.path.join(dirpath, name)
                    target = _remote.temp_target(name)
                    if target is not None:
                        used += self._stale_or_reserved(top, dirpath, target, path)
                        continue
                    rel = os.path.relpath(path, top)
                    found = None if rel == INDEX_NAME else _complete(path, top, rel)
                    if found is not None:
                        used += found[1]
                        complete.append(found)
        return complete, used

    def _evict(self, path: str, lock_path: str, size: int) -> bool:
        """Unlink ``path`` unless leased or being (re)downloaded; True when it went."""
        if not self._unlink_unlocked(path, lock_path):
            return False
        self._count("evictions")
        log.debug("evicted %s (%d bytes)", path, size)
        return True

    def _unlink_unlocked(self, path: str, lock_path: str) -> bool | None:
        """Unlink ``path`` (below a version folder) while holding ``lock_path`` exclusively,
        both reached through the version folder's tree, never through a link: None when the
        lock is held elsewhere (or a link or a file is on the way), else whether it went."""
        key, _, rel = os.path.relpath(path, self.cache_dir).partition(os.sep)
        lock_rel = os.path.relpath(lock_path, os.path.join(self.cache_dir, key))
        try:
            with version_tree(self.cache_dir, key) as tree:
                fd = try_exclusive_at(*tree.parent(lock_rel.replace(os.sep, "/")))
                if fd is None:
                    return None
                try:
                    where, name = tree.parent(rel.replace(os.sep, "/"))
                    return where.unlink(name)
                finally:
                    os.close(fd)
        except (DatasetError, UnsafePathError, FileNotFoundError) as exc:
            log.warning("cache: not removing %s: %s", path, exc)
            return None

    def _stale_or_reserved(
        self, top: str, dirpath: str, target: tuple[str, int, int], path: str
    ) -> int:
        """Bytes reserved by a live download's temp file; a dead downloader's temp is removed."""
        final_name, declared, _pid = target
        rel = os.path.relpath(os.path.join(dirpath, final_name), top)
        gone = self._unlink_unlocked(path, os.path.join(top, LOCKS, rel + ".lock"))
        if gone is None:  # its downloader is alive and holds the lock
            try:
                return max(declared, os.path.getsize(path))
            except FileNotFoundError:
                return 0
        if gone:
            self._count("stale_temps_removed")
            log.info("removed %s left by an interrupted download", path)
        return 0


def _complete(path: str, top: str, rel: str) -> Found | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_mtime, st.st_size, path, os.path.join(top, LOCKS, rel + ".lock"))
