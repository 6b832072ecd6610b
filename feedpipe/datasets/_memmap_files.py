"""Where the shard files of a :class:`~feedpipe.MemmapDataset` are, and what they must be.

:class:`ShardSource` is the dataset folder (local), or the remote dataset's
:class:`feedpipe.cache.ShardCache` (made on first use), plus the index read when the dataset was
opened. It opens (and, remote, downloads and leases) one shard file at a time, reads small files
(offsets, side columns) whole, and states what each role's files must be: one
:class:`~._shard_guard.ShardTable` per role, with the stamps taken when the dataset was opened
and the first-use flags shared with forked workers. Every file of every role is checked by one
rule, :mod:`._shard_guard` (size, the version indexed, the file stamped at open or its CRC32C,
first-use verification, changes while open). It is plain and picklable: a worker unpickles it
and opens its own files (:class:`~._memmap_open.ShardFiles`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from feedpipe.datasets._shard_guard import ShardGuard, ShardTable, SharedFlags, Stamp, stamp_of
from feedpipe.errors import DatasetError
from feedpipe.format import INDEX_NAME, Index, parse_index, read_index
from feedpipe.io.crc import crc32c_file, to_hex
from feedpipe.io.forks import ForkLock
from feedpipe.io.fsutil import read_exactly
from feedpipe.io.remote import local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["VERIFY_MODES", "ShardSource", "verify_files"]

#: ``verify=`` of a dataset: every file checked against its CRC32C when the dataset is opened
#: (``True``), once before its first record is served (``"first-use"``, the default), or never
#: (``False``: a corrupted shard is then read as it is).
VERIFY_MODES: tuple[bool | str, ...] = (True, "first-use", False)

Release = Callable[[], None]


def verify_files(root: str, index: Index) -> Iterator[tuple[str, str]]:
    """Check size and CRC32C of every file; yield ``(relpath, problem)`` for each mismatch."""
    for _sid, rel, nbytes, crc in index.files():
        path = os.path.join(root, rel)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            yield rel, "missing"
            continue
        if size != nbytes:
            yield rel, f"size {size} bytes, index says {nbytes}"
            continue
        got, _ = crc32c_file(path)
        if to_hex(got) != crc:
            yield rel, f"crc32c {to_hex(got)}, index says {crc}"


class ShardSource:
    """A dataset's shard files: where they are, what they must be, one opened or read whole
    (see the module docstring). ``verify`` as :class:`~feedpipe.MemmapDataset` takes it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit_bytes: int | None,
        verify: bool | str,
    ) -> None:
        self.path = os.fspath(path)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.cache_limit_bytes = cache_limit_bytes
        self.storage_options = dict(storage_options or {})
        self.remote = _remote.is_remote(self.path)
        # every message and the repr show this: the URL without its password or signature
        self.shown = _remote.redact(self.path, self.storage_options)
        self.index_raw: bytes | None = None
        self.index_id: tuple[int, int, int] | None = None  # local: index.json as opened
        self.stamps: dict[str, list[Stamp | None]] = {}  # local: every file as stat'ed at open
        self.verified: dict[str, SharedFlags] = {}  # verify="first-use": files checked (shared)
        self._cache: Any = None  # feedpipe.cache.ShardCache of a remote dataset
        self._tables: dict[str, ShardTable] = {}  # per role, made on first use
        # re-entrant: a remote table (under it) makes the cache (under it too); a ForkLock: a
        # child forked while another thread made the cache finds it free
        self._mutex = ForkLock()
        if self.remote:
            # through the retrying path; the cache is then built from these same bytes
            policy = _remote.DEFAULT_POLICY
            fs, root = _remote.resolve(self.path, self.storage_options, policy.deadline_s)
            raw, _ = _remote.read_remote_index(fs, root, self.path, self.storage_options, policy)
            self.index_raw = raw
            self.index = parse_index(raw, _remote.join(self.shown, INDEX_NAME))
        else:
            self.path = self.shown = local_file_path(self.path)
            if not os.path.isdir(self.path):
                raise DatasetError(f"{self.path}: not a feedpipe dataset (not a directory)")
            # before reading it: a rewrite racing the read is then seen as one, never missed
            self.index_id = _file_id(os.path.join(self.path, INDEX_NAME))
            self.index = read_index(self.path)
            self._check_local_files(verify)

    def _check_local_files(self, verify: bool | str) -> None:
        """Sizes of every file (and, ``verify=True``, CRC32Cs); stamps every file for the
        guard, and sets up the first-use flags (shared with forked workers)."""
        n = len(self.index.shards)
        for sid, shard in enumerate(self.index.shards):
            for role, info in shard.files.items():
                path = os.path.join(self.path, info.path)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    raise DatasetError(f"{path}: shard {sid} file is missing") from None
                if st.st_size != info.bytes:
                    raise DatasetError(
                        f"{path}: shard {sid} file is {st.st_size} bytes but the index says "
                        f"{info.bytes} (truncated or modified)"
                    )
                self.stamps.setdefault(role, [None] * n)[sid] = stamp_of(st)
        if verify is True:
            for rel, problem in verify_files(self.path, self.index):
                raise DatasetError(f"{os.path.join(self.path, rel)}: checksum failed: {problem}")
        elif verify == "first-use":
            self.verified = {role: SharedFlags(n) for role in self.stamps}

    # ------------------------------------------------------------------ what files must be
    @property
    def planned(self) -> bool:
        """Whether reads follow the loader's access plan (remote, behind a bounded cache)."""
        return self.remote and self.cache_limit_bytes is not None and self.cache_dir is not None

    def table(self, role: str) -> ShardTable:
        """What shard files of ``role`` must be (see :mod:`._shard_guard`), made once."""
        table = self._tables.get(role)
        if table is None:
            shards = self.index.shards
            version = None
            if self.index_id is not None:  # no reference back to self
                version = functools.partial(_same_version, self.path, self.index_id)
            table = ShardTable(
                [self.local_path(s, role) for s in range(len(shards))],
                [s.files[role].bytes for s in shards],
                [s.files[role].crc32c for s in shards],
                stamps=self.stamps.get(role),
                verified=self.verified.get(role),
                version=version,
            )
            self._tables[role] = table
        return table

    def local_path(self, shard_id: int, role: str) -> str:
        """Where one shard file is (or will be, once fetched into the cache) on this machine."""
        info = self.index.shards[shard_id].files[role]
        if self.remote:
            return str(self.cache().path(info.path))
        return os.path.join(self.path, info.path)

    # ------------------------------------------------------------------ the remote cache
    @property
    def made_cache(self) -> Any:
        """The cache if it was made (it may be closed), else None."""
        return self._cache

    def cache(self) -> Any:
        """The :class:`feedpipe.cache.ShardCache` of a remote dataset (made on first use)."""
        if self.cache_dir is None:
            raise NotImplementedError(
                f"{self.shown}: reading a remote MemmapDataset needs cache_dir=... (lazy "
                "mode) or the staging cache (feedpipe.stage) to a local directory first"
            )
        cache = self._cache
        if cache is not None and not cache.closed:
            return cache
        with self._mutex.lock:  # thread workers' first reads: one cache, not one per thread
            if self._cache is None or self._cache.closed:  # closed by close(): a fresh one
                self._cache = self._make_cache()
            return self._cache

    def _make_cache(self) -> Any:
        from feedpipe.remote.cache import ShardCache

        limit = self.cache_limit_bytes
        sizes = (info.bytes for s in self.index.shards for info in s.files.values())
        biggest = max(sizes, default=0)
        # index-order readahead helps sequential reads; under a tight limit it only evicts
        roomy = limit is None or limit >= 8 * biggest
        return ShardCache(
            self.path,
            self.cache_dir,
            limit,
            self.storage_options,
            readahead=2 if roomy else 0,
            eager_bytes=(1 << 20) if roomy else 0,
            index_bytes=self.index_raw,
        )

    # ------------------------------------------------------------------ one file
    def open(self, sid: int, role: str, on_wait: Release | None = None) -> tuple[int, Release]:
        """Open (and, remote, download and lease) shard ``sid``'s ``role`` file: ``(fd,
        release)``; ``on_wait`` runs while a download waits for room in the cache."""
        info = self.index.shards[sid].files[role]
        release: Release = _noop
        if self.remote:
            cache = self.cache()
            path = cache.acquire(info.path, on_wait=on_wait)
            release = functools.partial(cache.release, info.path)
        else:
            path = os.path.join(self.path, info.path)
        try:  # non-blocking: a FIFO planted in place of a shard must not hang the open
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            release()
            self.check_same_version(sid)  # missing because the dataset is being rewritten?
            raise DatasetError(f"{path}: shard {sid} file is missing") from None
        return fd, release  # checked by the holder's guard (version, size, stamp, CRC32C)

    def read_whole(self, sid: int, role: str, on_wait: Release | None = None) -> bytes:
        """A small shard file (offsets, a side column) read whole and checked as every other
        read (no watch: read once, kept); remote: leased meanwhile."""
        info = self.index.shards[sid].files[role]
        fd, release = self.open(sid, role, on_wait)
        try:
            guard = ShardGuard(self.table(role), watch=False)
            guard.opened(sid, fd)
            data = _pread_exact(fd, info.bytes, 0, self.local_path(sid, role))
            # the bytes kept are the bytes checked: a rewrite after the first use's check (which
            # may have set the once-per-file CRC flag) and before this read is refused too
            guard.verify_bytes(sid, data)
            return data
        finally:
            os.close(fd)
            release()

    def check_same_version(self, sid: int) -> None:
        """Raise if ``index.json`` was replaced or removed since this dataset was opened (see
        :func:`_same_version`); remote datasets read their files through the cache."""
        if self.index_id is not None:
            _same_version(self.path, self.index_id, sid)

    # ------------------------------------------------------------------ lifetime
    def close(self, wait: bool) -> None:
        """End the cache's leases and stop its prefetches (it reopens on the next read)."""
        if self._cache is not None:
            self._cache.close(wait=wait)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tables"] = {}
        state["_mutex"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mutex = ForkLock()


def _pread_exact(fd: int, nbytes: int, offset: int, path: str) -> bytes:
    data = read_exactly(fd, nbytes, offset)
    if len(data) != nbytes:
        raise DatasetError(f"{path}: short read (got {len(data)} of {nbytes} bytes)")
    return data


def _noop() -> None:
    return None


def _same_version(root: str, index_id: tuple[int, int, int], sid: int) -> None:
    """Raise unless ``index.json`` under ``root`` is still the file ``index_id`` describes: a
    dataset being rewritten (index removed first, written last), and shard ``sid`` opened now
    may be the new version's, of the same size, which the old index would read as wrong
    records, silently. Called after the shard's file is open, so that file is the old one."""
    if _file_id(os.path.join(root, INDEX_NAME)) != index_id:
        raise DatasetError(
            f"{root}: the dataset was rewritten since it was opened ({INDEX_NAME} replaced or "
            f"removed), so shard {sid} cannot be read with the index it was opened with; open "
            "the dataset again"
        )


def _file_id(path: str) -> tuple[int, int, int] | None:
    """``(device, inode, mtime_ns)`` of a file, None if it is missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns
