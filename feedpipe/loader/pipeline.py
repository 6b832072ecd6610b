"""The per-batch path of ``iter(loader)``: a short pipeline of single-concern steps.

``LoaderIter.__next__`` (``feedpipe.loader.iterator``) runs, for each batch:

1. :class:`Fetch`: the next shipped record from the pass's workers (torch's process iterator
   behind its death :class:`~feedpipe.loader._torch_compat.Guard`, thread workers, the inline
   source) or from the device feed; a worker death or timeout becomes a ``WorkerError``
   (:class:`Explain`).
2. :class:`FailurePolicy`: a ``Failed`` record is counted and raised; a ``Skipped`` one
   (``on_error="skip"``) goes to the skip policy (``feedpipe.loader.skip_iter.SkipPolicy``).
3. :class:`Timing`: the wait around step 1 and the workers' stage times, into the stall meter
   (one record per batch; a profiler range while a profiler records; no clock when off).
4. :class:`Handoff`: the device clock's CUDA events around the hand-off (``device="cuda"``).
5. :class:`Finalise`: a batch in a process worker's shared slot becomes views that hold the
   slot while they live (host batches here, device batches in :meth:`Fetch.for_feed`).

Each step holds what it needs and nothing of the iterator (no reference cycle: a dropped
iterator ends its workers by refcount), so each is built and tested alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from feedpipe.device.feed import PinnedBatch, Prefetcher
from feedpipe.errors import WorkerError
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import Failed, Skipped, short
from feedpipe.loader.loader_pass import Pass
from feedpipe.loader.slots import SlotRef, Slots
from feedpipe.loader.threads import InlineSource, ThreadWorkers
from feedpipe.stall import StallMeter
from feedpipe.stall.profiler import flag_of
from feedpipe.stall.records import MID

__all__ = [
    "Explain",
    "FailurePolicy",
    "Fetch",
    "Finalise",
    "Handoff",
    "Timing",
    "dead_workers",
    "dying",
]

_perf = time.perf_counter


# ---------------------------------------------------------------------------------- 1. fetch
class Explain:
    """Turns a worker death or timeout into a ``WorkerError`` naming worker and samples."""

    def __init__(self, pass_: Pass, timeout: float) -> None:
        self._pass, self._timeout = pass_, timeout

    def __call__(self, exc: Exception) -> Exception:
        source, pass_ = self._pass.source, self._pass
        batch, worker = (
            source.waiting_on()
            if isinstance(source, ThreadWorkers)
            else _torch_compat.waiting_on(source)
        )
        indices = pass_.indices(batch) if batch is not None else None
        where = f"batch {pass_.first + batch}" if batch is not None else "the next batch"
        what = f" (sample indices {short(indices)})" if indices is not None else ""
        dead = dead_workers(source, wait=dying(exc))
        if dead:
            return self._died(dead[0], exc)
        if isinstance(exc, TimeoutError) or str(exc).startswith("DataLoader timed out"):
            return WorkerError(
                f"DataLoader worker {worker} timed out after {self._timeout} s loading "
                f"{where}{what}"
            )
        return exc

    def _died(self, dead: tuple[int, int | None, int | None], exc: Exception) -> WorkerError:
        wid, pid, code = dead
        source, pass_ = self._pass.source, self._pass
        held = [
            f"batch {pass_.first + b}"
            + (f" (sample indices {short(ix)})" if (ix := pass_.indices(b)) is not None else "")
            for b in _torch_compat.tasks_of(source, wid)[:4]
        ]
        holding = f"while loading {' or '.join(held)}" if held else "between batches"
        _torch_compat.stop_workers(source)
        return WorkerError(
            f"DataLoader worker {wid} (pid {pid}) died with exit code {code} {holding}; a "
            "negative code is the signal that killed it (-9: SIGKILL, often the out-of-memory "
            f"killer). Original error: {exc}"
        )


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
    if dead or not wait or not _torch_compat.has_workers(source):
        return dead
    deadline = time.monotonic() + _DEATH_WAIT_S
    while not dead and time.monotonic() < deadline:
        time.sleep(0.01)
        dead = _torch_compat.dead_workers(source)
    return dead


class Fetch:
    """Step 1: the next shipped record, from the workers or from the device feed."""

    def __init__(self, pass_: Pass, explain: Callable[[Exception], Exception]) -> None:
        source = pass_.source
        own = isinstance(source, (InlineSource, ThreadWorkers))
        # torch's process iterator: a worker death raises in next(), never elsewhere
        guard = None if own else _torch_compat.Guard(source)
        self._next: Callable[[], Any] = guard.next if guard is not None else source.__next__
        self._feed = pass_.feed
        self._explain = explain
        self._finalise = Finalise(pass_.slots)

    def __call__(self) -> tuple[Any, Any]:
        """``(device batch or None, shipped record)``; a failure of the workers explained."""
        if self._feed is not None:  # `prefetch` later batches keep copying meanwhile
            return next(self._feed)  # the feed's pull (for_feed) explained a failure already
        try:  # host(), inlined: the per-batch path
            return None, self._next()
        except StopIteration:
            raise
        except Exception as exc:
            raise self._explain(exc) from exc

    def host(self) -> Any:
        """The next record from the workers (``StopIteration`` at the end of the pass)."""
        try:
            return self._next()
        except StopIteration:
            raise
        except Exception as exc:
            raise self._explain(exc) from exc

    def for_feed(self) -> tuple[Any, Any, bool]:
        """The device feed's source: the next shipped batch, in order. The feed hands the record
        back (without its host batch) beside the device batch when that batch's turn comes."""
        shipped = self.host()
        if type(shipped) is Failed:
            return None, shipped, False
        skipped = None
        if type(shipped) is Skipped:  # on_error="skip": the dropped indices ride with the info
            if shipped.shipped is None:
                return None, shipped, False
            skipped, shipped = shipped.skipped, shipped.shipped
        batch = self._finalise.for_feed(shipped[0])
        info = (None, *shipped[1:])
        return batch, (info if skipped is None else Skipped(info, skipped)), True


# ------------------------------------------------------------------------- 2. failure policy
class FailurePolicy:
    """Step 2 with ``on_error="raise"``: a failed batch is counted, then raised."""

    def __init__(self, pass_: Pass) -> None:
        self._pass = pass_

    def failure(self, record: Failed) -> BaseException:
        """The exception to raise for a failed batch (which counts as consumed)."""
        return record.exception(self._pass.count_failed(record.indices))

    def skipped(self, record: Skipped) -> Any:
        """A batch with dropped samples: only the skip policy gets one."""
        raise AssertionError("a Skipped batch reached a loader with on_error='raise'")


# ----------------------------------------------------------------------------------- 3. timing
class Timing:
    """Step 3: the wait for a batch and its stage times, into the stall meter.

    Counters on: two clock reads around the blocking part of ``next()`` and one packed record
    per batch (while a profiler records: ``wait_begin``/``wait_end``, so the wait is a profiler
    range). Counters off: no clock at all.

    The per-batch cost is one Python call: :attr:`begin` and :attr:`now` are ``perf_counter``
    itself (``float``, which returns 0.0, when off), and :attr:`record` is the recorder this
    pass needs, chosen once: off (unpack only), stage times, or a shared clock (the source's
    reading between read and collate goes into the record raw, with
    :data:`~feedpipe.stall.records.MID`, and the meter's fold turns it into the stage times:
    no arithmetic per batch). Whether the next wait is a profiler range is asked once per batch
    at the end of the record (and when the pass starts); a traced wait points :attr:`begin` and
    :attr:`record` at their traced variants for that one wait. A profiler started during a step
    therefore sees ranges from the wait after next.
    """

    #: a wait starts: its clock (0.0 when off); ``perf_counter`` unless the wait is traced
    begin: Callable[[], float]
    #: the clock now (0.0 when off): ``perf_counter`` or ``float``
    now: Callable[[], float]
    #: ``record(shipped, t0, t1) -> (batch, samples)``: a delivered batch's wait and stages
    record: Callable[[Any, float, float], tuple[Any, int]]

    def __init__(self, meter: StallMeter, shared: bool) -> None:
        self._meter = meter
        self.timed = meter.enabled
        self.traced = False  # this wait is a profiler range (decided at begin)
        self._profiler = meter.profiler_check  # whether waits are profiler ranges
        # the same, per batch: self._flags[self._flag], a dict lookup (no call)
        self._flags, self._flag = flag_of(self._profiler)
        # an in-process source that ships a mid-clock instead of stage times (fetch_mid)
        self._shared = shared
        # the meter's batch log, bound once per pass: record_batch's body, inlined in record()
        self._put, self._pack, self._log = meter.batch_log()
        self.now = _perf if self.timed else float
        self.begin = float
        self._untraced = (
            self._record_mid if shared else self._record_times
        ) if self.timed else self._record_off  # fmt: skip
        self.record = self._untraced
        if self.timed:
            self._arm()

    def _arm(self) -> None:
        """Choose how the next wait begins: a profiler range, or the bare clock."""
        self.begin = self._begin_traced if self._profiler() else _perf

    def _begin_traced(self) -> float:
        """A wait that is a profiler range: the meter's ``wait_begin`` opens it."""
        self.traced = True
        self.record = self._record_traced
        self.begin = _perf  # record() arms the next one
        self._meter.wait_begin()
        return _perf()

    def _untrace(self) -> None:
        self.traced = False
        self.record = self._untraced

    def unfinished(self, t0: float) -> None:
        """The wait begun at ``t0`` delivered no batch: the step before it still counts."""
        if not self.timed:
            return
        if not self.traced:
            self._meter.wait_pending(t0)
        self._untrace()
        self._arm()

    def no_batch(self) -> None:
        """The wait ended with no batch to return (every sample skipped): close its range."""
        if self.traced:
            self._meter.close_range()
            self._untrace()
        if self.timed:
            self._arm()

    @staticmethod
    def _record_off(shipped: Any, t0: float, t1: float) -> tuple[Any, int]:
        """Counters off: the batch and its samples, nothing recorded."""
        return shipped[0], shipped[1]

    def _record_times(self, shipped: Any, t0: float, t1: float) -> tuple[Any, int]:
        """The source timed its stages: one record (meter.record_batch, inlined)."""
        batch, samples, nbytes, fetch_s, collate_s = shipped
        put, pack = self._put, self._pack  # values, not method lookups (which fail to specialise)
        put(pack(t0, t1, samples, nbytes, fetch_s, collate_s))
        if len(self._log) >= self._meter.fold_at:
            self._meter.after_batch(t1)
        if self._flags[self._flag]:  # the next wait is a profiler range
            self.begin = self._begin_traced
        return batch, samples

    def _record_mid(self, shipped: Any, t0: float, t1: float) -> tuple[Any, int]:
        """The source shipped the clock between read and collate (or -1.0: no collate): it goes
        into the record raw, marked :data:`MID`; the fold makes the stage times of it."""
        batch, samples, nbytes, mid, _ = shipped
        put, pack = self._put, self._pack  # values, not method lookups (which fail to specialise)
        put(pack(t0, t1, samples, nbytes, mid, MID))
        if len(self._log) >= self._meter.fold_at:
            self._meter.after_batch(t1)
        if self._flags[self._flag]:  # the next wait is a profiler range
            self.begin = self._begin_traced
        return batch, samples

    def _record_traced(self, shipped: Any, t0: float, t1: float) -> tuple[Any, int]:
        """A traced wait: its stages, then ``wait_end`` closes the range."""
        batch, samples, nbytes, fetch_s, collate_s = shipped
        self._untrace()
        if self._shared:  # fetch_s is the clock between read and collate (or -1.0: no collate)
            if fetch_s >= 0.0:
                fetch_s, collate_s = fetch_s - t0, t1 - fetch_s
            else:
                fetch_s = t1 - t0
        meter = self._meter
        meter.add_stage("fetch", fetch_s, nbytes)
        if collate_s >= 0.0:
            meter.add_stage("collate", collate_s, nbytes)
        meter.wait_end(samples=samples, nbytes=nbytes)
        if self._profiler():  # the next wait is a profiler range
            self.begin = self._begin_traced
        return batch, samples


# -------------------------------------------------------------------------- 4. device hand-off
class Handoff:
    """Step 4: device idle for input, as CUDA events around the hand-off (or nothing)."""

    def __init__(self, meter: StallMeter, feed: Prefetcher | None) -> None:
        self._clock = meter.device_clock if feed is not None and meter.enabled else None

    @property
    def active(self) -> bool:
        """Whether there is a device clock (else every call is a no-op the iterator skips)."""
        return self._clock is not None

    def begin(self) -> Any:
        """The stream's previous work ends here: a mark (None without a clock)."""
        return self._clock.begin() if self._clock is not None else None

    def cancel(self, mark: Any) -> None:
        if self._clock is not None:
            self._clock.cancel(mark)

    def end(self, mark: Any, on_device: Any) -> None:
        """Hand-off done: the consumer stream waits for the copy (no device batch: cancel)."""
        clock = self._clock
        if clock is None:
            return
        if on_device is None:
            clock.cancel(mark)
        else:
            clock.end(mark)


# -------------------------------------------------------------------------------- 5. finalise
class Finalise:
    """Step 5: a batch in a worker's shared slot becomes views that hold the slot while they
    live; any other batch passes (and counts as torch's path, with slots on)."""

    def __init__(self, slots: Slots | None) -> None:
        self._slots = slots

    def host(self, batch: Any) -> Any:
        """The one place a delivered host batch is finished."""
        slots = self._slots
        if slots is None:
            return batch
        if type(batch) is SlotRef:
            return slots.resolve(batch)[0]
        slots.fallback += 1
        return batch

    def for_feed(self, batch: Any) -> Any:
        """A batch on its way to the device feed (pinned in place: copied from the slot)."""
        slots = self._slots
        if slots is None:
            return batch
        if type(batch) is SlotRef:
            batch, pinned = slots.resolve(batch)
            return PinnedBatch(batch) if pinned else batch
        slots.fallback += 1
        return batch
