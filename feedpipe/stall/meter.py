"""Stall counters: how long the training loop waited for input, and which stage is to blame.

A :class:`StallMeter` is on by default in every ``feedpipe.DataLoader``. It keeps a handful of
counters that cost one packed append per batch on the hot path (48 bytes, one C call; folded
4096 at a time, vectorised, by :mod:`feedpipe.stall.records`):

- the *stall*: time the loop blocked inside ``next()`` (``record_batch``, or
  ``wait_begin``/``wait_end``);
- the *step*: time between one ``wait_end`` and the next ``wait_begin`` (the user's compute)
  while a pass over the data is in progress;
- the time *outside* iteration: from the end of one pass (``StopIteration``, ``break`` or an
  abandoned iterator) to the first wait of the next, e.g. validation, logging or a checkpoint
  between epochs. It is neither stall nor step, and is reported on its own;
- per-stage seconds and bytes ("fetch", "decode", "collate", "pin", "h2d"), queue depths;
- a fixed log-bucket histogram of waits for p50/p99 (bounded memory, ~700 integers);
- optional user regions: ``with meter.region("forward"): ...``.

``meter.stats()`` is a JSON-able :class:`StallStats` snapshot; ``meter.summary()`` is one line
and ``meter.report()`` a few lines ending with a plain-language hint. Sinks (logging, JSON lines,
TensorBoard, a distributed summary over torch.distributed) attach with :meth:`StallMeter.add_sink`.
``StallMeter(enabled=False)`` returns a meter whose methods do nothing: pass it as
``DataLoader(..., meter=StallMeter(enabled=False))`` to turn the counters off.

**The slowest stage.** Stage seconds are summed over every thread or worker that ran the stage,
so with W workers a stage can accumulate W seconds per second of wall time; comparing raw totals
would blame whichever stage has the most parallel copies. Each stage is instead judged by its
*effective* time per batch: its latency per call (``seconds / calls``, one call per batch)
divided by its parallelism (``workers`` for :data:`WORKER_STAGES` "fetch", "decode", "collate",
which the loader reports with ``set_workers``; 1 for "pin" and "h2d", which run on one thread or
stream). That is the interval at which the stage can deliver batches; the slowest stage is the
largest, and the report sets it against the step time. ``input_busy`` is the share of the
workers' time spent in worker stages: 20% busy means the input is idle 80% of the time.

**Passes.** A loader calls ``pass_begin(at)`` when ``iter()`` is called and ``pass_end()`` when
the iterator ends (``StopIteration``) or is dropped (``break``). Once no pass is active, the
clock runs as *outside* until the next ``iter()``. The loader's own time at the turn of an
epoch counts as stall: the ``next()`` that raised ``StopIteration``, and a later pass's
``iter()`` up to its first wait (starting workers). The first pass's clock starts at its first
wait, and time after the last pass (a final evaluation) is in no total. Callers that only use
``wait_begin``/``wait_end`` never end a pass, so all their time between waits is step.

**GIL contention.** Thread workers share the GIL with the training loop. ``input_cpu_s`` is the
CPU time the process spent outside the loop's thread while the meter ran (thread workers only);
set against the worker stages' seconds it tells a CPU-bound fetch (which, if it holds the GIL,
slows the step too) from one that waits on I/O.

**The GPU's own view.** With ``device="cuda"`` the loader calls :meth:`StallMeter.watch_device`
and the meter records two CUDA events per batch (:class:`~feedpipe.stall.device.DeviceClock`):
``device_idle_s`` is the time the consumer's stream waited for its input, on the GPU's clock,
beside the host-side stall.

**Profiler ranges.** While ``torch.profiler`` records, each wait is a ``record_function`` range
("feedpipe.wait"); while an NVTX tool such as Nsight Systems is attached (see
:mod:`feedpipe.io.trace`), it is also an NVTX range "feedpipe/wait" in the loop's thread.

One meter may be shared by several loaders; ``wait_begin``/``wait_end`` must then come from one
thread (the training loop), which is how loaders are iterated. ``add_stage`` and ``set_depth``
may be called from any thread.
"""

from __future__ import annotations

import array
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from feedpipe.stall.counters import Counters
from feedpipe.stall.device import DeviceClock
from feedpipe.stall.distributed import DistributedSink, DistributedSummary, gather_stats
from feedpipe.stall.profiler import WaitRanges
from feedpipe.stall.records import FIELDS, RECORD
from feedpipe.stall.report import format_report, format_summary
from feedpipe.stall.sinks import JsonlSink, LoggingSink, Sink, SinkSet, TensorBoardSink
from feedpipe.stall.stages import WORKER_STAGES
from feedpipe.stall.stats import StageStats, StallStats

__all__ = [
    "WORKER_STAGES",
    "DistributedSink",
    "DistributedSummary",
    "JsonlSink",
    "LoggingSink",
    "NullMeter",
    "Sink",
    "StageStats",
    "StallMeter",
    "StallStats",
    "TensorBoardSink",
    "gather_stats",
]

_T = TypeVar("_T")
_perf = time.perf_counter
_pack = RECORD.pack


class StallMeter:
    """Always-on counters shared by one or more loaders (see the module docstring).

    Interface used by loaders (stable):
      - ``record_batch(begin, end, samples, nbytes, fetch_s, collate_s)``: one call per batch,
        with ``perf_counter`` readings taken around the blocking part of ``next()``
        (``feedpipe.DataLoader``); while :attr:`tracing` is true, use the two calls below
        instead so the wait is also a profiler range.
      - ``wait_begin()`` / ``wait_end(samples=0, nbytes=0)`` around the blocking part of
        ``next()`` (the same record in two calls); ``wait_pending(begin)`` for a wait that
        ended without a batch (StopIteration).
      - ``add_stage(name, seconds, nbytes=0)`` from any thread, for other per-stage times
        ("decode", "pin", "h2d", ...).
      - ``set_depth(name, n)`` for queue depths; ``set_workers(n, worker_type)`` for the
        worker count and kind ("thread" or "process").
      - ``pass_begin(at)`` when ``iter()`` starts a pass, ``pass_end()`` when it ends or is
        dropped; the time from the last pass end to the next ``iter()`` is *outside*.
      - ``profiler_check`` (bound once per pass, called per batch) or :attr:`profiler_active`;
        ``open_range(name)`` / ``close_range()`` and :attr:`range_open` for a loader that opens
        the wait's profiler range itself.

    It owns its counters (:class:`~feedpipe.stall.counters.Counters`: the batch log and what it
    is folded into), its profiler ranges (:class:`~feedpipe.stall.profiler.WaitRanges`) and its
    sinks (:class:`~feedpipe.stall.sinks.SinkSet`).

    Args:
        enabled: ``False`` returns a meter whose methods do nothing (counters off).
        trace: emit ``torch.profiler.record_function`` ranges ("feedpipe.wait",
            "feedpipe.region.NAME") so waits show up in profiler traces. ``"auto"`` (default)
            emits them only while a torch profiler is recording; ``True`` always; ``False`` never.
    """

    enabled = True
    _FIELDS = FIELDS  # numbers per batch record in _waits
    _FOLD = FIELDS * 4096  # pending record numbers (4096 batches) folded at a time

    def __new__(cls, enabled: bool = True, trace: bool | Literal["auto"] = "auto") -> StallMeter:
        if not enabled and cls is StallMeter:
            return super().__new__(NullMeter)
        return super().__new__(cls)

    def __init__(self, enabled: bool = True, trace: bool | Literal["auto"] = "auto") -> None:
        self._counters = Counters()
        self._clock = self._counters.clock  # the same object for the meter's life
        self._sinks = SinkSet()
        self._ranges = WaitRanges(trace)
        #: the flag loaders call once per batch: whether waits are profiler ranges right now
        self.profiler_check: Callable[[], bool] = self._ranges.active
        # a record is followed by after_batch() once len(_waits) reaches fold_at: _FOLD normally,
        # 0 while sinks are attached or a profiler range is open (one comparison per batch)
        self.fold_at = self._FOLD
        self.workers = 0
        self.worker_type: str | None = None
        self.settings: tuple[bool | None, int | None] = (None, None)  # set_settings
        self.notes: list[str] = []  # lines a loader adds to the report (its tuning decisions)
        # times the counters were zeroed or loaded: a window of deltas across one is void
        self.resets = 0
        # the batch log: its object never changes (loaders bind it, and its frombytes, per pass)
        self._waits: array.array[float] = self._counters.log
        self._put = self._waits.frombytes

    # ------------------------------------------------------------------ hot path
    # The hot path only appends: each batch packs six doubles (begin, end, samples, nbytes,
    # fetch_s, collate_s; a negative stage time means "no such stage") into the array
    # ``_waits`` in one C call (feedpipe.stall.records), folded by the counters 4096 batches at
    # a time, vectorised, or when they are read. A loader reads the clock itself around the
    # blocking part of ``next()`` and appends the same record (``batch_log``);
    # ``wait_begin``/``wait_end`` are the same record split in two, for other callers.
    def record_batch(  # noqa: PLR0917 - positional on the hot path
        self,
        begin: float,
        end: float,
        samples: int = 0,
        nbytes: int = 0,
        fetch_s: float = -1.0,
        collate_s: float = -1.0,
    ) -> None:
        """One batch in one call: the loop waited from ``begin`` to ``end`` (``perf_counter``).

        ``fetch_s`` / ``collate_s`` are the batch's "fetch" and "collate" stage times (negative:
        the stage did not run). Equivalent to ``wait_begin(); wait_end(samples, nbytes)`` at
        those instants plus ``add_stage`` for each stage, at a fraction of the cost.
        ``feedpipe.DataLoader`` inlines this body (:meth:`batch_log`).
        """
        self._put(_pack(begin, end, samples, nbytes, fetch_s, collate_s))
        if len(self._waits) >= self.fold_at:
            self.after_batch(end)

    def batch_log(self) -> tuple[Any, Any, array.array[float]]:
        """``(put, pack, log)`` for a loader that inlines :meth:`record_batch`, bound once per
        pass: ``put(pack(begin, end, samples, nbytes, fetch_s, collate_s))``, then
        ``meter.after_batch(end)`` when ``len(log) >= meter.fold_at``."""
        return self._put, _pack, self._waits

    def wait_begin(self) -> None:
        """The loop starts waiting for a batch; the time since the last ``wait_end`` is step."""
        clock = self._clock
        now = clock.wait_start = _perf()
        if clock.first_begin is None and not self._waits:
            clock.first_begin = now
        if self.profiler_check():
            self.close_range()  # the previous wait raised instead of delivering
            self.open_range("feedpipe.wait")

    def wait_end(self, samples: int = 0, nbytes: int = 0) -> None:
        """The batch arrived: add the wait, count the batch, its samples and bytes."""
        now = _perf()
        clock = self._clock
        begin, clock.wait_start = clock.wait_start, None
        if begin is None:
            raise RuntimeError("StallMeter.wait_end() without a matching wait_begin()")
        self._put(_pack(begin, now, samples, nbytes, -1.0, -1.0))
        if len(self._waits) >= self.fold_at:
            self.after_batch(now)

    def wait_pending(self, begin: float) -> None:
        """A wait began at ``begin`` and has not delivered a batch (e.g. the epoch ended): the
        step before it counts; what ``wait_begin`` does, for callers that read the clock."""
        clock = self._clock
        clock.wait_start = begin
        if clock.first_begin is None and not self._waits:
            clock.first_begin = begin

    def add_skipped(self, n: int) -> None:
        """Count ``n`` samples dropped by ``DataLoader(on_error="skip")`` (not on the hot path)."""
        self._counters.skipped += n

    def add_stage(self, name: str, seconds: float, nbytes: int = 0) -> None:
        """Add ``seconds`` (and ``nbytes``) to stage ``name``; callable from any thread."""
        self._counters.stages.add(name, seconds, nbytes)

    @property
    def tracing(self) -> bool:
        """Whether waits are profiler ranges right now (then use ``wait_begin``/``wait_end``)."""
        return bool(self.profiler_check())

    @property
    def profiler_active(self) -> bool:
        """The same as :attr:`tracing`: a profiler (torch's or an NVTX tool) wants ranges."""
        return bool(self.profiler_check())

    def set_depth(self, name: str, n: int) -> None:
        """Record the current depth of queue ``name`` (e.g. "ready", "prefetch")."""
        self._counters.depth[name] = n

    def set_workers(self, n: int, worker_type: str | None = None) -> None:
        """Number of loader workers running :data:`WORKER_STAGES` in parallel (0 = in-process)
        and their kind, ``"thread"`` or ``"process"`` (``None``: unknown or in-process)."""
        self.workers = int(n)
        self.worker_type = worker_type if n else None

    def set_settings(self, persistent_workers: bool | None, prefetch_factor: Any = None) -> None:
        """The loader's ``persistent_workers`` and ``prefetch_factor`` (an int, else unknown),
        so the hint never suggests a setting already in force (``feedpipe.stall.hints``)."""
        prefetch = prefetch_factor if isinstance(prefetch_factor, int) else None
        self.settings = (persistent_workers, prefetch)

    # ------------------------------------------------------------------ profiler ranges
    @property
    def range_open(self) -> bool:
        """Whether the current wait's profiler range is open."""
        return self._ranges.is_open

    @property
    def _range(self) -> tuple[Any] | None:
        return self._ranges.current

    def open_range(self, name: str) -> None:
        """Open the wait's ranges: NVTX "feedpipe/wait" and, while torch's profiler records,
        ``record_function(name)``; the next batch record closes them (:meth:`after_batch`)."""
        self._ranges.open(name)
        self.fold_at = 0

    def close_range(self) -> None:
        """Close the wait's ranges, if open (a wait that raised instead of delivering)."""
        self._ranges.close()

    # ------------------------------------------------------------------ passes
    def pass_begin(self, at: float | None = None) -> None:
        """A pass over the data starts: ``iter(loader)`` was called at ``at`` (default: now).

        Call from the training loop's thread. Ends the time *outside* iteration, if no pass was
        active; from ``at`` to the pass's first wait (workers starting) is the loader's: stall.
        """
        self._counters.pass_begin(_perf() if at is None else at)

    def pass_end(self) -> None:
        """A pass ended: its iterator raised ``StopIteration`` or was dropped (``break``).

        A pending wait (the ``next()`` that raised ``StopIteration``) counts as stall up to now.
        When no other pass is active, the time from now to the next ``pass_begin`` is *outside*.
        """
        now = _perf()
        if self.range_open:  # the wait that ended the pass delivered no batch
            self.close_range()
            self._set_fold_at()
        self._counters.pass_end(now)

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a user region: ``with meter.region("forward"): ...`` (also a profiler range:
        ``feedpipe.region.NAME`` for torch's profiler, ``feedpipe/region/NAME`` for NVTX)."""
        with self._ranges.region(name):
            t0 = _perf()
            try:
                yield
            finally:
                self._counters.add_region(name, _perf() - t0)

    def watch_device(self, device: Any) -> DeviceClock | None:
        """Measure *device idle for input* on ``device`` (CUDA only; else returns ``None``).

        The loader calls it for ``device="cuda"``; it then calls ``device_clock.begin()`` when
        ``next()`` starts and ``device_clock.end(a)`` after the hand-off (see
        :mod:`feedpipe.stall.device`). Idempotent for one device."""
        return self._counters.device.watch(device)

    @property
    def device_clock(self) -> DeviceClock | None:
        """The CUDA events at hand-off, once :meth:`watch_device` found a CUDA device."""
        return self._counters.device.clock

    @device_clock.setter
    def device_clock(self, clock: DeviceClock | None) -> None:
        self._counters.device.clock = clock  # an attribute before: assignable, as it was

    def metered_pass(self, batches: Iterable[_T]) -> Iterator[_T]:
        """Iterate ``batches`` as one pass: ``pass_begin`` first, ``pass_end`` when it is
        exhausted or dropped (``break``), for loaders written as generators."""
        self.pass_begin()
        try:
            yield from batches
        finally:
            self.pass_end()

    # ------------------------------------------------------------------ readings
    def _fold(self) -> None:
        """Fold pending batch records into the totals (any thread)."""
        self._counters.fold()

    @property
    def _hist(self) -> Any:
        """The wait histogram (numpy int64 counts) of the folded records."""
        return self._counters.totals.hist

    @property
    def wait_max_s(self) -> float:
        """The longest wait, in seconds."""
        self._fold()
        return self._counters.totals.wait_max_s

    @property
    def stall_s(self) -> float:
        """Seconds the loop spent waiting in ``next()`` (including the ``next()`` that raised
        ``StopIteration``) and, for every pass after the first, in ``iter()``."""
        self._fold()
        return self._clock.stall_s(self._counters.totals.stall_s)

    @property
    def batches(self) -> int:
        """Batches delivered (completed waits)."""
        return self._counters.batches()

    @property
    def samples(self) -> int:
        """Samples delivered."""
        self._fold()
        return self._counters.totals.samples

    @property
    def bytes(self) -> int:
        """Bytes delivered."""
        self._fold()
        return self._counters.totals.bytes

    @property
    def step_s(self) -> float:
        """Seconds between each ``wait_end`` and the next ``wait_begin`` inside a pass."""
        self._fold()
        return self._clock.step_s(self._counters.totals.stall_s)

    @property
    def outside_s(self) -> float:
        """Seconds outside iteration: from each pass's end to the next pass's first wait."""
        self._fold()
        return self._clock.outside_s()

    @property
    def steps(self) -> int:
        """Completed steps: one before each wait after the first, plus the one in progress when
        a wait is pending or a pass ended with ``break``."""
        self._fold()
        return self._clock.steps(self.batches)

    @property
    def last_wait(self) -> tuple[float, float]:
        """``(begin, end)`` perf_counter times of the latest completed wait (0, 0 if none)."""
        return self._counters.last_wait()

    @property
    def stage_s(self) -> dict[str, float]:
        return self._counters.stages.seconds()

    @property
    def stage_bytes(self) -> dict[str, int]:
        return self._counters.stages.nbytes()

    @property
    def stage_calls(self) -> dict[str, int]:
        return self._counters.stages.calls()

    @property
    def region_s(self) -> defaultdict[str, float]:
        """Seconds per user region (:meth:`region`)."""
        return self._counters.region_s

    @property
    def depth(self) -> dict[str, int]:
        """The latest depth of each queue (:meth:`set_depth`)."""
        return self._counters.depth

    @property
    def skipped(self) -> int:
        """Samples dropped by ``DataLoader(on_error="skip")``."""
        return self._counters.skipped

    # ------------------------------------------------------------------ snapshots
    def reset(self) -> None:
        """Zero every counter (sinks, workers and trace settings are kept)."""
        self._counters.reset()
        self.resets += 1
        self._sinks.restart(_perf())

    def quantile(self, q: float) -> float:
        """Wait time (seconds) at quantile ``q`` in [0, 1], from the log-bucket histogram."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        self._fold()
        return self._counters.totals.quantile(q)

    def stats(self) -> StallStats:
        """A consistent, JSON-able snapshot of the counters and the rates derived from them."""
        return self._counters.stats(self.workers, self.worker_type, self.settings)

    def summary(self) -> str:
        """One line: stall %, p50/p99 wait, throughput, slowest stage."""
        return format_summary(self.stats())

    def report(self) -> str:
        """Several lines: totals, per-stage table, regions, a plain-language hint, and the
        lines loaders added with :meth:`note`."""
        return "\n".join([format_report(self.stats()), *(f"  {n}" for n in self.notes)])

    def note(self, line: str) -> None:
        """Add ``line`` to :meth:`report` (once; e.g. a tuning decision, with its figures)."""
        self.notes.append(line)

    def gather(self, group: Any = None) -> DistributedSummary:
        """Collective: gather every rank's stats over ``group`` (default: the world)."""
        return gather_stats(self.stats(), group)

    def state_dict(self) -> dict[str, Any]:
        """Counters as a small JSON-able dict, so totals survive a resume."""
        return self._counters.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict` (the wait/step clocks restart)."""
        self.reset()
        self._counters.load_state_dict(state)

    # ------------------------------------------------------------------ sinks
    def add_sink(self, sink: Sink) -> Sink:
        """Attach a sink (:class:`LoggingSink`, :class:`JsonlSink`, ...); polled in ``wait_end``."""
        self._sinks.add(sink, _perf(), self.batches)
        self.fold_at = 0
        return sink

    def remove_sink(self, sink: Sink) -> None:
        self._sinks.remove(sink)
        self._set_fold_at()

    def close(self) -> None:
        """Flush and close every sink (a final emit for sinks that want one)."""
        self._sinks.close(self.stats)
        self._set_fold_at()

    def _set_fold_at(self) -> None:
        self.fold_at = 0 if self._sinks or self.range_open else self._FOLD

    def after_batch(self, now: float) -> None:
        """The rare part of a batch record (``record_batch``, ``wait_end``, a loader's inlined
        record once ``len(log) >= fold_at``): fold, close the profiler range, poll the sinks."""
        if len(self._waits) >= self._FOLD:
            self._fold()
        self.close_range()
        self._set_fold_at()
        if self._sinks:
            self._sinks.poll(now, self.batches, self.stats, self)


class NullMeter(StallMeter):
    """A meter that records nothing: what ``StallMeter(enabled=False)`` returns (beside
    :class:`StallMeter`, whose constructor returns it: :mod:`feedpipe.stall.null` is its path)."""

    enabled = False

    def __init__(self, enabled: bool = False, trace: bool | Literal["auto"] = False) -> None:
        super().__init__(True, False)

    def wait_begin(self) -> None:
        pass

    def wait_end(self, samples: int = 0, nbytes: int = 0) -> None:
        pass

    def record_batch(  # noqa: PLR0917 - positional on the hot path
        self,
        begin: float,
        end: float,
        samples: int = 0,
        nbytes: int = 0,
        fetch_s: float = -1.0,
        collate_s: float = -1.0,
    ) -> None:
        pass

    def wait_pending(self, begin: float) -> None:
        pass

    def add_stage(self, name: str, seconds: float, nbytes: int = 0) -> None:
        pass

    def pass_begin(self, at: float | None = None) -> None:
        pass

    def pass_end(self) -> None:
        pass

    def set_depth(self, name: str, n: int) -> None:
        pass

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        yield

    def add_sink(self, sink: Sink) -> Sink:
        return sink

    def watch_device(self, device: Any) -> None:
        return None
