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
* nothing is written or removed through a symlink: every create, rename, unlink and lock file in
  a version folder goes through its directories opened once, each level with ``O_NOFOLLOW``
  (:mod:`feedpipe.io.dirfd`), so a folder swapped for a link meanwhile is refused by name
  (:class:`~feedpipe.DatasetError`) or written in the folder that was opened, never through the
  link; a cached copy that is a link is never served, but replaced.

A local path or ``file://`` URL is not cached: files are read in place and never evicted.
Each dataset version gets its own subdirectory (keyed by URL and index checksum), so a rewritten
remote dataset never mixes with stale files.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.io.dirfd import Dir, UnsafePathError
from feedpipe.remote import transfer as _remote
from feedpipe.remote.cache_index import CacheIndex
from feedpipe.remote.cache_space import (
    LOCKS,
    CacheSpace,
    claim_cache_dir,
    open_version,
    unsafe_error,
    version_tree,
)
from feedpipe.remote.leases import Leases
from feedpipe.remote.locks import WaitCancelledError, flock_wait, lock_at
from feedpipe.remote.plan import AccessPlan
from feedpipe.remote.prefetch_pool import Prefetcher
from feedpipe.remote.transfer import FileEntry

__all__ = ["CacheStats", "ShardCache"]

log = logging.getLogger("feedpipe.cache")


@dataclass
class CacheStats:
    """Counters of one :class:`ShardCache` object (this process only)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    stale_temps_removed: int = 0


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
        self.stats = CacheStats()
        self.limit_bytes: int | None = a["limit_bytes"]
        self.timeout_s: float = a["timeout_s"]
        self.room_timeout_s: float = a["room_timeout_s"]
        self.readahead: int = a["readahead"]
        self._options: dict[str, Any] = a["options"]
        self._policy = _remote.RetryPolicy(deadline_s=a["deadline_s"])
        self._reset_process_state()
        self.is_local = not _remote.is_remote(self.url)
        self._fs, self._root = _remote.resolve(self.url, self._options, a["deadline_s"])
        if self.is_local:
            self.dir = self._root
            self._entries: dict[str, FileEntry] = {}
            return
        self._open_remote(a["cache_dir"], raw_index)
        self._space.scan(0, self.dir, self.plan)  # removes temps left by crashed downloaders
        eager = self._index.eager(a["eager_bytes"], self.limit_bytes)
        if eager:
            self.prefetch(eager)

    def _open_remote(self, cache_dir: str | None, raw_index: bytes | None) -> None:
        """The index, the cache directory (claimed), its space and this version's folder."""
        if cache_dir is None:
            raise ValueError(
                f"{_remote.redact(self.url, self._options)}: a remote dataset needs cache_dir"
            )
        if self.limit_bytes is not None and self.limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {self.limit_bytes}")
        self.cache_dir = os.path.abspath(cache_dir)
        claim_cache_dir(self.cache_dir)
        self._index = CacheIndex.load(
            self._fs,
            self._root,
            self.url,
            self._options,
            self._policy,
            raw=raw_index,
            reserved=LOCKS,
        )
        self.index_bytes = self._index.raw
        self._entries = self._index.entries
        self._space = CacheSpace(
            self.cache_dir, self.limit_bytes, self.timeout_s, self.room_timeout_s, self._count
        )
        # the version folder held open: every write into it goes through this tree
        self._tree = open_version(self.cache_dir, self.url, self.index_bytes, self.timeout_s)
        self.dir = self._tree.path

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._leases = Leases()
        #: the reads to come (empty: least-recently-used eviction); per process
        self.plan = AccessPlan()
        self._lock = threading.Lock()
        self._prefetcher = Prefetcher(self._args["prefetch_workers"], self._prefetch_one)
        self._pressure_ns = 0

    def _check_process(self) -> None:
        """After a fork: drop the parent's leases (its own fds keep its locks), thread pool and
        plan."""
        if self._pid != os.getpid():
            self._leases.forget()
            self._reset_process_state()
            if not self.is_local:  # s3fs and other async filesystems are not fork-safe
                self._fs, self._root = _remote.resolve(
                    self.url, self._options, self._policy.deadline_s
                )  # and a parent's thread may have held the tree's lock at the fork
                self._tree = version_tree(self.cache_dir, os.path.basename(self.dir))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

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
        self._leases.add(relpath, fd)
        if self.readahead > 0 and relpath in self._index.main and not self.plan:  # index order
            self.prefetch(self._index.ahead(relpath, self.readahead))
        return self.path(relpath)

    def release(self, relpath: str) -> None:
        """End one :meth:`acquire`'s lease of ``relpath`` (a use, for the LRU order)."""
        if self.is_local:
            return
        self._check_process()
        fd = self._leases.pop(relpath)
        with contextlib.suppress(OSError):  # still leased here: cannot have been evicted
            where, name = self._tree.parent(relpath)
            where.touch(name)
        os.close(fd)  # closing the only fd of this open file drops its shared lock

    def release_all(self) -> None:
        """End every lease of this object."""
        self._check_process()
        self._leases.end_all()

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
        return self._index.shard_files(shard)

    def prefetch(self, relpaths: Iterable[str]) -> list[Future[None]]:
        """Fetch ``relpaths`` in the background (not leased); returns futures (errors stay there:
        a later :meth:`acquire` of the same file retries and raises)."""
        if self.is_local:
            return []
        self._check_process()
        listed = (self._index.entry(rel).relpath for rel in relpaths)
        return self._prefetcher.submit(listed, lambda rel: os.path.exists(self.path(rel)))

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
        ns = self._space.pressure_ns()
        if ns is None:
            return False
        changed, self._pressure_ns = ns != self._pressure_ns, ns
        return changed

    def leased_files(self) -> list[str]:
        """Relative paths this object currently leases."""
        return self._leases.files()

    def pinned_files(self) -> list[str]:
        """Deprecated name of :meth:`leased_files`."""
        _deprecated("pinned_files", "leased_files")
        return self.leased_files()

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (no more prefetches; leases may still be taken)."""
        return self._prefetcher.closed

    def close(self, *, wait: bool = True) -> None:
        """Stop prefetching and end every lease of this object.

        Queued prefetches are cancelled and running ones stop waiting for locks. With ``wait``,
        a download already under way is given up to ``deadline_s`` to finish, so no prefetch
        thread writes into the cache directory after this returns.
        """
        self._check_process()
        self._prefetcher.close(self._policy.deadline_s if wait else 0.0)
        self._leases.end_all()

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
    def _lock_path(self, relpath: str) -> str:
        """Where ``relpath``'s lock file is (another process locks the same file)."""
        return os.path.join(self.dir, LOCKS, relpath + ".lock")

    def _open_lock(self, relpath: str) -> int:
        """The fd of ``relpath``'s lock file, opened (made) through the version folder's tree."""
        try:
            return lock_at(*self._tree.parent(f"{LOCKS}/{relpath}.lock", create=True))
        except UnsafePathError as exc:
            raise unsafe_error(exc) from None

    def _dest(self, relpath: str) -> tuple[Dir, str]:
        """The open directory of ``relpath`` (made if missing) and its name there."""
        try:
            return self._tree.parent(relpath, create=True)
        except UnsafePathError as exc:
            raise unsafe_error(exc) from None

    def _prefetch_one(self, relpath: str, cancel: threading.Event) -> None:
        try:
            self._ensure(relpath, lease=False, wait_room=False, cancel=cancel)
        except WaitCancelledError:
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
        entry = self._index.entry(relpath)
        final = self.path(relpath)
        what = self._index.name(relpath)
        fd = self._open_lock(relpath)
        try:
            dest = self._dest(relpath)
            flock_wait(fd, fcntl.LOCK_SH, self.timeout_s, what, cancel=cancel)
            downloaded = False
            while not _present(entry, dest):
                # not there: take the exclusive lock (never upgrade while holding shared: two
                # upgraders would wait for each other) and download unless someone beat us to it
                fcntl.flock(fd, fcntl.LOCK_UN)
                if self._leases.holds(relpath):  # our own lease blocks the exclusive lock
                    raise DatasetError(
                        f"{what}: its cached copy {final} is missing or changed while this "
                        "process has it leased (was the cache directory cleaned under a reader?)"
                    )
                downloaded |= self._download_locked(fd, entry, dest, on_wait, wait_room, cancel)
                # then re-check: evicted meanwhile?
                flock_wait(fd, fcntl.LOCK_SH, self.timeout_s, what, cancel=cancel)
            dest[0].touch(dest[1])  # least-recently-used order = mtime order
        except BaseException:
            os.close(fd)
            raise
        if not downloaded:
            self._count("hits")
        if lease:
            return fd
        os.close(fd)
        return None

    def _download_locked(  # noqa: PLR0917 - _ensure's own arguments, passed on
        self,
        fd: int,
        entry: FileEntry,
        dest: tuple[Dir, str],
        on_wait: Callable[[], None] | None,
        wait_room: bool,
        cancel: threading.Event | None,
    ) -> bool:
        """Take ``fd``'s exclusive lock and download ``entry`` unless it appeared meanwhile;
        True when this call downloaded it."""
        what = self._index.name(entry.relpath)
        # another thread or process may download it and lease it meanwhile: its shared
        # lock would block us until it releases, so stop waiting once the file is there
        locked = flock_wait(
            fd,
            fcntl.LOCK_EX,
            self.timeout_s,
            what,
            cancel=cancel,
            moot=lambda: _present(entry, dest),
        )
        if not locked or _present(entry, dest):  # a wrong-sized copy (or a link) is replaced
            return False
        if cancel is not None and cancel.is_set():
            raise WaitCancelledError(what)
        tmp = self._space.reserve(
            entry,
            dest,
            self.dir,
            what,
            self.plan,
            on_wait=on_wait,
            wait_room=wait_room,
            cancel=cancel,
        )
        url = _remote.join(self.url, entry.relpath)
        try:
            _remote.fetch_verified(
                self._fs,
                _remote.join(self._root, entry.relpath),
                url,
                dest,
                entry,
                storage_options=self._options,
                policy=self._policy,
                tmp=tmp,
            )
        except UnsafePathError as exc:  # its folder was swapped or removed meanwhile
            raise unsafe_error(exc) from None
        with self._lock:
            self.stats.downloads += 1
            self.stats.bytes_downloaded += entry.nbytes
        log.debug("cached %s (%d bytes)", _remote.redact(url, self._options), entry.nbytes)
        return True


def _present(entry: FileEntry, dest: tuple[Dir, str]) -> bool:
    """Whether the cached copy is there: a regular file (never a link) of the indexed size."""
    st = dest[0].stat(dest[1])
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_size == entry.nbytes


def _deprecated(old: str, new: str) -> None:
    import warnings

    warnings.warn(
        f"ShardCache.{old} is deprecated: use ShardCache.{new} (a cache file in use is *leased*)",
        DeprecationWarning,
        stacklevel=3,
    )
