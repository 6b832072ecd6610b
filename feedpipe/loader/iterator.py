"""What ``iter(feedpipe.DataLoader)`` returns: it unwraps shipped batches, counts them for resume
and the stall meter, and turns a dead or failing worker into a :class:`WorkerError` raised inside
``next()`` (never asynchronously)."""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any

import numpy as np

from feedpipe.device.feed import PinnedBatch, Prefetcher
from feedpipe.errors import WorkerError
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import ALL_BAD, Failed, Skipped, short
from feedpipe.loader.slots import SlotRef
from feedpipe.loader.threads import InlineSource, ThreadWorkers

__all__ = ["LoaderIter", "dead_workers", "dying"]

_perf = time.perf_counter


class LoaderIter:
    """What ``iter(loader)`` returns: unwraps shipped batches, counts, explains failures."""

    def __init__(
        self,
        loader: Any,  # the feedpipe.DataLoader (a layer above: not imported here)
        source: Any,
        feed: Prefetcher | None = None,
        started: float | None = None,
    ) -> None:
        self._loader = loader
        self._source = source
        own = isinstance(source, (InlineSource, ThreadWorkers))
        # torch's process iterator: a worker death raises in next(), never elsewhere
        self._guard = None if own else _torch_compat.Guard(source)
        self._feed = feed
        self._slots = loader._slots if not own else None  # process workers' shared slots
        if feed is not None:
            pull = weakref.WeakMethod(self._pull)  # no cycle: the pass dies with its iterator
            feed.pull = lambda: pull()()  # type: ignore[misc]  # noqa: PLW0108
        meter = self._meter = loader.meter
        self._timed = meter.enabled  # off: the sources read no clock either
        # the meter's batch log, bound once per pass: record_batch's body, inlined below
        self._put, self._pack, self._log = meter.batch_log()
        self._profiler = meter.profiler_check  # whether waits are profiler ranges: per batch
        # device idle for input: CUDA events at hand-off (device="cuda" with counters on)
        self._clock = meter.device_clock if feed is not None and self._timed else None
        # an in-process source that ships a mid-clock instead of stage times (fetch_mid)
        self._shared = bool(getattr(source, "shared_clock", False))
        self._in_pass = True  # until StopIteration or drop: the meter's clock is not "outside"
        meter.pass_begin(started)
        self._epoch = loader._epoch
        self._first = self._epoch.batches  # batch number (in the epoch) of this pass's first batch
        self._delivered = 0
        stream = loader._stream
        self._sent = stream.sent if stream is not None else None
        # out of order, batch n is delivered within the prefetch window of the n-th delivery
        window = (loader.prefetch_factor or 1) * max(1, loader.num_workers)
        self._lag = 0 if loader.in_order else 4 * window + 4
        # torch's iterator warns when an IterableDataset yields more than its len(); ours too
        self._len_called = _torch_compat.len_called(loader) if own and loader._iterable else None

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        # Counters on: two clock reads around the blocking part and one record_batch call
        # (while a profiler records: wait_begin/wait_end, so the wait is a profiler range).
        # Counters off: no clock at all.
        timed = self._timed
        traced = timed and self._profiler()
        if traced:
            self._meter.wait_begin()
        t0 = _perf() if timed else 0.0
        on_device = None
        clock = self._clock
        mark = clock.begin() if clock is not None else None  # the stream's previous work ends
        try:
            if self._feed is None:
                shipped = next(self._source) if self._guard is None else self._guard.next()
            else:  # `prefetch` later batches keep copying to the device meanwhile
                on_device, shipped = next(self._feed)
        except StopIteration:
            if clock is not None:
                clock.cancel(mark)
            self._epoch.active = False
            if timed and not traced:
                self._meter.wait_pending(t0)  # the step before this wait still counts
            self._end_pass()
            raise
        except Exception as exc:
            if clock is not None:
                clock.cancel(mark)
            if timed and not traced:
                self._meter.wait_pending(t0)
            if self._feed is not None:  # _pull explained it already
                raise
            raise self._explain(exc) from exc
        t1 = _perf() if timed else 0.0
        if clock is not None:  # hand-off done: the consumer stream waits for the copy
            if on_device is None:
                clock.cancel(mark)
            else:
                clock.end(mark)
        if type(shipped) is Failed:
            if timed and not traced:
                self._meter.wait_pending(t0)
            indices = shipped.indices
            self._count(len(indices) if isinstance(indices, (list, tuple, np.ndarray)) else 0)
            error: BaseException | None = shipped.exception(self._first + self._delivered - 1)
            shipped = None
            assert error is not None
            try:
                raise error
            finally:  # break the frame <-> traceback cycle so the workers shut down promptly
                error = None
        if type(shipped) is Skipped:  # on_error="skip" (feedpipe.loader.skip)
            shipped = self._skips(shipped)
            if shipped is ALL_BAD:  # no batch: the caller waits on (a new wait, no count)
                if traced and self._meter.range_open:
                    self._meter.close_range()
                return shipped
        batch, samples, nbytes, fetch_s, collate_s = shipped
        if self._shared:  # fetch_s is the clock between read and collate (or -1.0: no collate)
            if fetch_s >= 0.0:
                fetch_s, collate_s = fetch_s - t0, t1 - fetch_s
            else:
                fetch_s = t1 - t0
        if traced:
            meter = self._meter
            meter.add_stage("fetch", fetch_s, nbytes)
            if collate_s >= 0.0:
                meter.add_stage("collate", collate_s, nbytes)
            meter.wait_end(samples=samples, nbytes=nbytes)
        elif timed:  # meter.record_batch(t0, t1, ...), inlined (StallMeter.batch_log)
            self._put(self._pack(t0, t1, samples, nbytes, fetch_s, collate_s))
            if len(self._log) >= self._meter.fold_at:
                self._meter.after_batch(t1)
        self._count(samples)
        if self._len_called is not None and self._delivered > self._len_called:
            warnings.warn(
                f"Length of IterableDataset {self._loader.dataset} was reported to be "
                f"{self._len_called} (when accessing len(dataloader)), but {self._delivered} "
                "samples have been fetched. ",
                stacklevel=2,
            )
        return self._finalize(batch) if self._feed is None else on_device

    def _finalize(self, batch: Any) -> Any:
        """The one place a delivered host batch is finished (device batches come from the feed):
        a batch in a worker's shared slot becomes views that hold the slot while they live."""
        if self._slots is None:
            return batch
        if type(batch) is SlotRef:
            return self._slots.resolve(batch)[0]
        self._slots.fallback += 1
        return batch

    def _pull(self) -> tuple[Any, Any, bool]:
        """The device feed's source: the next shipped batch, in order. The feed hands ``shipped``
        back (without its host batch) beside the device batch when that batch's turn comes."""
        try:
            shipped = next(self._source) if self._guard is None else self._guard.next()
        except StopIteration:
            raise
        except Exception as exc:
            raise self._explain(exc) from exc
        if type(shipped) is Failed:
            return None, shipped, False
        skipped = None
        if type(shipped) is Skipped:  # on_error="skip": the dropped indices ride with the info
            if shipped.shipped is None:
                return None, shipped, False
            skipped, shipped = shipped.skipped, shipped.shipped
        batch = shipped[0]
        if self._slots is not None:
            if type(batch) is SlotRef:
                batch, pinned = self._slots.resolve(batch)
                if pinned:  # page-locked in place: the feed copies straight from the slot
                    batch = PinnedBatch(batch)
            else:
                self._slots.fallback += 1
        info = (None, *shipped[1:])
        return batch, (info if skipped is None else Skipped(info, skipped)), True

    def _skips(self, record: Skipped) -> Any:
        """A batch with dropped samples: only ``SkippingLoaderIter`` (on_error="skip") gets one."""
        raise AssertionError("a Skipped batch reached a loader with on_error='raise'")

    def _end_pass(self) -> None:
        """Tell the meter this pass is over (once): time until the next pass is outside."""
        if self._in_pass:
            self._in_pass = False
            self._meter.pass_end()

    def __del__(self) -> None:
        if getattr(self, "_in_pass", False):  # dropped mid-pass (break)
            try:
                self._end_pass()
            except Exception:  # interpreter shutdown: the counters no longer matter
                pass
        if getattr(self, "_feed", None) is not None:  # abandoned: turn its workers away
            self._feed.close()  # type: ignore[union-attr]
        loader = getattr(self, "_loader", None)
        if loader is not None and not loader.persistent_workers:  # this pass's processes
            try:
                _torch_compat.end_workers(self._source)  # bounded, also with a worker stuck
            except Exception:  # interpreter shutdown: the exit hook ends them
                pass

    def _count(self, samples: int) -> None:
        """One more batch of ``samples`` delivered (or failed) this epoch."""
        epoch = self._epoch
        epoch.batches += 1
        epoch.samples += samples
        if self._sent is not None:
            self._sent.pop(self._delivered - self._lag, None)
        self._delivered += 1

    # ------------------------------------------------------------------- failure messages
    def _explain(self, exc: Exception) -> Exception:
        """Turn a worker death or timeout into a ``WorkerError`` naming worker and samples."""
        loader, source = self._loader, self._source
        batch, worker = (
            source.waiting_on()
            if isinstance(source, ThreadWorkers)
            else _torch_compat.waiting_on(source)
        )
        indices = None
        if loader._stream is not None and batch is not None:
            indices = loader._stream.sent.get(batch)
        where = f"batch {self._first + batch}" if batch is not None else "the next batch"
        what = f" (sample indices {short(indices)})" if indices is not None else ""
        dead = dead_workers(source, wait=dying(exc))
        if dead:
            wid, pid, code = dead[0]
            held = [
                f"batch {self._first + b}"
                + (f" (sample indices {short(ix)})" if (ix := sent.get(b)) is not None else "")
                for b in _torch_compat.tasks_of(source, wid)[:4]
                for sent in [loader._stream.sent if loader._stream is not None else {}]
            ]
            holding = f"while loading {' or '.join(held)}" if held else "between batches"
            _torch_compat.stop_workers(source)
            return WorkerError(
                f"DataLoader worker {wid} (pid {pid}) died with exit code {code} {holding}; a "
                "negative code is the signal that killed it (-9: SIGKILL, often the out-of-memory "
                f"killer). Original error: {exc}"
            )
        if isinstance(exc, TimeoutError) or str(exc).startswith("DataLoader timed out"):
            return WorkerError(
                f"DataLoader worker {worker} timed out after {loader.timeout} s loading "
                f"{where}{what}"
            )
        return exc


# What reading from a worker that is dying raises in the main process: its pipe or socket
# closed (EOFError, ConnectionError), its shared-memory file gone (FileNotFoundError), or
# feedpipe's SIGCHLD handler (WorkerDiedError). The worker may not be reaped yet when it is raised.
_DYING = (EOFError, ConnectionError, FileNotFoundError, _torch_compat.WorkerDiedError)
_DEATH_WAIT_S = 5.0


def dying(exc: BaseException) -> bool:
    """Whether ``exc`` may come from a dying process worker (not re-raised from inside one)."""
    if isinstance(exc, RuntimeError) and "exited unexpectedly" in str(exc):
        return True
    return isinstance(exc, _DYING) and "in DataLoader worker process" not in str(exc)


def dead_workers(source: Any, wait: bool = False) -> list[tuple[int, int | None, int | None]]:
    """Dead process workers of ``source``; ``wait``: give a dying one up to ``_DEATH_WAIT_S``
    to be reaped (its pipe closes before the kernel reports it dead)."""
    dead = _torch_compat.dead_workers(source)
    if dead or not wait or not getattr(source, "_workers", None):
        return dead
    deadline = time.monotonic() + _DEATH_WAIT_S
    while not dead and time.monotonic() < deadline:
        time.sleep(0.01)
        dead = _torch_compat.dead_workers(source)
    return dead
