"""The shard files of a :class:`~feedpipe.MemmapDataset` (a mixin): where each one is (the
dataset folder, or the remote dataset's :class:`feedpipe.cache.ShardCache`), opening them per
process (:mod:`._memmap_open`) or mapping every shard of a local fixed-record dataset into one
range (:mod:`._gather`), offsets and side columns read whole. Every file of every role is
checked by one rule, :mod:`._shard_guard` (size, the version indexed, the file stamped at open
or its CRC32C, first-use verification, changes while open); this module builds each role's
:class:`~._shard_guard.ShardTable` and hands a guard to whatever opens the files.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from feedpipe.datasets._gather import ShardSpace, map_budget
from feedpipe.datasets._memmap_open import OpenShard, OpenShards
from feedpipe.datasets._shard_guard import ShardGuard, ShardTable, SharedFlags, Stamp, stamp_of
from feedpipe.datasets.format import INDEX_NAME, FileInfo, Index
from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c_file, to_hex
from feedpipe.io.fsutil import read_exactly

__all__ = ["VERIFY_MODES", "ShardFiles", "verify_files"]

#: ``verify=`` of a dataset: every file checked against its CRC32C when the dataset is opened
#: (``True``), once before its first record is served (``"first-use"``, the default), or never
#: (``False``: a corrupted shard is then read as it is).
VERIFY_MODES: tuple[bool | str, ...] = (True, "first-use", False)
_PREAD_IDLE = 64  # descriptors kept open per role by read="pread" (the rest closed, LRU)


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


class ShardFiles:
    """Locating, opening, mapping and checking the shard files (see the module docstring)."""

    path: str
    index: Index
    kind: str
    read: str
    fields: dict[str, Any]
    storage_options: dict[str, Any]
    cache_dir: str | None
    cache_limit_bytes: int | None
    _remote: bool
    _shown: str
    _index_raw: bytes | None
    _index_id: tuple[int, int, int] | None
    _starts: np.ndarray
    _record_bytes: int
    _cache: Any
    _files: OpenShards | None
    _space: ShardSpace | bool | None
    _role_files: dict[str, OpenShards]
    _offsets_of: dict[int, np.ndarray]
    _columns: dict[str, np.ndarray]
    _open_lock: threading.RLock
    _stamps: dict[str, list[Stamp | None]]
    _verified: dict[str, SharedFlags]
    _tables: dict[str, ShardTable]

    @staticmethod
    def _index_file_id(root: str) -> tuple[int, int, int] | None:
        """What :meth:`_check_same_version` compares with: ``index.json`` as it is now."""
        return _file_id(os.path.join(root, INDEX_NAME))

    def _check_local_files(self, verify: bool | str) -> None:
        """Sizes of every file (and, ``verify=True``, CRC32Cs); stamps every file for the
        guard, and sets up the first-use flags (shared with forked workers)."""
        n = len(self.index.shards)
        self._stamps = {}
        for sid, shard in enumerate(self.index.shards):
            for role, info in shard.files.items():
                path = os.path.join(self.path, info.path)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    raise DatasetError(f"{path}: shard {sid} file is missing") from None
                self._check_size(path, info, sid, st.st_size)
                self._stamps.setdefault(role, [None] * n)[sid] = stamp_of(st)
        if verify is True:
            for rel, problem in verify_files(self.path, self.index):
                raise DatasetError(f"{os.path.join(self.path, rel)}: checksum failed: {problem}")
        elif verify == "first-use":
            self._verified = {role: SharedFlags(n) for role in self._stamps}

    def _table(self, role: str) -> ShardTable:
        """What shard files of ``role`` must be (see :mod:`._shard_guard`), made once."""
        table = self._tables.get(role)
        if table is None:
            shards = self.index.shards
            paths = [self._local_path(s, role) for s in range(len(shards))]
            sizes = [s.files[role].bytes for s in shards]
            crcs = [s.files[role].crc32c for s in shards]
            version = None
            if self._index_id is not None:  # no reference back to self
                version = functools.partial(_same_version, self.path, self._index_id)
            table = ShardTable(
                paths,
                sizes,
                crcs,
                stamps=self._stamps.get(role),
                verified=self._verified.get(role),
                version=version,
            )
            self._tables[role] = table
        return table

    def _guard(self, role: str) -> ShardGuard:
        """A new guard (one per process and holder) over ``role``'s files."""
        return ShardGuard(self._table(role))

    def _role_opener(self, role: str) -> OpenShards:
        """A fresh holder of ``role``'s open files for this process (see :mod:`._memmap_open`)."""
        sizes = [s.files[role].bytes if role in s.files else 0 for s in self.index.shards]
        limit = self.cache_limit_bytes if self._remote else None
        pread = role == "data" and self.kind == "fixed" and self.read == "pread"
        shards = self.index.shards
        has = bool(shards) and role in shards[0].files  # no data files: records=False
        return OpenShards(
            lambda sid: self._open_data(sid, role),
            sizes,
            None if limit is None else limit // 3,
            guard=self._guard(role) if has else None,
            mapped=not pread,
            idle_count=_PREAD_IDLE if pread else max(64, map_budget() // 8),
        )

    @staticmethod
    def _check_size(path: str, info: FileInfo, sid: int, size: int | None = None) -> None:
        if size is None:
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise DatasetError(f"{path}: shard {sid} file is missing") from None
        if size != info.bytes:
            raise DatasetError(
                f"{path}: shard {sid} file is {size} bytes but the index says {info.bytes} "
                "(truncated or modified)"
            )

    def _local_path(self, shard_id: int, role: str) -> str:
        """Where one shard file is (or will be, once fetched into the cache) on this machine."""
        info = self.index.shards[shard_id].files[role]
        if self._remote:
            return str(self._shard_cache().path(info.path))
        return os.path.join(self.path, info.path)

    def _shard_cache(self) -> Any:
        """The :class:`feedpipe.cache.ShardCache` of a remote dataset (made on first use)."""
        if self.cache_dir is None:
            raise NotImplementedError(
                f"{self._shown}: reading a remote MemmapDataset needs cache_dir=... (lazy "
                "mode) or the staging cache (feedpipe.stage) to a local directory first"
            )
        cache = self._cache
        if cache is not None and not cache.closed:
            return cache
        with self._open_lock:  # thread workers' first reads: one cache, not one per thread
            return self._make_cache()

    def _make_cache(self) -> Any:
        if self._cache is None or self._cache.closed:  # closed by close(): a fresh one
            from feedpipe.remote.cache import ShardCache

            limit = self.cache_limit_bytes
            biggest = max((info.bytes for _s, _r, info in self._shard_files()), default=0)
            # index-order readahead helps sequential reads; under a tight limit it only evicts
            roomy = limit is None or limit >= 8 * biggest
            self._cache = ShardCache(
                self.path,
                self.cache_dir,
                limit,
                self.storage_options,
                readahead=2 if roomy else 0,
                eager_bytes=(1 << 20) if roomy else 0,
                index_bytes=self._index_raw,
            )
        return self._cache

    def _shard_files(self) -> Iterator[tuple[int, str, FileInfo]]:
        for sid, shard in enumerate(self.index.shards):
            for role, info in shard.files.items():
                yield sid, role, info

    def _open_files(self) -> OpenShards:
        """This process's open shard data files (rebuilt after a fork or unpickling)."""
        files = self._files
        if files is not None and files.pid == os.getpid():
            return files
        with self._open_lock:
            files = self._files
            if files is None or files.pid != os.getpid():
                files = self._files = self._role_opener("data")
                self._role_files = {}
        return files

    def _shard_space(self) -> ShardSpace | None:
        """This process's one-range map of every shard (:mod:`feedpipe.datasets._gather`), or
        ``None`` where batches are read shard by shard (remote, ``read="pread"``, bytes layout,
        more shards than the map budget)."""
        space = self._space
        if isinstance(space, ShardSpace) and space.pid == os.getpid():
            return space
        if space is False:
            return None
        with self._open_lock:
            space = self._space
            if isinstance(space, ShardSpace) and space.pid != os.getpid():
                space.forget()  # a forked child: the parent's maps, no other thread here
                space = None
            if space is None:
                if not self._remote and self.kind == "fixed" and self.read != "pread":
                    guard = self._guard("data")
                    space = ShardSpace.create(guard, self._starts, self._record_bytes)
                self._space = space if space is not None else False
        return space if isinstance(space, ShardSpace) else None

    def _open_data(self, sid: int, role: str = "data") -> tuple[int, Any]:
        """Open (and, remote, download and lease) shard ``sid``'s data file: ``(fd, release)``."""
        info = self.index.shards[sid].files[role]
        release: Any = _noop
        if self._remote:
            cache = self._shard_cache()
            path = cache.acquire(info.path, on_wait=self._release_idle)

            def release() -> None:
                cache.release(info.path)
        else:
            path = os.path.join(self.path, info.path)
        try:  # non-blocking: a FIFO planted in place of a shard must not hang the open
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            release()
            self._check_same_version(sid)  # missing because the dataset is being rewritten?
            raise DatasetError(f"{path}: shard {sid} file is missing") from None
        return fd, release  # checked by the holder's guard (version, size, stamp, CRC32C)

    def _release_idle(self) -> None:
        files = self._files
        if files is not None and files.pid == os.getpid():
            files.release_idle()
            for other in list(self._role_files.values()):
                other.release_idle()

    def _read_whole(self, sid: int, role: str) -> bytes:
        """A small shard file (offsets, a side column) read whole; remote: pinned meanwhile."""
        info = self.index.shards[sid].files[role]
        if self._remote:
            cache = self._shard_cache()
            with contextlib.ExitStack() as stack:
                path = cache.acquire(info.path, on_wait=self._release_idle)
                stack.callback(cache.release, info.path)
                return self._read_file(path, info, sid, role)
        return self._read_file(os.path.join(self.path, info.path), info, sid, role)

    def _read_file(self, path: str, info: FileInfo, sid: int, role: str) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            self._check_same_version(sid)
            raise DatasetError(f"{path}: shard {sid} file is missing") from None
        try:  # one read whole is checked as every other read (no watch: read once, kept)
            ShardGuard(self._table(role), watch=False).opened(sid, fd)
            return _pread_exact(fd, info.bytes, 0, path)
        finally:
            os.close(fd)

    def _check_same_version(self, sid: int) -> None:
        """Raise if ``index.json`` was replaced or removed since this dataset was opened (see
        :func:`_same_version`); remote datasets read their files through the cache."""
        if self._index_id is not None:
            _same_version(self.path, self._index_id, sid)

    def _rows(self, shard: OpenShard) -> np.ndarray:
        """The shard's data mapped read-only: ``(records, record_bytes)`` uint8 (fixed)."""
        rb = self._record_bytes if self.kind == "fixed" else 0
        return self._open_files().rows(shard, rb)

    def _offsets(self, sid: int) -> np.ndarray:
        off = self._offsets_of.get(sid)
        if off is None:
            shard = self.index.shards[sid]
            raw = self._read_whole(sid, "offsets")
            off = np.frombuffer(raw, dtype="<u8").astype(np.int64)
            data_bytes = shard.files["data"].bytes
            if (
                len(off) != shard.records + 1
                or off[0] != 0
                or off[-1] != data_bytes
                or np.any(np.diff(off) < 0)
            ):
                raise DatasetError(
                    f"{self._local_path(sid, 'offsets')}: shard {sid} offsets are corrupt "
                    f"(first {off[0]}, last {off[-1]}, data file {data_bytes} bytes)"
                )
            self._offsets_of[sid] = off
        return off

    def _column(self, name: str) -> np.ndarray:
        """A side field for all records, concatenated over shards (small; kept in memory)."""
        col = self._columns.get(name)
        if col is None:
            spec = self.fields[name]
            parts = []
            for sid in range(len(self.index.shards)):
                raw = self._read_whole(sid, f"field.{name}")
                parts.append(np.frombuffer(raw, dtype=spec.dtype).reshape(-1, *spec.shape))
            col = np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)
            self._columns[name] = col
        return col


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
