"""The shard files of a :class:`~feedpipe.MemmapDataset` (a mixin): where each one is (the
dataset folder, or the remote dataset's :class:`feedpipe.cache.ShardCache`), opening them per
process (:mod:`._memmap_open`) or mapping every shard of a local fixed-record dataset into one
range (:mod:`._gather`), and the checks on the way: sizes against the index, the dataset not
rewritten since it was opened (``index.json`` replaced or removed), offsets and side columns
read whole.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from feedpipe.datasets._gather import ShardSpace
from feedpipe.datasets._memmap_open import OpenShard, OpenShards
from feedpipe.datasets.format import INDEX_NAME, FileInfo, Index
from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c_file, to_hex

__all__ = ["ShardFiles", "verify_files"]


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
    _pool: ThreadPoolExecutor | None
    _role_files: dict[str, OpenShards]
    _offsets_of: dict[int, np.ndarray]
    _columns: dict[str, np.ndarray]
    _open_lock: threading.Lock

    @staticmethod
    def _index_file_id(root: str) -> tuple[int, int, int] | None:
        """What :meth:`_check_same_version` compares with: ``index.json`` as it is now."""
        return _file_id(os.path.join(root, INDEX_NAME))

    def _check_local_files(self, verify: bool) -> None:
        for sid, shard in enumerate(self.index.shards):
            for info in shard.files.values():
                self._check_size(os.path.join(self.path, info.path), info, sid)
        if verify:
            for rel, problem in verify_files(self.path, self.index):
                raise DatasetError(f"{os.path.join(self.path, rel)}: checksum failed: {problem}")

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
                sizes = [
                    s.files["data"].bytes if "data" in s.files else 0 for s in self.index.shards
                ]
                limit = self.cache_limit_bytes if self._remote else None
                files = self._files = OpenShards(
                    self._open_data, sizes, None if limit is None else limit // 3
                )
                self._pool = None
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
                    paths = [self._local_path(s, "data") for s in range(len(self.index.shards))]
                    sizes = [s.files["data"].bytes for s in self.index.shards]
                    space = ShardSpace.create(paths, sizes, self._starts, self._record_bytes)
                    if space is not None:
                        space.crcs = [s.files["data"].crc32c for s in self.index.shards]
                        if self._index_id is not None:  # no reference back to self
                            space.opened = functools.partial(
                                _same_version, self.path, self._index_id
                            )
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
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            release()
            self._check_same_version(sid)  # missing because the dataset is being rewritten?
            raise DatasetError(f"{path}: shard {sid} file is missing") from None
        try:
            self._check_same_version(sid)  # after the open: the file is the version indexed
            self._check_size(path, info, sid, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            release()
            raise
        return fd, release

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
                return self._read_file(path, info, sid)
        return self._read_file(os.path.join(self.path, info.path), info, sid)

    def _read_file(self, path: str, info: FileInfo, sid: int) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._check_same_version(sid)
            raise DatasetError(f"{path}: shard {sid} file is missing") from None
        try:
            self._check_same_version(sid)
            self._check_size(path, info, sid, os.fstat(fd).st_size)
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

    def _check_mapped(self, shard: OpenShard, role: str = "data") -> None:
        sid = shard.sid
        info = self.index.shards[sid].files[role]
        size = os.fstat(shard.fd).st_size
        if size != info.bytes:
            raise DatasetError(
                f"{self._local_path(sid, role)}: shard {sid} file is now {size} bytes but the "
                f"index says {info.bytes} (truncated or modified while open)"
            )

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
    data = os.pread(fd, nbytes, offset)
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
