"""Writing a data file: its bytes in large ``pwrite``s, one CRC32C per chunk, fsynced, and the
record (name, size, chunk size, CRC32Cs) that the manifest keeps of it. ``write_file`` writes a
whole buffer at once; ``ChunkedWriter`` takes the bytes piece by piece (a DCP writer)."""

from __future__ import annotations

import errno
import os
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt import _faults
from ckpt.format.limits import CHUNK_BYTES
from feedpipe.io import crc32c, to_hex
from feedpipe.io.trace import span

__all__ = ["ChunkedWriter", "file_record", "pwrite_all", "write_file"]


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (``pwrite`` may write less at a time)."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def file_record(name: str, size: int, chunk_bytes: int, crcs: list[str]) -> dict[str, Any]:
    """A data file's manifest record."""
    return {"name": name, "size": size, "chunk_bytes": chunk_bytes, "crc32c": crcs}


def _reserve(fd: int, size: int) -> None:
    """Reserve the space first: a full disk fails here, before any data is written."""
    if not size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def write_file(
    path: str | os.PathLike[str],
    data: memoryview,
    executor: Executor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, Any]:
    """Write ``data`` to ``path`` in large pwrites (chunks checksummed and written in parallel on
    ``executor``), fsync it and return its manifest record (name, size, chunk size, CRC32Cs)."""
    size = len(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    own = executor is None
    pool = executor or ThreadPoolExecutor(2, thread_name_prefix="ckpt-write")
    try:
        _reserve(fd, size)
        _faults.pause("write")

        def one(start: int) -> str:
            piece = data[start : start + chunk_bytes]
            with span("ckpt/write"):  # in the write pool's thread
                crc = crc32c(piece)
                pwrite_all(fd, piece, start)
            return to_hex(crc)

        crcs = list(pool.map(one, range(0, size, chunk_bytes)))
        _faults.pause("fsync")
        with span("ckpt/fsync"):
            os.fsync(fd)
    finally:
        os.close(fd)
        if own:
            pool.shutdown()
    return file_record(Path(path).name, size, chunk_bytes, crcs)


class ChunkedWriter:
    """Appends pieces to a new data file with ``pwrite``, keeping one running CRC32C per chunk
    (the streaming counterpart of ``write_file``, for writers that get their bytes piece by
    piece, such as a DCP ``StorageWriter``). ``close`` fsyncs and returns the file's record."""

    def __init__(self, path: Path, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path, self.chunk = path, chunk_bytes
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.size, self.crc = 0, 0
        self.crcs: list[str] = []

    def write(self, view: memoryview) -> None:
        """Append ``view``."""
        while view:
            room = self.chunk - self.size % self.chunk
            piece, view = view[:room], view[room:]
            pwrite_all(self.fd, piece, self.size)
            self.crc = crc32c(piece, self.crc)
            self.size += len(piece)
            if self.size % self.chunk == 0:
                self.crcs.append(to_hex(self.crc))
                self.crc = 0

    def pad(self, align: int) -> None:
        """Append zero bytes up to the next multiple of ``align``."""
        extra = -self.size % align
        if extra:
            self.write(memoryview(bytes(extra)))

    def close(self) -> dict[str, Any]:
        """Fsync and close the file; return its manifest record (as ``write_file`` does)."""
        try:
            if self.size % self.chunk:
                self.crcs.append(to_hex(self.crc))
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return file_record(self.path.name, self.size, self.chunk, self.crcs)
