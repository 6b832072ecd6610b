"""A bounded, crash-safe local cache of a remote dataset's files, shared by processes on a node.

``ShardCache(url, cache_dir, limit_bytes)`` fetches a file on first use
(:meth:`~ShardCache.acquire`), fetches ahead in the background (:meth:`~ShardCache.prefetch`)
and evicts files to stay under ``limit_bytes``: with an access plan (:attr:`ShardCache.plan`,
the order of the reads to come, which the loader provides), first the files no planned read
uses and then the one needed farthest in the future (Belady's policy, :mod:`feedpipe.remote.plan`);
without one, least recently used first. Safety across processes comes from ``flock`` locks,
one per file:

* a reader holds a *shared* lock while it uses a file (a *lease*); eviction needs an
  *exclusive* lock taken without waiting, so a leased file is never evicted;
* a downloader holds the *exclusive* lock, so each file is downloaded once; the others wait and
  then find it complete;
* a download goes to a temp name (``.feedpipe-tmp.BYTES.PID.RAND.NAME``, a prefix no dataset file
  may have) and is renamed after its size and CRC32C match the index; a temp whose lock is free
  belongs to a dead downloader and is removed by the next eviction scan;
* no file is ever rewritten or truncated in place (a reader may have it mapped): a download is
  renamed over the old name and eviction unlinks, so a reader keeps its old bytes;
* space is reserved under a cache-wide lock before a download starts (the temp name records the
  size), so concurrent downloaders together stay under the limit;
* prefetch threads are daemons and never keep the interpreter alive: :meth:`ShardCache.close`,
  garbage collection and interpreter exit set a cancel event that stops their lock waits and
  drops queued prefetches (a download cut off by exit leaves only a temp, removed by the next
  scan); a wait for a file that this object itself leases fails at once instead of waiting
  ``timeout_s`` for its own lock;
* a download that has to wait for room touches ``.pressure`` in the cache directory and calls
  its caller's ``on_wait``: readers that keep idle files leased (a dataset's open shards) drop
  those leases at their next read (:meth:`ShardCache.pressure_changed`). Background prefetches
  never wait for room: they give up (the file is fetched again on use);
* a lease's end (:meth:`~ShardCache.release`) counts as a use for the least-recently-used
  order, so a file a reader kept open for a long time is not the first to go.

A local path or ``file://`` URL is not cached: files are read in place and never evicted.
Each dataset version gets its own subdirectory (keyed by URL and index checksum), so a rewritten
remote dataset never mixes with stale files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.io.ownership import ForeignEntriesError, claim
from feedpipe.remote import transfer as _remote
from feedpipe.remote.plan import AccessPlan
from feedpipe.remote.prefetch_pool import DaemonPool
from feedpipe.remote.transfer import INDEX_NAME, FileEntry

__all__ = ["CacheStats", "ShardCache"]

log = logging.getLogger("feedpipe.cache")

_LOCKS = ".locks"
_CACHE_LOCK = ".cache.lock"
_PRESSURE = ".pressure"
_VERSION = re.compile(r"[0-9a-f]{16}")  # a version folder: the key of (url, index CRC)
_POLL_S = 0.01


@dataclass
class CacheStats:
    """Counters of one :class:`ShardCache` object (this process only)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    stale_temps_removed: int = 0


class _CancelledError(Exception):
    """A background prefetch stopped because its cache was closed or the interpreter exits."""


def _flock(
    fd: int,
    op: int,
    timeout_s: float,
    what: str,
    *,
    cancel: threading.Event | None = None,
    moot: Callable[[], bool] | None = None,
) -> bool:
    """``flock`` with a timeout (polls without blocking); :class:`TimeoutError` names ``what``.

    Returns True once locked. With ``cancel``, the wait stops (:class:`_CancelledError`) as
    soon as the event is set; with ``moot``, it stops (returning False) once ``moot()`` is true.
    """
    deadline = time.monotonic() + timeout_s
    pause = _POLL_S
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
            raise _CancelledError(what)
        pause = min(pause * 1.5, 0.2)


def _try_exclusive(lock_path: str) -> int | None:
    """Open ``lock_path`` and take an exclusive lock without waiting; return the fd or None."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class ShardCache:
    """A local cache of the files of the dataset at ``remote_root`` (see the module docstring).

    Args:
        remote_root: dataset URL (``s3://bucket/ds``) or local path / ``file://`` URL.
        cache_dir: cache directory (shared by processes on the node); unused for local datasets.
        limit_bytes: the cache directory's size limit (``None``: unbounded).
        storage_options: fsspec options (credentials, endpoint); never logged.
        prefetch_workers: background download threads for :meth:`prefetch`.
        readahead: when the main (largest) file of shard ``k`` is acquired, prefetch the files
            of shards ``k+1 .. k+readahead`` (index order) in the background.
        eager_bytes: prefetch every file up to this size at construction (side columns and
            offsets, which a dataset reads for all shards at once); 0 disables.
        timeout_s: how long to wait for a lock (e.g. another process's download of the same file).
        room_timeout_s: how long to wait for readers to release files when the cache is full.
        deadline_s: retry deadline for transient remote errors, per file.
        index_bytes: the dataset's ``index.json`` as the caller already read it (so that caller
            and cache see the same version); read from the remote when ``None``.
    """

    def __init__(
        self,
        remote_root: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str] | None = None,
        limit_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        *,
        prefetch_workers: int = 8,
        readahead: int = 0,
        eager_bytes: int = 0,
        timeout_s: float = 600.0,
        room_timeout_s: float = 30.0,
        deadline_s: float = 120.0,
        index_bytes: bytes | None = None,
    ) -> None:
        self._args: dict[str, Any] = {
            "url": os.fspath(remote_root),
            "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
            "limit_bytes": limit_bytes,
            "options": dict(storage_options or {}),
            "prefetch_workers": prefetch_workers,
            "readahead": readahead,
            "eager_bytes": eager_bytes,
            "timeout_s": timeout_s,
            "room_timeout_s": room_timeout_s,
            "deadline_s": deadline_s,
        }
        self._setup(index_bytes)

    def _setup(self, raw_index: bytes | None) -> None:
        a = self._args
        self.url: str = a["url"]
        cache_dir, limit_bytes = a["cache_dir"], a["limit_bytes"]
        self.stats = CacheStats()
        self.limit_bytes = limit_bytes
        self.timeout_s: float = a["timeout_s"]
        self.room_timeout_s: float = a["room_timeout_s"]
        self.readahead: int = a["readahead"]
        self._options: dict[str, Any] = a["options"]
        self._policy = _remote.RetryPolicy(deadline_s=a["deadline_s"])
        self._prefetch_workers: int = a["prefetch_workers"]
        self._reset_process_state()
        self.is_local = not _remote.is_remote(self.url)
        self._fs, self._root = _remote.resolve(self.url, self._options, a["deadline_s"])
        if self.is_local:
            self.dir = self._root
            self._entries: dict[str, FileEntry] = {}
            return
        if cache_dir is None:
            raise ValueError(
                f"{_remote.redact(self.url, self._options)}: a remote dataset needs cache_dir"
            )
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self.cache_dir = os.path.abspath(cache_dir)
        _claim_cache_dir(self.cache_dir)
        if raw_index is None:
            raw_index, entries = _remote.read_remote_index(
                self._fs, self._root, self.url, self._options, self._policy
            )
        else:
            entries = _remote.parse_index(raw_index, _remote.join(self.url, INDEX_NAME))
        raw = raw_index
        self.index_bytes = raw
        for e in entries:  # the cache's own lock directory sits beside the files
            if e.relpath.split("/", 1)[0] == _LOCKS:
                url = _remote.join(_remote.redact(self.url, self._options), INDEX_NAME)
                raise DatasetError(f"{url}: file path {e.relpath!r} is reserved by the cache")
        self._entries = {e.relpath: e for e in entries}
        self._by_shard: dict[int, list[str]] = {}
        for e in entries:
            self._by_shard.setdefault(e.shard, []).append(e.relpath)
        self._main = {
            max(rels, key=lambda rel: self._entries[rel].nbytes) for rels in self._by_shard.values()
        }
        key = hashlib.sha1(f"{self.url}\0{to_hex(crc32c(raw))}".encode()).hexdigest()[:16]
        self.dir = os.path.join(self.cache_dir, key)
        os.makedirs(os.path.join(self.dir, _LOCKS), exist_ok=True)
        index_path = os.path.join(self.dir, INDEX_NAME)
        if not os.path.exists(index_path):
            # under the index's own lock, as a download holds its file's: another cache's scan
            # (a thread or process opening the same version) takes an unlocked temp for a dead one
            lock_path = os.path.join(self.dir, _LOCKS, INDEX_NAME + ".lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _flock(fd, fcntl.LOCK_EX, self.timeout_s, index_path)
                if not os.path.exists(index_path):
                    tmp = _remote.temp_name(index_path, len(raw))
                    with open(tmp, "wb") as f:
                        f.write(raw)
                    os.replace(tmp, index_path)
            finally:
                os.close(fd)
        self._scan(need=0)  # removes temps left by crashed downloaders
        # side files only, and only when they take a small part of the limit: eager fetches
        # that do not fit would evict each other (and the shards in use) before their first use
        eager = [e for e in entries if e.nbytes <= a["eager_bytes"] and e.relpath not in self._main]
        if eager and (limit_bytes is None or sum(e.nbytes for e in eager) <= limit_bytes // 4):
            self.prefetch(e.relpath for e in eager)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._leases: dict[str, list[int]] = {}
        #: the reads to come (empty: least-recently-used eviction); per process
        self.plan = AccessPlan()
        self._lock = threading.Lock()
        self._pool: DaemonPool | None = None
        self._pending: dict[str, Future[None]] = {}
        self._closed = False
        self._pressure_ns = 0

    def _check_process(self) -> None:
        """After a fork: drop the parent's leases (its own fds keep its locks), thread pool and
        plan."""
        if self._pid != os.getpid():
            for fds in self._leases.values():
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._reset_process_state()
            if not self.is_local:  # s3fs and other async filesystems are not fork-safe
                self._fs, self._root = _remote.resolve(
                    self.url, self._options, self._policy.deadline_s
                )

    # ---------------------------------------------------------------- public API
    def path(self, relpath: str) -> str:
        """The local path of ``relpath`` (present or not)."""
        return os.path.join(self.dir, relpath)

    def acquire(self, relpath: str, on_wait: Callable[[], None] | None = None) -> str:
        """Make ``relpath`` local (downloading it once if needed), lease it, return its path.

        The file cannot be evicted until :meth:`release` is called for each :meth:`acquire`.
        ``on_wait`` is called while the download waits for room under the limit (e.g. to
        release the caller's own idle leases).
        """
        if self.is_local:
            return self.path(relpath)
        self._check_process()
        fd = self._ensure(relpath, lease=True, on_wait=on_wait)
        assert fd is not None
        with self._lock:
            self._leases.setdefault(relpath, []).append(fd)
        if self.readahead > 0 and relpath in self._main and not self.plan:  # index order
            shard = self._entries[relpath].shard
            ahead = range(shard + 1, shard + 1 + self.readahead)
            self.prefetch(rel for k in ahead for rel in self._by_shard.get(k, ()))
        return self.path(relpath)

    def release(self, relpath: str) -> None:
        """End one :meth:`acquire`'s lease of ``relpath`` (a use, for the LRU order)."""
        if self.is_local:
            return
        self._check_process()
        with self._lock:
            fds = self._leases.get(relpath)
            if not fds:
                raise ValueError(f"{relpath!r} is not acquired")
            fd = fds.pop()
            if not fds:
                del self._leases[relpath]
        with contextlib.suppress(OSError):  # still leased here: cannot have been evicted
            os.utime(self.path(relpath))
        os.close(fd)  # closing the only fd of this open file drops its shared lock

    def release_all(self) -> None:
        """End every lease of this object."""
        self._check_process()
        with self._lock:
            leases, self._leases = self._leases, {}
        for fds in leases.values():
            for fd in fds:
                os.close(fd)

    @contextlib.contextmanager
    def leased(self, relpath: str) -> Iterator[str]:
        """Context manager: ``with cache.leased("shard-00000.data") as path: ...``."""
        path = self.acquire(relpath)
        try:
            yield path
        finally:
            self.release(relpath)

    def pinned(self, relpath: str) -> contextlib.AbstractContextManager[str]:
        """Deprecated name of :meth:`leased`."""
        _deprecated("pinned", "leased")
        return self.leased(relpath)

    def shard_files(self, shard: int) -> list[str]:
        """The files the index lists for ``shard`` (remote datasets only)."""
        return list(self._by_shard.get(shard, ()))

    def prefetch(self, relpaths: Iterable[str]) -> list[Future[None]]:
        """Fetch ``relpaths`` in the background (not leased); returns futures (errors stay there:
        a later :meth:`acquire` of the same file retries and raises)."""
        if self.is_local:
            return []
        self._check_process()
        out: list[Future[None]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("ShardCache is closed")
            if self._pool is None:
                self._pool = DaemonPool(self._prefetch_workers, threading.Event())
                # garbage collection or interpreter exit (atexit) stops it: never waited for
                weakref.finalize(self, self._pool.shutdown)
            for rel in relpaths:
                self._entry(rel)
                fut = self._pending.get(rel)
                if fut is None or fut.done():
                    if os.path.exists(self.path(rel)):
                        continue
                    fut = self._pool.submit(self._prefetch_one, rel)
                    self._pending[rel] = fut
                out.append(fut)
        return out

    def fetch(self, relpaths: Iterable[str], on_wait: Callable[[], None] | None = None) -> None:
        """Make ``relpaths`` local now, in parallel on the prefetch threads (not leased); raises
        the first download error. For a reader about to touch many files at once.
        ``on_wait`` as for :meth:`acquire`."""
        wanted = list(relpaths)
        futures = self.prefetch(wanted)
        for fut in futures:
            try:
                fut.result(timeout=self.timeout_s + self._policy.deadline_s)
            except Exception:  # a prefetch gives up when there is no room: retry here, waiting
                break
        else:
            return
        for rel in wanted:
            self._ensure(rel, lease=False, on_wait=on_wait)

    def pressure_changed(self) -> bool:
        """True if a download (any process) has waited for room since this object last asked.

        One ``stat``; a reader that keeps idle files leased calls it per read and releases them.
        """
        if self.is_local or self.limit_bytes is None:
            return False
        try:
            ns = os.stat(os.path.join(self.cache_dir, _PRESSURE)).st_mtime_ns
        except FileNotFoundError:
            return False
        changed, self._pressure_ns = ns != self._pressure_ns, ns
        return changed

    def leased_files(self) -> list[str]:
        """Relative paths this object currently leases."""
        with self._lock:
            return sorted(self._leases)

    def pinned_files(self) -> list[str]:
        """Deprecated name of :meth:`leased_files`."""
        _deprecated("pinned_files", "leased_files")
        return self.leased_files()

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (no more prefetches; leases may still be taken)."""
        return self._closed

    def close(self, *, wait: bool = True) -> None:
        """Stop prefetching and end every lease of this object.

        Queued prefetches are cancelled and running ones stop waiting for locks. With ``wait``,
        a download already under way is given up to ``deadline_s`` to finish, so no prefetch
        thread writes into the cache directory after this returns.
        """
        self._check_process()
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            leases, self._leases = self._leases, {}
        if pool is not None:
            pool.shutdown(timeout_s=self._policy.deadline_s if wait else 0.0)
        for fds in leases.values():
            for fd in fds:
                os.close(fd)

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as its arguments and index: leases, threads and plan stay here."""
        return {"args": self._args, "index": None if self.is_local else self.index_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._args = state["args"]
        self._setup(state["index"])

    # ---------------------------------------------------------------- internals
    def _entry(self, relpath: str) -> FileEntry:
        try:
            return self._entries[relpath]
        except KeyError:
            url = _remote.join(_remote.redact(self.url, self._options), relpath)
            raise DatasetError(f"{url}: not listed in the index") from None

    def _lock_path(self, relpath: str) -> str:
        return os.path.join(self.dir, _LOCKS, relpath + ".lock")

    def _prefetch_one(self, relpath: str, cancel: threading.Event) -> None:
        try:
            self._ensure(relpath, lease=False, wait_room=False, cancel=cancel)
        except _CancelledError:
            log.debug("prefetch of %s cancelled", relpath)
            raise
        except Exception as exc:
            log.debug("prefetch of %s failed (will retry on use): %s", relpath, exc)
            raise

    def _ensure(
        self,
        relpath: str,
        *,
        lease: bool,
        on_wait: Callable[[], None] | None = None,
        wait_room: bool = True,
        cancel: threading.Event | None = None,
    ) -> int | None:
        """Make ``relpath`` present; return an fd holding its shared lock when ``lease``.

        ``cancel`` (background prefetches) stops the lock waits and any further download.
        """
        entry = self._entry(relpath)
        final = self.path(relpath)
        lock_path = self._lock_path(relpath)
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        what = _remote.join(_remote.redact(self.url, self._options), relpath)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock(fd, fcntl.LOCK_SH, self.timeout_s, what, cancel=cancel)
            downloaded = False

            def present() -> bool:
                try:
                    return os.stat(final).st_size == entry.nbytes
                except FileNotFoundError:
                    return False

            while True:
                if present():
                    os.utime(final)  # least-recently-used order = mtime order
                    if not downloaded:
                        with self._lock:
                            self.stats.hits += 1
                    if lease:
                        return fd
                    os.close(fd)
                    return None
                # not there: take the exclusive lock (never upgrade while holding shared: two
                # upgraders would wait for each other) and download unless someone beat us to it
                fcntl.flock(fd, fcntl.LOCK_UN)
                with self._lock:  # our own lease blocks the exclusive lock: waiting cannot help
                    ours = relpath in self._leases
                if ours:
                    raise DatasetError(
                        f"{what}: its cached copy {final} is missing or changed while this "
                        "process has it leased (was the cache directory cleaned under a reader?)"
                    )
                # another thread or process may download it and lease it meanwhile: its shared
                # lock would block us until it releases, so stop waiting once the file is there
                locked = _flock(
                    fd, fcntl.LOCK_EX, self.timeout_s, what, cancel=cancel, moot=present
                )
                if locked and not present():  # a wrong-sized copy is replaced, never reused
                    if cancel is not None and cancel.is_set():
                        raise _CancelledError(what)
                    self._download(entry, final, on_wait, wait_room, cancel)
                    downloaded = True
                # then re-check: evicted meanwhile?
                _flock(fd, fcntl.LOCK_SH, self.timeout_s, what, cancel=cancel)
        except BaseException:
            os.close(fd)
            raise

    def _download(
        self,
        entry: FileEntry,
        final: str,
        on_wait: Callable[[], None] | None,
        wait_room: bool,
        cancel: threading.Event | None = None,
    ) -> None:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = self._reserve(entry, final, on_wait, wait_room, cancel)
        url = _remote.join(self.url, entry.relpath)
        _remote.fetch_verified(
            self._fs,
            _remote.join(self._root, entry.relpath),
            url,
            final,
            entry,
            storage_options=self._options,
            policy=self._policy,
            tmp=tmp,
        )
        with self._lock:
            self.stats.downloads += 1
            self.stats.bytes_downloaded += entry.nbytes
        log.debug("cached %s (%d bytes)", _remote.redact(url, self._options), entry.nbytes)

    def _reserve(
        self,
        entry: FileEntry,
        final: str,
        on_wait: Callable[[], None] | None = None,
        wait_room: bool = True,
        cancel: threading.Event | None = None,
    ) -> str:
        """Make room for ``entry`` under the cache-wide lock; create its (reserving) temp file."""
        if self.limit_bytes is not None and entry.nbytes > self.limit_bytes:
            raise DatasetError(
                f"{_remote.join(_remote.redact(self.url, self._options), entry.relpath)}: file of "
                f"{entry.nbytes} bytes does not fit the cache limit of {self.limit_bytes} bytes"
            )
        start = time.monotonic()
        rounds = 0
        while True:
            rounds += 1
            fd = os.open(os.path.join(self.cache_dir, _CACHE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _flock(fd, fcntl.LOCK_EX, self.timeout_s, self.cache_dir, cancel=cancel)
                # a prefetch evicts only files needed later than itself (Belady); a read waiting
                # for its file evicts whatever the order puts first
                short = self._scan(entry.nbytes, None if wait_room else entry.relpath)
                if short <= 0:
                    tmp = _remote.temp_name(final, entry.nbytes)
                    open(tmp, "wb").close()
                    return tmp
            finally:
                os.close(fd)
            waited = time.monotonic() - start
            if not wait_room or waited >= self.room_timeout_s:
                raise DatasetError(
                    f"cache {self.cache_dir}: cannot make room for "
                    f"{_remote.join(_remote.redact(self.url, self._options), entry.relpath)} "
                    f"({entry.nbytes} bytes) under the limit of {self.limit_bytes} bytes: the "
                    f"rest is leased by readers (still {short} bytes short after "
                    f"{waited:.1f} s)"
                )
            self._signal_pressure()
            if on_wait is not None:
                on_wait()
            if rounds > 1 or on_wait is None:  # right after on_wait, look again at once
                time.sleep(0.05)

    def _signal_pressure(self) -> None:
        """Tell readers in every process that a download waits for room (see the docstring)."""
        path = os.path.join(self.cache_dir, _PRESSURE)
        try:
            os.utime(path)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                open(path, "ab").close()

    def _scan(self, need: int, incoming: str | None = None) -> int:
        """Remove dead temps; evict files not leased until ``need`` more bytes fit the limit
        (in :meth:`_eviction_order`; for a prefetch of ``incoming``, only files its plan needs
        later than ``incoming``, or not at all when ``incoming`` is not planned either).

        Returns how many bytes are still missing (<= 0: it fits). Call under the cache-wide lock
        (or with ``need=0``, which only removes dead temps and evicts nothing).
        """
        complete: list[tuple[float, int, str, str]] = []  # (mtime, size, path, lock path)
        used = 0
        for key in _listdir(self.cache_dir):
            top = os.path.join(self.cache_dir, key)
            if not _is_version_dir(Path(top)):
                continue  # evict only from the cache's own version folders
            for dirpath, dirnames, files in os.walk(top):
                if dirpath == top and _LOCKS in dirnames:
                    dirnames.remove(_LOCKS)
                for name in files:
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, top)
                    target = _remote.temp_target(name)
                    if target is not None:
                        used += self._stale_or_reserved(top, dirpath, target, path)
                        continue
                    if rel == INDEX_NAME:
                        continue
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    used += st.st_size
                    complete.append(
                        (st.st_mtime, st.st_size, path, os.path.join(top, _LOCKS, rel + ".lock"))
                    )
        if self.limit_bytes is None:
            return 0
        short = used + need - self.limit_bytes
        if need == 0:
            return short
        for _mtime, size, path, lock_path in self._eviction_order(complete, incoming):
            if short <= 0:
                break
            fd = _try_exclusive(lock_path)
            if fd is None:
                continue  # leased by a reader or being (re)downloaded
            try:
                os.unlink(path)
                short -= size
                with self._lock:
                    self.stats.evictions += 1
                log.debug("evicted %s (%d bytes)", path, size)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        return short

    def _eviction_order(
        self, complete: list[tuple[float, int, str, str]], incoming: str | None = None
    ) -> list[tuple[float, int, str, str]]:
        """Complete files, first to evict first: those no planned read uses (this cache's
        :attr:`plan`; every file of other caches), least recently used first; then planned
        ones, the next use farthest away first (Belady). Without a plan: LRU. For a prefetch
        of ``incoming``, only the files needed later than it."""
        if not self.plan:
            return sorted(complete)
        mine = self.dir + os.sep
        rels = {c[2]: os.path.relpath(c[2], self.dir) for c in complete if c[2].startswith(mine)}
        ranks = self.plan.ranks([*rels.values(), *([incoming] if incoming else [])])

        def key(c: tuple[float, int, str, str]) -> tuple[int, float]:
            rel = rels.get(c[2])
            nxt = None if rel is None else ranks[rel]
            return (0, c[0]) if nxt is None else (1, -nxt)

        order = sorted(complete, key=key)
        if incoming is None:
            return order
        mine_next = ranks[incoming]  # None: not planned, so only unplanned files may go

        def later(c: tuple[float, int, str, str]) -> bool:
            rel = rels.get(c[2])
            nxt = None if rel is None else ranks[rel]
            return nxt is None or (mine_next is not None and nxt > mine_next)

        return [c for c in order if later(c)]

    def _stale_or_reserved(
        self, top: str, dirpath: str, target: tuple[str, int, int], path: str
    ) -> int:
        """Bytes reserved by a live download's temp file; a dead downloader's temp is removed."""
        final_name, declared, _pid = target
        rel = os.path.relpath(os.path.join(dirpath, final_name), top)
        fd = _try_exclusive(os.path.join(top, _LOCKS, rel + ".lock"))
        if fd is None:  # its downloader is alive and holds the lock
            try:
                return max(declared, os.path.getsize(path))
            except FileNotFoundError:
                return 0
        try:
            os.unlink(path)
            with self._lock:
                self.stats.stale_temps_removed += 1
            log.info("removed %s left by an interrupted download", path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
        return 0


def _deprecated(old: str, new: str) -> None:
    import warnings

    warnings.warn(
        f"ShardCache.{old} is deprecated: use ShardCache.{new} (a cache file in use is *leased*)",
        DeprecationWarning,
        stacklevel=3,
    )


def _mode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


def _is_version_dir(path: Path) -> bool:
    """A cache version folder: ``cache_dir/<16 hex digits>``, a real directory holding the
    cache's ``.locks`` directory (made with it), or empty (a crash between the two). The name
    alone is no proof: a user's folder named by a commit hash or run id is not the cache's."""
    mode = _mode(path)
    if _VERSION.fullmatch(path.name) is None or mode is None or not stat.S_ISDIR(mode):
        return False
    locks = _mode(path / _LOCKS)
    if locks is not None:
        return stat.S_ISDIR(locks)
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True  # gone meanwhile


def _is_cache_entry(path: Path) -> bool:
    """What a cache writes at the top of its ``cache_dir``: version folders, its lock and
    pressure files, temps (of the ownership marker); an entry gone meanwhile."""
    mode = _mode(path)
    if mode is None:
        return True
    if path.name in (_CACHE_LOCK, _PRESSURE) or _remote.is_temp(path.name):
        return stat.S_ISREG(mode)
    return _is_version_dir(path)


def _claim_cache_dir(cache_dir: str) -> None:
    """The one ownership rule (:func:`feedpipe.io.ownership.claim`): a ``cache_dir`` holding
    anything a cache did not write is refused by name, since eviction deletes files there."""
    try:  # a cache_dir that is a link to a folder (/scratch -> /mnt/nvme) claims that folder
        claim(os.path.realpath(cache_dir), "cache", _is_cache_entry)
    except (ForeignEntriesError, NotADirectoryError, ValueError) as exc:  # ValueError: marker
        raise DatasetError(str(exc)) from None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
