"""The read side of a restore: a data file read in parallel, verified, into host or CUDA tensors.

``read_into`` reads the CRC32C chunks of one data file on several threads at once, each with
positioned reads (``os.preadv``) of at most ``READ_BYTES``; every piece is checksummed as it
arrives. Where a piece holds bytes of a CUDA tensor it is read into one of the thread's two
page-locked slots and copied to the device on the thread's own stream, so reading the next piece
overlaps the copy of the last; other pieces go through a small host buffer into CPU tensors.

Memory: per thread one ``READ_BYTES`` host buffer and, once it meets a CUDA tensor, two pinned
``READ_BYTES`` slots, whatever the file or its manifest claim. Ordering: the copies wait for the
caller's current stream (work queued on the targets finishes first), and ``read_into`` returns
only after every copy is complete. A chunk whose checksum fails raises
``CorruptCheckpointError``; the pieces before it may already be in the targets (the caller that
must not write into tensors it does not own verifies the file first with ``targets=[]``, or
reads into tensors of its own first: ``ckpt.restoring.reader``). A verify-only read (``targets=[]``)
reads ``VERIFY_BYTES`` pieces into one such buffer per thread.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Executor, Future, wait
from pathlib import Path
from typing import Any

import torch

from ckpt import format as fmt
from ckpt.errors import CorruptCheckpointError
from feedpipe.io import crc32c, readinto_exactly, to_hex

__all__ = ["READ_BYTES", "VERIFY_BYTES", "WINDOW", "read_into", "reader_threads", "verify_threads"]

READ_BYTES = 4 << 20
"""The largest single read: the size of each thread's host buffer and of each pinned slot."""
VERIFY_BYTES = 1 << 20
"""The piece size of a verify-only read (``targets=[]``): small enough that the checksum reads
the bytes from the core's cache right after the read copied them there."""
WINDOW = 64
"""Chunks submitted ahead at most (a manifest of a billion tiny chunks queues no more)."""


def reader_threads() -> int:
    """How many threads a restore reads with: half the cores, at least 2, at most 8."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def verify_threads() -> int:
    """How many threads a verify-only pass reads with: every core, at least 2, at most 16
    (each holds one ``VERIFY_BYTES`` buffer)."""
    return max(2, min(16, os.cpu_count() or 2))


class _Local(threading.local):
    """One reader thread's buffers and streams (created on first use)."""

    scratch: memoryview | None = None
    slots: list[tuple[torch.Tensor, list[Any]]] | None = None  # (pinned slot, its copies' events)
    turn = 0
    streams: dict[torch.device, Any]

    def __init__(self) -> None:
        self.streams = {}


class _Job:
    """Shared state of one ``read_into`` call."""

    def __init__(
        self, path: Path, rec: dict[str, Any], targets: Sequence[fmt.Target], verify: bool
    ) -> None:
        self.path, self.rec, self.verify = path, rec, verify
        self.piece = READ_BYTES if targets else VERIFY_BYTES
        self.order = sorted((t for t in targets if t[1].numel()), key=lambda t: t[0])
        self.starts = [off for off, _ in self.order]
        self.ready: dict[torch.device, Any] = {}  # device -> event on the caller's stream
        for _, dst in self.order:
            if dst.is_cuda and dst.device not in self.ready:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(dst.device))
                self.ready[dst.device] = event
        self.local = _Local()
        self.lock = threading.Lock()
        self.streams: list[Any] = []
        self.fd = -1

    def overlapping(self, pos: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """The targets that hold bytes of ``[pos, end)``."""
        j = max(0, bisect.bisect_right(self.starts, pos) - 1)
        found = []
        while j < len(self.order) and self.order[j][0] < end:
            off, dst = self.order[j]
            if off + dst.numel() > pos:
                found.append((off, dst))
            j += 1
        return found

    def stream(self, device: torch.device) -> Any:
        local = self.local
        stream = local.streams.get(device)
        if stream is None:
            stream = local.streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stream.wait_event(self.ready[device])
            with self.lock:
                self.streams.append(stream)
        return stream

    def slot(self) -> torch.Tensor:
        """The thread's next pinned slot, once the copy out of it has finished."""
        local = self.local
        if local.slots is None:
            block = torch.empty(2 * READ_BYTES, dtype=torch.uint8, pin_memory=True)
            local.slots = [(block[:READ_BYTES], []), (block[READ_BYTES:], [])]
        slot, events = local.slots[local.turn % 2]
        for event in events:
            event.synchronize()
        return slot

    def chunk(self, i: int) -> float:
        """Read, checksum and place chunk ``i``; returns the seconds spent checksumming."""
        size, chunk = self.rec["size"], self.rec["chunk_bytes"]
        lo, hi = i * chunk, min((i + 1) * chunk, size)
        if not self.verify and not self.overlapping(lo, hi):
            return 0.0  # nothing to check or place: not read
        value, crc_s = 0, 0.0
        for pos in range(lo, hi, self.piece):
            end = min(hi, pos + self.piece)
            hits = self.overlapping(pos, end)
            cuda = any(dst.is_cuda for _, dst in hits)
            host: torch.Tensor | None = None
            if cuda:
                host = self.slot()[: end - pos]
                view = host.numpy().data
            else:
                if self.local.scratch is None:
                    self.local.scratch = memoryview(bytearray(min(self.piece, max(1, size))))
                view = self.local.scratch[: end - pos]
                if hits:
                    host = torch.frombuffer(view, dtype=torch.uint8)
            self.read(view, pos)
            if self.verify:
                t0 = time.perf_counter()
                value = crc32c(view, value)
                crc_s += time.perf_counter() - t0
            if host is not None:
                self.place(hits, host, pos, end, cuda)
        if self.verify and to_hex(value) != self.rec["crc32c"][i]:
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch in chunk {i} (bytes {lo}-{hi}): "
                f"{to_hex(value)} != {self.rec['crc32c'][i]}"
            )
        return crc_s

    def place(
        self,
        hits: list[tuple[int, torch.Tensor]],
        host: torch.Tensor,
        pos: int,
        end: int,
        cuda: bool,
    ) -> None:
        """Copy the piece ``host`` (file bytes ``[pos, end)``) into the targets it overlaps."""
        used: set[Any] = set()
        for off, dst in hits:
            a, b = max(pos, off), min(end, off + dst.numel())
            if dst.is_cuda:
                stream = self.stream(dst.device)
                used.add(stream)
                with torch.cuda.stream(stream):
                    dst[a - off : b - off].copy_(host[a - pos : b - pos], non_blocking=True)
            else:
                dst[a - off : b - off].copy_(host[a - pos : b - pos])
        if cuda:
            local = self.local
            assert local.slots is not None
            events = []
            for stream in used:  # the slot is free again once every copy out of it is done
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
            local.slots[local.turn % 2] = (local.slots[local.turn % 2][0], events)
            local.turn += 1

    def read(self, view: memoryview, pos: int) -> None:
        got = readinto_exactly(self.fd, [view], pos, len(view))
        if got < len(view):
            raise CorruptCheckpointError(f"{self.path}: unexpected end of file at byte {pos + got}")


def read_into(
    directory: Path,
    rec: dict[str, Any],
    targets: Sequence[fmt.Target],
    verify: bool,
    executor: Executor | None,
    *,
    fd: int | None = None,
) -> float:
    """Read data file ``rec`` of ``directory`` into ``targets`` (non-overlapping byte ranges of
    CPU or CUDA uint8 tensors), checking its size and, if ``verify``, every chunk's CRC32C; with
    ``targets=[]`` it only verifies. ``fd``: the file, already open (left open), so that two
    passes read the same file even if its name is replaced in between. Returns the seconds spent
    checksumming."""
    path = fmt.inside(directory, rec["name"])
    job = _Job(path, rec, targets, verify)
    job.fd = fmt.open_data(path) if fd is None else fd
    try:
        size = os.fstat(job.fd).st_size
        if size != rec["size"]:
            raise CorruptCheckpointError(f"{path}: size {size} != {rec['size']} bytes (truncated?)")
        chunks = range(len(rec["crc32c"]))
        if executor is None:
            return sum(map(job.chunk, chunks))
        return _run(executor, job, chunks)
    finally:
        for stream in job.streams:  # every copy is complete (or failed) before returning
            stream.synchronize()
        if fd is None:
            os.close(job.fd)


def _run(executor: Executor, job: _Job, chunks: range) -> float:
    """``job.chunk`` over ``chunks`` on ``executor``, at most ``WINDOW`` in flight; the first
    error stops the submitting, and every read is over before this returns or raises."""
    pending: set[Future[float]] = set()
    total, error = 0.0, None
    try:
        for i in chunks:
            if len(pending) >= WINDOW:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                total += _collect(done)
            pending.add(executor.submit(job.chunk, i))
    except BaseException as exc:  # a bad chunk (or Ctrl-C): read no further
        error = exc
        for f in pending:
            f.cancel()
    else:
        _, rest = wait(pending, return_when=FIRST_EXCEPTION)
        for f in rest:  # after a bad chunk, read no further
            f.cancel()
    done, _ = wait(pending)  # every read is over before fd is closed (and its number reused)
    if error is not None:
        raise error
    return total + _collect(done)


def _collect(done: set[Future[float]]) -> float:
    """The checksum seconds of finished chunks; re-raises the first chunk's error."""
    total = 0.0
    for f in done:
        if not f.cancelled():
            total += f.result()
    return total
