"""The save pipeline of a ``CheckpointManager``: stage now, write and commit in the background.

``SavePipeline.submit`` flattens a state (``ckpt.saving.flatten_cache``: the last save's
entries reused while its keys match; from the second hit on, the walk skipped while its
structure matches, ``ckpt.saving.structure``), asks its ``SavePlan`` (``ckpt.saving.plan``) for the
layout, copies the leaves into a buffer of the staging pool (the only blocking work) and queues
the job; one background thread (``ckpt-persist``) writes each job's data file with per-chunk
CRC32C on the writer threads, writes the manifest, commits ``step-N``, updates ``latest`` and
calls ``on_committed``. A background error is kept and raised by the next ``raise_pending``.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckpt import _faults, _layout
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.saving import commit
from ckpt.saving.flatten import Leaf
from ckpt.saving.flatten_cache import FlattenCache
from ckpt.saving.overlap import CudaEvent, Overlap, SnapshotEvent
from ckpt.saving.plan import SavePlan, Stager
from ckpt.saving.pool import Buffer, PinnedPool
from feedpipe.io.trace import span

__all__ = [
    "SaveCounters",
    "SaveHandle",
    "SavePipeline",
    "SaveStats",
    "WriteOptions",
    "gc_paused",
]

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class WriteOptions:
    """How the background phase writes: writer threads, checksum chunk size, lock wait."""

    threads: int = 2
    chunk_bytes: int = fmt.CHUNK_BYTES
    lock_timeout_s: float = 10.0


@dataclass
class SaveStats:
    """Timings of one save. ``blocked_s`` is what the training loop paid; ``durable_s`` runs from
    the ``save`` call to the committed, fsynced ``step-N``."""

    step: int
    nbytes: int = 0
    blocked_s: float = 0.0
    backpressure_s: float = 0.0
    stage_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    durable_s: float = 0.0


class SaveCounters(Protocol):
    """The counters a pipeline keeps up to date (``ckpt.manager.ManagerStats``)."""

    saves: int
    failed: int
    backpressure_waits: int
    backpressure_s: float
    last_save: SaveStats | None


class SaveHandle:
    """A save in flight: ``done()``, ``result(timeout)`` (the committed path, or the error)."""

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self.path: Path | None = None
        self.error: BaseException | None = None
        self._event = threading.Event()

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._event.is_set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until the save has committed or failed; ``False`` if ``timeout`` passed first."""
        return self._event.wait(timeout)

    def finish(self) -> None:
        """Mark the save over (``path`` or ``error`` set): wakes ``result`` and ``wait_done``."""
        self._event.set()

    def result(self, timeout: float | None = None) -> Path:
        """Wait until committed; return the step directory or raise the background error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout} s")
        if self.error is not None:
            raise CheckpointError(f"save of step {self.step} failed: {self.error}") from self.error
        assert self.path is not None
        return self.path


@dataclass
class _Job:
    handle: SaveHandle
    buf: Buffer
    body: dict[str, Any]
    t0: float
    copies: list[SnapshotEvent] = field(default_factory=list)  # overlap: wait before writing
    sources: list[Any] | None = None  # overlap: what the copies read, alive until they are done


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (when it was on): a save of thousands
    of leaves allocates tens of thousands of containers, and the collections they trigger
    (now and then a full one, tens of milliseconds in a process holding torch) would land in
    the time the training loop is blocked. Nothing a save allocates is cyclic garbage; the
    next collection after the block finds what is left."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class SavePipeline:
    """Staging and background persisting of the saves of one directory (module docstring).

    ``on_committed(step, path)`` runs on the persist thread after each commit (the manager's
    post-commit actions); its failure fails the save's handle, naming the committed path."""

    def __init__(
        self,
        directory: Path,
        pool: PinnedPool,
        write: WriteOptions,
        counters: SaveCounters,
        on_committed: Callable[[int, Path], None],
    ) -> None:
        self.directory = directory
        self.pool = pool
        self.write_options = write
        self.counters = counters
        self.on_committed = on_committed
        self.stager = Stager()
        self.flattener = FlattenCache()  # entries reused while the state's keys match
        self.last_saved: SaveHandle | None = None  # the newest save asked for
        self._mutex = threading.Lock()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._inflight: list[SaveHandle] = []
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._executor: ThreadPoolExecutor | None = None

    def plan(self, state: Any) -> SavePlan:
        """The plan of ``state`` (the last save's when its leaves match): its layout and size."""
        leaves: list[Leaf] = []
        self.flattener.flatten(state, leaves)
        return self.stager.plan(leaves)

    @property
    def busy(self) -> bool:
        """Whether a save is in flight."""
        with self._mutex:
            return bool(self._inflight)

    def submit(
        self,
        step: int,
        state: Any,
        metadata: dict[str, Any] | None,
        metrics: dict[str, Any] | None,
        overlap: Overlap | None = None,
    ) -> SaveHandle:
        """Stage ``state`` into a pool buffer (blocking; with ``overlap``, only until the device
        copies are queued: ``ckpt.saving.overlap``) and queue its write as ``step-N``."""
        with gc_paused():
            return self._submit(step, state, metadata, metrics, overlap)

    def _submit(
        self,
        step: int,
        state: Any,
        metadata: dict[str, Any] | None,
        metrics: dict[str, Any] | None,
        overlap: Overlap | None,
    ) -> SaveHandle:
        t0 = time.perf_counter()
        overlap = overlap if overlap is not None and overlap.enabled else None
        stats = SaveStats(step)
        flat = self.flattener.capture(state)
        # a cache hit (no new assignment since): the leaves' signature is the generation's
        token = flat.generation if flat.reused else None
        plan = self.stager.current(token) or self.stager.plan(flat.leaves(), token)
        buf, stats.backpressure_s = self.pool.acquire(plan.nbytes)
        events: dict[Any, SnapshotEvent] = {}
        try:
            s0 = time.perf_counter()
            _faults.pause("stage")
            sources = overlap.prepare(flat.leaves()) if overlap is not None else None
            with span("ckpt/stage"):
                raw = plan.stage_values(flat.values, buf, sync=overlap is None)
            events = {device: CudaEvent(event, device) for device, event in raw.items()}
            stats.stage_s = time.perf_counter() - s0
        except BaseException:
            self.pool.release(buf)
            raise
        stats.nbytes = plan.nbytes
        stats.blocked_s = time.perf_counter() - t0
        body = fmt.new_manifest(
            step=step,
            created=time.time(),
            nbytes=plan.nbytes,
            tree=flat.tree,
            entries=list(plan.entries),  # entries are never modified
            files=[],
            metadata=metadata,
            metrics=metrics,
        )
        handle = SaveHandle(step, stats)
        if overlap is not None:
            overlap.arm(state, events)
        job = _Job(handle, buf, body, t0, list(events.values()), sources if events else None)
        self._queue(job)
        return handle

    def _queue(self, job: _Job) -> None:
        stats, counters = job.handle.stats, self.counters
        with self._mutex:
            counters.saves += 1
            if stats.backpressure_s:
                counters.backpressure_waits += 1
                counters.backpressure_s += stats.backpressure_s
            counters.last_save = stats
            self._jobs.append(job)
            self._inflight.append(job.handle)
            self.last_saved = job.handle
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._persist_loop, name="ckpt-persist", daemon=False
                )
                self._thread.start()

    def _persist_loop(self) -> None:
        while True:
            with self._mutex:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            self._persist(job)

    def _persist(self, job: _Job) -> None:
        handle, stats, step = job.handle, job.handle.stats, job.handle.step
        released = False
        tmp: Path | None = None
        try:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.write_options.threads, thread_name_prefix="ckpt-write"
                )
            for event in job.copies:  # an overlapped save: its bytes land in the buffer now
                event.synchronize()
            job.sources = None
            w0 = time.perf_counter()
            tmp = commit.make_tmp(self.directory, step)
            data = job.buf.view()[: job.body["nbytes"]]
            rec = fmt.write_file(
                tmp / _layout.DATA_FILE, data, self._executor, self.write_options.chunk_bytes
            )
            self.pool.release(job.buf)
            released = True
            stats.write_s = time.perf_counter() - w0
            c0 = time.perf_counter()
            job.body["files"] = [rec]
            fmt.write_manifest(tmp, job.body)
            with span("ckpt/commit"):
                handle.path = commit.publish(tmp, self.directory, step)
            tmp = None
            commit.write_latest(self.directory, step)
            stats.commit_s = time.perf_counter() - c0
            stats.durable_s = time.perf_counter() - job.t0
            self.on_committed(step, handle.path)
        except BaseException as failure:
            self._fail(handle, failure)
        finally:
            if not released:
                self.pool.release(job.buf)
            if tmp is not None:
                commit.remove_path(tmp)
            with self._mutex:
                if handle in self._inflight:
                    self._inflight.remove(handle)
            handle.finish()

    def _fail(self, handle: SaveHandle, failure: BaseException) -> None:
        exc: BaseException = failure
        if handle.path is not None:  # committed; an on_commit listener or retention failed
            exc = CheckpointError(
                f"step {handle.step} was committed to {handle.path}, but a post-commit action "
                f"failed: {failure!r}"
            )
            exc.__cause__ = failure
        handle.error = exc
        with self._mutex:
            self.counters.failed += 1
            if self._error is None:
                self._error = (handle.step, exc)
        log.error("ckpt: save of step %d in %s failed: %s", handle.step, self.directory, exc)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save in flight (``TimeoutError`` after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._mutex:
                pending = list(self._inflight)
            if not pending:
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pending[0].wait_done(left):
                raise TimeoutError(f"{self.directory}: saves still running after {timeout} s")

    def raise_pending(self) -> None:
        """Raise the first background error not raised yet (once)."""
        with self._mutex:
            pending, self._error = self._error, None
        if pending is not None:
            step, exc = pending
            raise CheckpointError(
                f"{self.directory}: background save of step {step} failed: {exc}"
            ) from exc

    def close(self) -> None:
        """Release the writer threads (after ``wait``)."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
