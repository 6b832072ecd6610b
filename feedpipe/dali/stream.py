"""One DALI pipeline that serves every epoch of an :class:`~feedpipe.dali.ImageLoader`.

The pipeline persists across epochs as one endless stream (see :mod:`feedpipe.dali.source`):
each epoch is a *segment* of DALI iterations; the next epoch's order is predicted and published
ahead, so DALI reads and decodes across the epoch boundary without a pause. A failed batch, a
timeout or ``close()`` ends the pipeline's *generation*: the plan directory is removed, the
source workers are ended, and the next epoch builds a new pipeline.
"""

from __future__ import annotations

import copy
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from feedpipe.dali.options import ImageLoaderOptions
from feedpipe.dali.pipeline import PoolCloser, Transform, build_fed, build_main, worker_processes
from feedpipe.dali.records import describe
from feedpipe.dali.source import BatchSource, write_segment
from feedpipe.errors import WorkerError
from feedpipe.io.reaper import Workers, join_threads

__all__ = ["PIPE_DEPTH", "Caller", "PipelineStream"]

PIPE_DEPTH = 2  # DALI's prefetch_queue_depth: run() feeds one batch ahead of what it returns


class PipelineStream:
    """The DALI pipeline of one loader, its published segments and its position.

    ``pos`` is the DALI iteration of the next ``pipe.run()`` output; ``seg_id`` the segment of
    the epoch being iterated. :meth:`start` makes DALI produce an epoch's indices next (building
    the pipeline when there is none), :meth:`next` returns the next output, :meth:`decode_alone`
    decodes a batch of encoded records fed from here (a repaired batch).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        drop_last: bool,
        transform: Transform,
        options: ImageLoaderOptions,
        *,
        device_id: int | None,
        seed: int,
        workers: Workers,
        pool_closer: PoolCloser | None = None,
    ) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.transform, self.options = transform, options
        self.device_id, self.seed = device_id, seed
        self.prefetch = options.readahead
        self.timeout = options.timeout  # seconds for one pipe.run()
        # DALI's source worker processes: ended at close(), at a new pipeline, at the loader's
        # garbage collection and at interpreter exit, within feedpipe.io.reaper.DEFAULT_BOUND
        self.workers = workers
        self.pool_closer = pool_closer  # told of each new pipeline (its ask closes DALI's pool)
        self.plan_dir: str | None = None
        self.pipe: Any = None
        self.fed: Any = None  # decodes repaired batches
        self.caller: Caller | None = None
        self.pos = 0  # DALI iteration of the next pipe.run() output
        self.segs = 0  # segments published (the next one's id)
        self.seg_id = -1  # the segment of the epoch being iterated
        self.last_end = 0  # the iteration after the last published segment
        self.spec: tuple[int, int, np.ndarray, list[int]] | None = None  # id, start, plan, skip
        self.speculate = True  # off once a prediction was wrong
        self.tainted = False  # DALI failed on a batch of the current pipeline

    def n_batches(self, n: int) -> int:
        """Batches of ``n`` indices."""
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def new_generation(self) -> None:
        """Drop the pipeline and its plans, and end its workers; the next epoch builds anew.

        Asking: the removed plan directory ends a worker's wait for a plan, and the reaper's
        ask closes DALI's pool while the pipeline still lives; a worker still busy after that
        (a read that hangs) is terminated, then killed (:class:`~feedpipe.io.reaper.Workers`).
        Then the pipeline's last reference is dropped here: DALI shuts it down on this thread.
        """
        if self.plan_dir is not None:
            shutil.rmtree(self.plan_dir, ignore_errors=True)
            self.plan_dir = None
        # detached first: a thread in run() meanwhile sees it closed (and rebuilds nothing)
        pipe, self.pipe = self.pipe, None
        self.workers.end()  # while the pipeline lives: its pool is closed by the ask, once
        # the last reference: DALI's pipeline shuts down here, on this thread (a shutdown left
        # to a daemon thread can still run at interpreter exit and abort the process)
        del pipe
        self.tainted, self.spec = False, None
        self.pos = self.segs = self.last_end = 0

    def close(self) -> None:
        """End this generation and stop the caller thread; returns when no thread of this
        stream runs DALI code any more (or, for one stuck, after ``workers.bound``, warned)."""
        self.fed = None
        self.new_generation()  # the plan directory first: workers waiting on it return
        self._end_threads()

    def publish(self, indices: np.ndarray, start: int, skip: list[int]) -> int:
        """Write the next segment (``indices`` from DALI iteration ``start`` on); its id."""
        assert self.plan_dir is not None
        seg = self.segs
        write_segment(Path(self.plan_dir), seg, start, indices, skip)
        self.segs += 1
        self.last_end = start + self.n_batches(len(indices))
        return seg

    def start(self, indices: np.ndarray, skip: list[int], sampler: Any) -> int:
        """Make DALI produce ``indices`` next; returns the iteration of their first batch. Then
        publish what ``sampler`` will give after ``set_epoch(epoch + 1)``, if knowable."""
        if self.tainted:  # a batch failed in the last epoch: start a new pipeline
            self.new_generation()
        spec, self.spec = self.spec, None
        if self.pipe is None:
            start = self._build(indices, skip)
        elif (
            spec is not None
            and spec[1] == self.pos
            and np.array_equal(spec[2], indices)
            and spec[3] == skip
        ):  # predicted right: DALI is already on it
            self.seg_id, start = spec[0], spec[1]
        else:
            if spec is not None and spec[1] == self.pos:
                self.speculate = False  # this sampler's next order is not predictable
            if spec is None and self.pos == self.last_end:
                start = self.pos + PIPE_DEPTH  # workers answer fillers up to here, then wait
            else:  # override iterations DALI may have asked for already (pipeline + prefetch)
                start = self.pos + PIPE_DEPTH + self.prefetch + 2
            self.seg_id = self.publish(indices, start, skip)
        if self.speculate:
            self._predict_next(sampler, skip)
        return start

    def _build(self, indices: np.ndarray, skip: list[int]) -> int:
        """A new pipeline whose first segment is ``indices``, from iteration 0."""
        # the pid in the name tells whose plans these are (tests/conftest.py's leftover check)
        self.plan_dir = tempfile.mkdtemp(prefix=f"feedpipe-dali-{os.getpid()}-", dir=_shm_dir())
        source = BatchSource(
            self.dataset, self.plan_dir, self.batch_size, self.drop_last, gap=PIPE_DEPTH
        )
        self.pos = self.segs = 0
        self.seg_id = self.publish(indices, 0, skip)
        opts = self.options
        self.pipe = build_main(
            source,
            self.transform,
            batch_size=self.batch_size,
            num_threads=opts.num_threads,
            device_id=self.device_id,
            seed=self.seed,
            py_num_workers=opts.py_num_workers,
            py_start_method=opts.py_start_method,
            prefetch=self.prefetch,
            prefetch_queue_depth=PIPE_DEPTH,
            hw_decoder_load=opts.hw_decoder_load,
        )
        if self.pool_closer is not None:
            self.pool_closer.watch(self.pipe, self.plan_dir)
        self.workers.add(worker_processes(self.pipe))
        return 0

    def _predict_next(self, sampler: Any, skip: list[int]) -> None:
        """Publish the order ``sampler`` will give after ``set_epoch(epoch + 1)``, if knowable."""
        epoch = getattr(sampler, "epoch", None)
        if (
            not hasattr(sampler, "set_epoch")
            or not isinstance(epoch, int)
            or getattr(sampler, "generator", None) is not None  # a shared RNG: never touch it
        ):
            self.speculate = False
            return
        try:
            twin = copy.copy(sampler)
            twin.set_epoch(epoch + 1)
            indices = np.fromiter((int(i) for i in twin), dtype=np.int64)
        except Exception:
            self.speculate = False
            return
        if self.n_batches(len(indices)) > 0:
            start = self.last_end
            self.spec = (self.publish(indices, start, skip), start, indices, skip)

    def run(self, pipe: Any, what: str) -> Any:
        """``pipe.run()`` with a timeout; a hung or dead worker raises WorkerError, and so does
        a pipeline closed meanwhile (``close()`` on another thread: nothing is rebuilt)."""
        if self.caller is None:
            self.caller = Caller()
        try:
            out = self.caller.call(pipe.run, self.timeout)
        except TimeoutError:
            pass
        except BaseException as exc:
            # the frames it passed (Caller.call's holds the error and pipe.run: a cycle) must
            # not keep the pipeline: not for a garbage collection on another thread after
            # close(), not in an error the user keeps (a DatasetError's __cause__)
            traceback.clear_frames(exc.__traceback__)
            closed = pipe is None or (pipe is not self.pipe and pipe is not self.fed)
            del pipe
            if closed and isinstance(exc, Exception):
                raise self.closed_error(what) from exc
            raise
        else:
            if pipe is self.pipe or pipe is self.fed:
                return out
            del pipe, out  # outputs of a closed pipeline: not returned, not kept
            raise self.closed_error(what)
        del pipe  # the error's traceback (this frame) must not keep the pipeline alive
        # the caller is stuck in DALI until the workers are ended here; then it is joined (a
        # daemon: one still stuck after the bound is warned about and cannot block exit)
        self.new_generation()
        self._end_threads()
        raise WorkerError(
            f"DALI pipeline produced no {what} within {self.timeout} s "
            f"(dataset {describe(self.dataset)})"
        )

    def closed_error(self, what: str) -> WorkerError:
        """The error for ``what`` asked of a stream closed meanwhile (``close()``)."""
        return WorkerError(
            f"ImageLoader closed during the epoch: no {what} (dataset {describe(self.dataset)})"
        )

    def _end_threads(self) -> None:
        """Stop the caller; join it and the pool-close threads (within ``workers.bound``)."""
        threads = [] if self.pool_closer is None else self.pool_closer.threads()
        caller, self.caller = self.caller, None  # one swap: two close() calls stop it once
        if caller is not None:
            threads.append(caller.stop())
        join_threads(threads, "DALI", self.workers.bound.total)

    def next(self, what: str) -> Any:
        """The next DALI output (advances the stream position, also when DALI raises)."""
        if self.pipe is None:  # closed (a new epoch builds anew; this one cannot go on)
            raise self.closed_error(what)
        try:
            return self.run(self.pipe, what)
        except StopIteration:
            raise WorkerError(f"DALI pipeline ended before {what}") from None
        finally:
            self.pos += 1

    def discard_until(self, start: int) -> None:
        """Drop the outputs of fillers and of overridden batches before iteration ``start``."""
        while self.pos < start:
            try:
                self.next("a discarded batch")
            except (WorkerError, KeyboardInterrupt):
                raise
            except Exception:
                self.tainted = True

    def decode_alone(self, bufs: list[np.ndarray]) -> Any:
        """Decode and transform ``bufs`` (one batch of encoded records) in the fed pipeline."""
        if self.pipe is None:  # closed (on another thread) during the repair: build nothing
            raise self.closed_error("repaired batch")
        if self.fed is None:
            opts = self.options
            self.fed = build_fed(
                self.transform,
                batch_size=self.batch_size,
                num_threads=opts.num_threads,
                device_id=self.device_id,
                seed=self.seed + 1,
                hw_decoder_load=opts.hw_decoder_load,
            )
        self.fed.feed_input("encoded", bufs)
        (images,) = self.run(self.fed, "repaired batch")
        return images


class Caller:
    """Runs calls on one daemon thread so the caller can wait with a timeout.

    A daemon thread (unlike ``concurrent.futures`` workers, which are joined at interpreter exit)
    never keeps the process alive when DALI hangs.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[int, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[int, bool, Any]] = queue.SimpleQueue()
        self._seq = 0  # the number of the last call (its result is the one awaited)
        self._thread = threading.Thread(target=self._loop, name="feedpipe-dali", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            seq, fn = task
            try:
                result: tuple[int, bool, Any] = (seq, True, fn())
            except BaseException as exc:
                # the frames of a failed pipe.run() hold the pipeline (in DALI's reference
                # cycles, freed by a garbage collection on any thread): drop their locals
                traceback.clear_frames(exc.__traceback__)
                result = (seq, False, exc)
            # hold nothing between calls: a bound ``pipe.run`` kept here would make this
            # thread the one that drops the pipeline's last reference (and runs its shutdown)
            del fn, task
            self._results.put(result)
            del result

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` on the thread; ``TimeoutError`` after ``timeout`` seconds. The result of
        an earlier call whose wait was interrupted (Ctrl-C) is dropped, never returned."""
        self._seq += 1
        self._tasks.put((self._seq, fn))
        deadline = time.monotonic() + timeout
        while True:
            try:
                seq, ok, value = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError from None
            if seq == self._seq:
                break
            del value  # an interrupted call's (the DALI pipeline produced it, in order)
        if ok:
            return value
        raise value

    def stop(self) -> threading.Thread:
        """The thread ends after the call it runs now; returns it (to join)."""
        self._tasks.put(None)
        return self._thread


def _shm_dir() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None
