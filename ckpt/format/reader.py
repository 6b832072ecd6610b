"""Reading a data file back, verified: its size against its record first (before anything is
allocated by that claim), then chunk by chunk into the caller's byte ranges, each chunk's
CRC32C compared with the record's when asked. A ``ChunkStream`` reads one file; any number of
threads may call its ``read`` for different chunks."""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format.limits import IO_BYTES
from ckpt.format.paths import inside, open_data
from feedpipe.io import crc32c, readinto_exactly, to_hex
from feedpipe.io.futures import results_or_first_error

__all__ = ["ChunkStream", "Target", "check_file", "stream_file", "verify_file"]

Target = tuple[int, torch.Tensor]
"""Where one entry's bytes go: (its offset in the data file, a uint8 tensor of its bytes)."""


def _check_size(path: Path, rec: dict[str, Any], fd: int) -> None:
    size = os.fstat(fd).st_size
    if size != rec["size"]:
        raise CorruptCheckpointError(f"{path}: size {size} != {rec['size']} bytes (truncated?)")


def check_file(directory: Path, rec: dict[str, Any]) -> None:
    """Check that a data file exists with exactly the size its record claims (before any
    allocation sized by that claim)."""
    path = inside(directory, rec["name"])
    fd = open_data(path)
    try:
        _check_size(path, rec, fd)
    finally:
        os.close(fd)


def _read_exact(fd: int, piece: memoryview, pos: int, path: Path) -> None:
    got = readinto_exactly(fd, [piece], pos, len(piece))
    if got < len(piece):
        raise CorruptCheckpointError(f"{path}: unexpected end of file at byte {pos + got}")


class ChunkStream:
    """One open data file read chunk by chunk into ``targets`` (non-overlapping byte ranges;
    CPU or CUDA tensors). Each read is at most ``IO_BYTES`` into a buffer per calling thread,
    so the extra host memory is one such buffer per thread, whatever the file claims."""

    def __init__(
        self, fd: int, path: Path, rec: dict[str, Any], targets: Sequence[Target], verify: bool
    ) -> None:
        self.fd, self.path, self.rec, self.verify = fd, path, rec, verify
        self.order = sorted((t for t in targets if t[1].numel()), key=lambda t: t[0])
        self.starts = [off for off, _ in self.order]
        self.chunk, self.size = rec["chunk_bytes"], rec["size"]
        self._local = threading.local()

    @property
    def chunks(self) -> range:
        """The chunk numbers of the file."""
        return range(len(self.rec["crc32c"]))

    def _scratch(self) -> memoryview:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = memoryview(bytearray(max(1, min(IO_BYTES, self.chunk, self.size))))
            self._local.buf = buf
        return buf

    def read(self, i: int) -> float:
        """Read chunk ``i`` into the targets it overlaps (checked if ``verify``); return the
        seconds spent checksumming."""
        scratch = self._scratch()
        lo, hi = i * self.chunk, min((i + 1) * self.chunk, self.size)
        value, crc_s = 0, 0.0
        for pos in range(lo, hi, len(scratch)):
            piece = scratch[: min(len(scratch), hi - pos)]
            _read_exact(self.fd, piece, pos, self.path)
            if self.verify:
                t0 = time.perf_counter()
                value = crc32c(piece, value)
                crc_s += time.perf_counter() - t0
            self._scatter(pos, piece)
        want = self.rec["crc32c"][i]
        if self.verify and to_hex(value) != want:
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch in chunk {i} (bytes {lo}-{hi}): "
                f"{to_hex(value)} != {want}"
            )
        return crc_s

    def _scatter(self, pos: int, piece: memoryview) -> None:
        """Copy the bytes ``[pos, pos + len(piece))`` of the file into the targets they overlap."""
        end = pos + len(piece)
        j = max(0, bisect.bisect_right(self.starts, pos) - 1)
        src: torch.Tensor | None = None
        while j < len(self.order) and self.order[j][0] < end:
            off, dst = self.order[j]
            a, b = max(pos, off), min(end, off + dst.numel())
            if a < b:
                if src is None:
                    src = torch.frombuffer(piece, dtype=torch.uint8)
                dst[a - off : b - off].copy_(src[a - pos : b - pos])
            j += 1


def _read_all(stream: ChunkStream, executor: Executor) -> float:
    """Every chunk of ``stream`` on ``executor``; after a bad chunk, none further is read, and
    every read is over before this returns (the fd is then closed and its number reused)."""
    return sum(results_or_first_error([executor.submit(stream.read, i) for i in stream.chunks]))


def stream_file(
    directory: Path,
    rec: dict[str, Any],
    targets: Sequence[Target],
    verify: bool,
    executor: Executor | None,
) -> float:
    """Read a data file chunk by chunk into ``targets`` (a ``ChunkStream``), checking its size
    first and, if ``verify``, every chunk's CRC32C. Returns the seconds spent checksumming.
    With ``targets=[]`` this only verifies."""
    path = inside(directory, rec["name"])
    fd = open_data(path)
    try:
        _check_size(path, rec, fd)
        stream = ChunkStream(fd, path, rec, targets, verify)
        if executor is None:
            return sum(map(stream.read, stream.chunks))
        return _read_all(stream, executor)
    finally:
        os.close(fd)


def verify_file(directory: Path, rec: dict[str, Any], executor: Executor | None = None) -> None:
    """Check a data file's size and every chunk's CRC32C without keeping its bytes."""
    stream_file(directory, rec, [], True, executor)
