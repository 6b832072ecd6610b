"""``Tuner``: ``num_workers="auto"``, ``prefetch_factor="auto"``, ``worker_type="auto"`` decided
by measurement (docs/autotune.md).

The tuner takes readings from the loader's own stall meter (the loop's wait and step time, the
worker stages' seconds, batches delivered) and from the CPU clocks (``time.process_time`` less
the loop thread's ``time.thread_time`` for thread workers, or on Linux each worker thread's
CPU and run-queue wait from ``/proc/self/task/*/schedstat``, so that a host short of cores does
not pass for a light load; for worker processes, each of this loader's own workers' CPU,
:mod:`feedpipe.loader.tuner_cpu`), over windows of about
:attr:`Tuner.window_s`, and hands each window to the pure rule of
:mod:`feedpipe.loader.tuner_policy`. Thread workers change online (the pool asks
:meth:`Tuner.online` between deliveries); process workers and a change of worker kind apply at
the next ``iter()`` (:meth:`Tuner.at_epoch`). Every decision is one line of :attr:`Tuner.log`
and of the meter's report (``StallMeter.note``), with the figures that caused it.

Which samples make up which batch, and their order, never depend on the settings: the index
stream draws the batches and the hand-off delivers them in batch order whatever the worker
count. The tuner reads only this process's clocks and counters: no collective, so no rank waits
for another's tuning.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch.utils.data as tud

from feedpipe.io.values import integer
from feedpipe.loader.plan import auto_worker_type
from feedpipe.loader.tuner_cpu import ProcessCPU, cpu_between
from feedpipe.loader.tuner_policy import (
    NO_GAIN_BATCHES,
    VOTES,
    Decision,
    Limits,
    Reading,
    Settings,
    decide,
    majority,
)
from feedpipe.stall.stages import WORKER_STAGES

__all__ = [
    "AUTO",
    "DEFAULT_CPU_BUDGET",
    "Tuner",
    "available_cores",
    "check_budget",
    "tuner_for",
]

AUTO = "auto"
#: the default share of the cores the workers may use: SPDL's guidance for sharing a host with
#: a training process and noisy neighbours is to stay under about 40%; at least one core
DEFAULT_CPU_BUDGET = 0.4
#: the most thread workers per core (I/O-bound reads overlap many per core)
THREADS_PER_CORE = 4


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def check_budget(cpu_budget: Any) -> float:
    """``cpu_budget`` as a share of the cores in (0, 1] (``None``: the default), else an error."""
    if cpu_budget is None:
        return DEFAULT_CPU_BUDGET
    if isinstance(cpu_budget, bool) or not isinstance(cpu_budget, (int, float)):
        raise TypeError(f"cpu_budget must be a share of the cores in (0, 1], got {cpu_budget!r}")
    if not 0 < cpu_budget <= 1 or math.isnan(cpu_budget):
        raise ValueError(
            f"cpu_budget must be a share of the cores in (0, 1], got {cpu_budget!r} "
            "(e.g. 0.4: the workers may use 40% of the cores)"
        )
    return float(cpu_budget)


_TASKS = "/proc/self/task"


def _thread_demand() -> dict[int, tuple[float, float]] | None:
    """Per thread other than the caller: (CPU seconds run, seconds ready to run but waiting for
    a core), from Linux ``schedstat``; None where the OS does not tell."""
    me = threading.get_native_id()
    out: dict[int, tuple[float, float]] = {}
    try:
        tids = [int(t) for t in os.listdir(_TASKS)]
    except (OSError, ValueError):
        return None
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat", "rb") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        if tid != me:
            out[tid] = (int(run) / 1e9, int(wait) / 1e9)
    return out


def _cpu() -> float:
    """The thread workers' CPU so far: the process's less the caller's thread (ended threads
    included)."""
    return time.process_time() - time.thread_time()


def _threads_delta(
    new: dict[int, tuple[float, float]], old: dict[int, tuple[float, float]], tids: Collection[int]
) -> tuple[float, float]:
    """(CPU seconds run, seconds waiting for a core) of the threads ``tids`` between two
    readings of :func:`_thread_demand` (a thread started since counts from zero)."""
    run = wait = 0.0
    for tid in tids:
        if tid in new:
            r0, w0 = old.get(tid, (0.0, 0.0))
            run, wait = run + new[tid][0] - r0, wait + new[tid][1] - w0
    return run, wait


class _Mark:
    """The counters at the start of a window."""

    __slots__ = ("at", "batches", "busy", "cpu", "procs", "resets", "stall", "step", "threads")

    def __init__(self, meter: Any, kind: str, procs: ProcessCPU) -> None:
        self.at = time.perf_counter()
        self.stall, self.step, self.batches = meter.stall_s, meter.step_s, meter.batches
        self.resets = getattr(meter, "resets", 0)  # reset or loaded since: the window is void
        stage_s = meter.stage_s
        self.busy = sum(v for k, v in stage_s.items() if k in WORKER_STAGES)
        thread = kind == "thread"
        self.cpu = _cpu() if thread else 0.0
        self.threads = _thread_demand() if thread else None
        self.procs = None if thread else procs.snapshot()  # this loader's worker processes


class Tuner:
    """The auto settings of one loader, their decision log and the readings behind them."""

    #: the shortest window a decision is taken over (seconds of wall time)
    window_s = 0.25
    #: the worker processes' CPU is read at most this often (a reading is a file read per
    #: worker, some microseconds): what a worker runs after its last reading is not counted
    sample_s = 0.025

    def __init__(
        self,
        *,
        workers: bool,
        prefetch: bool,
        kind: bool,
        start: Settings,
        cpu_budget: float | None = None,
        per_sample: bool = False,
        fixed_workers: bool = False,
    ) -> None:
        self.cpu_budget = check_budget(cpu_budget)
        self.cores = available_cores()
        self.auto = {"num_workers": workers, "prefetch_factor": prefetch, "worker_type": kind}
        self.settings = start
        self._pending: Settings | None = None  # a change waiting for the next epoch boundary
        budget = self.cpu_budget * self.cores
        self._limits = Limits(
            # the default leaves the rest to the training process, but never less than a core
            budget_cores=max(1.0, budget) if cpu_budget is None else budget,
            max_workers=1,
            workers=workers and not fixed_workers,
            kind=kind,
            prefetch=prefetch,
            per_sample=per_sample,
        )
        self.log: list[str] = []
        self._last_reason = ""
        self._mark: _Mark | None = None
        self._grew_from: tuple[float, int] | None = None  # (batches/s, workers) before growth
        self._grew_left = 0
        self._recent: list[tuple[Settings, Reading]] = []  # the last windows (online), oldest first
        self._ceiling: int | None = None  # a worker count growth did not help past
        self._meter: Any = None
        self._procs = ProcessCPU()  # this loader's worker processes (process workers)
        self._sampled = 0.0  # when they were last read
        self._read_online = False  # whether this pass took a reading online (thread pool)
        self.persistent = False  # the loader's persistent_workers (apply)

    # ----------------------------------------------------------------------------- reading
    @property
    def limits(self) -> Limits:
        """The budget in cores and the most workers of the current kind."""
        most = self.cores * (THREADS_PER_CORE if self.settings.kind == "thread" else 1)
        if self._ceiling is not None:
            most = min(most, self._ceiling)
        limits = replace(self._limits, max_workers=max(1, most))
        if self.persistent:  # persistent workers: threads resize, nothing else changes
            thread = self.settings.kind == "thread"
            limits = replace(limits, kind=False, workers=limits.workers and thread,
                             prefetch=limits.prefetch and thread)  # fmt: skip
        return limits

    def view(self) -> dict[str, Any]:
        """``loader.tuning``: what is auto, the current settings, the budget and the log."""
        s = self.settings
        return {
            "auto": [k for k, v in self.auto.items() if v],
            "num_workers": s.workers,
            "worker_type": s.kind,
            "prefetch_factor": s.prefetch,
            "cpu_budget": self.cpu_budget,
            "budget_cores": self.limits.budget_cores,
            "pending": None if self._pending is None else dict(vars(self._pending)),
            "log": list(self.log),
        }

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["_mark"] = state["_meter"] = None  # a copy measures its own passes
        state["_procs"] = ProcessCPU()
        return state

    def watch(self, pids: Collection[int]) -> Callable[[], None] | None:
        """A pass's worker processes (``pids``; none for threads or no workers): their CPU is
        this loader's workers'. Returns what the loop calls after each delivery (None: nothing
        to call), which reads them at most every :attr:`sample_s`: a worker that exits at the
        end of its pass keeps its CPU up to its last reading."""
        if not pids or not self._procs.available:
            return None
        self._procs.watch(pids)
        self._sampled = time.perf_counter()
        return self.tick

    def tick(self) -> None:
        """After a delivery: read the worker processes' CPU if :attr:`sample_s` has passed."""
        now = time.perf_counter()
        if now - self._sampled >= self.sample_s:
            self._sampled = now
            self._procs.sample()

    # ---------------------------------------------------------------------------- deciding
    def begin(self, meter: Any) -> None:
        """A pass starts (``iter()``): its first window starts now."""
        self._meter = meter
        self._mark = _Mark(meter, self.settings.kind, self._procs) if meter.enabled else None
        self._read_online = False

    def apply(self, loader: Any) -> None:
        """At ``iter()``: set ``loader``'s ``num_workers``, ``prefetch_factor`` and
        ``worker_type`` for the pass it starts (:meth:`at_epoch`; a change makes the loader
        resolve a fresh plan), and start the pass's first window.

        ``persistent_workers``: the loader keeps its workers and so draws no new base seed, as
        a fixed persistent loader does: a thread pool takes the settings when it starts
        (``WorkerSources``), process workers and the worker kind stay as they are."""
        self.persistent = bool(loader.persistent_workers)
        settings = self.at_epoch(loader.meter)
        if self.persistent:
            self.begin(loader.meter)
            return
        loader.num_workers = settings.workers
        if self.auto["prefetch_factor"]:
            loader.prefetch_factor = settings.prefetch
        if settings.kind != loader.worker_type:
            loader.worker_type = settings.kind
        self.begin(loader.meter)

    def at_epoch(self, meter: Any) -> Settings:
        """At ``iter()``: the settings for the next pass. Process workers are judged over the
        whole last pass here, and so are threads that took no reading online (a pass shorter
        than a window, or a device feed's pool); a kind change decided online applies now."""
        judge = self.settings.kind == "process" or not self._read_online
        if judge and self._mark is not None and meter is self._meter:
            self._decide(self._read(meter), online=False)
        if self._pending is not None:  # another kind: what did not help threads may help it
            self.settings, self._pending, self._ceiling = self._pending, None, None
        return self.settings

    def online(
        self, workers: int, tids: Callable[[], Collection[int]] | None = None
    ) -> Settings | None:
        """From the thread pool between deliveries: new settings for it now, or None.

        ``workers``: the pool's own count; ``tids``: gives its threads' native ids, whose CPU is
        the workers' (other threads of the process, e.g. a process group's, are not); asked only
        when a window closes, not at every delivery."""
        mark, meter = self._mark, self._meter
        if (
            mark is None
            or self._pending is not None
            or time.perf_counter() - mark.at < self.window_s
        ):
            return None
        # too few batches to judge: the window goes on (after a growth, until it can be judged)
        need = 4 if self._grew_from is None else NO_GAIN_BATCHES
        if meter.batches - mark.batches < need:
            return None
        reading = self._read(meter, None if tids is None else tids())
        self._read_online = True
        before = self.settings
        self._decide(reading, online=True)
        now = self.settings
        return now if (now.workers, now.prefetch) != (before.workers, before.prefetch) else None

    def _read(self, meter: Any, tids: Collection[int] | None = None) -> Reading:
        """The window since the last mark, and a new mark."""
        mark = self._mark
        assert mark is not None
        new = _Mark(meter, self.settings.kind, self._procs)
        self._mark = new
        reset = new.resets != mark.resets  # e.g. headspace's live run, and its restore
        if reset or new.batches < mark.batches or new.stall < mark.stall:  # the meter was reset
            return Reading(0.0, 0.0, 0.0, None, 0)
        cpu: float | None = new.cpu - mark.cpu
        queued = 0.0
        if self.settings.kind != "thread":  # each worker process's own (None: unknown)
            cpu = cpu_between(new.procs, mark.procs)
        elif tids is not None and new.threads is not None and mark.threads is not None:
            cpu, queued = _threads_delta(new.threads, mark.threads, tids)  # the pool's own
        busy = new.busy - mark.busy
        reading = Reading(
            wait_s=new.stall - mark.stall,
            step_s=new.step - mark.step,
            busy_s=busy,
            cpu_s=cpu,
            starved_s=queued / max(1, self.settings.workers),
            span_s=new.at - mark.at if self.settings.kind == "thread" else None,
            batches=new.batches - mark.batches,
            grew_from=None if self._grew_from is None else self._grew_from[0],
            grew_at=None if self._grew_from is None else self._grew_from[1],
        )
        self._grew_left -= 1  # the windows after a growth that may still undo it
        if self._grew_left <= 0:
            self._grew_from = None
        return reading

    def _decide(self, reading: Reading, *, online: bool) -> None:
        """Apply :func:`decide` to ``reading`` (online: to the last :data:`VOTES` windows under
        the current settings, by :func:`majority`); log what changed (and a stop, once)."""
        before = self.settings
        decision = self._vote(reading) if online else decide(reading, before, self.limits)
        if decision is None:
            return
        now = decision.settings
        pending = online and now.kind != before.kind
        if pending:  # processes start at the next epoch boundary
            self._pending, now = now, before
        elif now.workers > before.workers:
            # the batches/s before it: the median of the windows that voted (online)
            rates = [r.rate for _, r in self._recent] if online else [reading.rate]
            self._grew_from = (statistics.median(rates), before.workers)
            self._grew_left = VOTES if online else 1
        if decision.ceiling is not None:
            self._ceiling = decision.ceiling
        self.log_decision(decision, before, pending=pending)
        self.settings = now

    def _vote(self, reading: Reading) -> Decision | None:
        """The rule over the last :data:`VOTES` windows under the current settings, this one
        the latest: the change a majority calls for (:func:`majority`)."""
        now = self.settings
        if reading.batches >= 2:  # a void window (the meter was reset) has no vote
            kept = [r for r in self._recent if r[0] == now]
            self._recent = [*kept, (now, reading)][-VOTES:]
        limits = self.limits
        return majority([decide(r, now, limits) for s, r in self._recent if s == now], now)

    def log_decision(self, decision: Decision, before: Settings, *, pending: bool = False) -> None:
        """One log line per change; a decision that keeps the settings only once in a row."""
        reason_kind = decision.reason.split(":", 1)[0]
        if decision.settings == before and reason_kind == self._last_reason:
            return
        self._last_reason = reason_kind if decision.settings == before else ""
        line = decision.line(before) + (" (from the next epoch)" if pending else "")
        self.log.append(line)
        meter = self._meter
        if meter is not None and callable(getattr(meter, "note", None)):
            meter.note(f"tuning: {line}")


def _check_args(num_workers: Any, prefetch_factor: Any) -> None:
    """Clear errors for settings that are neither a count nor ``"auto"``."""
    if not integer(num_workers) and num_workers != AUTO:
        raise ValueError(f"num_workers must be a non-negative int or 'auto', got {num_workers!r}")
    ok = prefetch_factor is None or integer(prefetch_factor) or prefetch_factor == AUTO
    if not ok:
        raise ValueError(
            f"prefetch_factor must be a positive int, None or 'auto', got {prefetch_factor!r}"
        )


def tuner_for(  # noqa: PLR0917 - the loader's arguments that auto-tuning reads
    dataset: Any,
    num_workers: Any,
    prefetch_factor: Any,
    worker_type: str,
    cpu_budget: float | None,
    collate_fn: Any,
    worker_init_fn: Any,
) -> tuple[Tuner | None, int, int | None, str]:
    """``DataLoader``'s ``"auto"`` arguments resolved: the tuner (None: nothing is auto) and the
    starting ``num_workers``, ``prefetch_factor`` and ``worker_type`` torch's checks see.

    ``worker_type="auto"`` alone picks by the dataset's contract
    (``feedpipe.loader.plan.auto_worker_type``: ``"process"`` means batches are read per sample
    in Python). With
    ``num_workers="auto"`` a map-style dataset starts on one thread worker and moves to
    processes only when the counters show the GIL holds it back; an ``IterableDataset`` keeps
    one worker (it shards itself by the worker count: another count would change its batches).
    """
    _check_args(num_workers, prefetch_factor)
    contract_kind = auto_worker_type(dataset, collate_fn, worker_init_fn)
    auto_n, auto_p = num_workers == AUTO, prefetch_factor == AUTO
    if not (auto_n or auto_p):
        if cpu_budget is not None:
            raise ValueError("cpu_budget applies only with num_workers or prefetch_factor 'auto'")
        return (
            None,
            num_workers,
            prefetch_factor,
            contract_kind if worker_type == AUTO else (worker_type),
        )
    check_budget(cpu_budget)
    iterable = isinstance(dataset, tud.IterableDataset)
    kind = worker_type
    if worker_type == AUTO:
        kind = "thread" if auto_n and not iterable else contract_kind
    workers = 1 if auto_n else int(num_workers)
    if workers == 0:  # no workers: nothing to prefetch, nothing to tune
        return None, 0, None, kind
    prefetch = 2 if auto_p or prefetch_factor is None else int(prefetch_factor)
    tuner = Tuner(
        workers=auto_n,
        prefetch=auto_p,
        kind=auto_n and worker_type == AUTO and not iterable,
        start=Settings(workers, kind, prefetch),
        cpu_budget=cpu_budget,
        per_sample=contract_kind == "process",
        fixed_workers=iterable,
    )
    return tuner, workers, prefetch if auto_p else prefetch_factor, kind
