"""The decision rule of ``num_workers="auto"`` (docs/autotune.md), pure: readings in, a decision
out. :class:`~feedpipe.loader.tuner.Tuner` takes the readings from the loader's stall meter and
CPU clocks and applies what :func:`decide` returns; this module reads no clock and starts no
worker, so the rule is tested alone on synthetic readings.

The rule, for one window of batches (:class:`Reading`):

1. *Input-bound* (the loop waited at least :data:`GROW_WAIT` of its time): add workers, as many
   as the measured CPU per worker lets the budget hold (at most fourfold while the loop waits
   half its time or more, else twofold), or stop there when
   the budget is spent ("budget exhausted"). With thread workers whose CPU stays near one core
   while their busy time is several (they queue for the GIL) and whose last growth did not raise
   throughput, switch to processes instead (applied at the next epoch boundary), where the
   budget holds :data:`MIN_PROCESSES` of them at a core each; where it holds one, the threads
   stay (one process runs no more Python than threads sharing one core, and adds a copy).
2. *Loop-bound* (the loop waited under :data:`SHRINK_WAIT`): keep the workers, or give one back
   when the others would still be less than :data:`SHRINK_BUSY` busy without it.
3. *Prefetch*: input-bound while the workers are mostly idle means the window is too short for
   the latency: deepen it (up to :data:`MAX_PREFETCH`).

Online, :class:`~feedpipe.loader.tuner.Tuner` changes the settings only when the rule calls
for the same change in a majority of the last :data:`VOTES` windows (:func:`majority`).

Readings over :data:`OVER_BUDGET` of the budget shrink the workers, whatever the wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = [
    "FAST_WAIT",
    "GROW_WAIT",
    "MAX_PREFETCH",
    "MIN_PROCESSES",
    "NO_GAIN",
    "NO_GAIN_BATCHES",
    "OVER_BUDGET",
    "SHRINK_BUSY",
    "SHRINK_WAIT",
    "VOTES",
    "Decision",
    "Limits",
    "Reading",
    "Settings",
    "decide",
    "direction",
    "majority",
    "processes_in_budget",
]

#: the loop waited at least this share of its time: the input is what it waits for
GROW_WAIT = 0.08
#: at or above this share of waiting, the workers may grow fourfold in one step (else twofold)
FAST_WAIT = 0.5
#: below this share of waiting, the loop is the bottleneck: no more workers
SHRINK_WAIT = 0.02
#: give a worker back only if the others would stay under this busy share without it
SHRINK_BUSY = 0.5
#: the most batches a worker keeps in flight under ``prefetch_factor="auto"``
MAX_PREFETCH = 8
#: a growth after which throughput fell below this factor of the window before is undone, and
#: not tried again (more workers made it slower: contention; noise stays above it)
NO_GAIN = 0.9
#: the fewest batches in the window after a growth that may undo it
NO_GAIN_BATCHES = 16
#: online, a change needs the rule to call for it (the same way) in a majority of the last
#: this many windows under the current settings: one noisy window (a GC pause, a burst of the
#: host's load) never moves the workers, and a change is not taken back by the next window
VOTES = 3
#: readings above this multiple of the CPU budget shrink the workers
OVER_BUDGET = 1.25
#: thread workers are GIL-bound when their busy time is this multiple of their CPU time while
#: that CPU time stays under :data:`GIL_CORES` cores
GIL_QUEUE = 1.6
GIL_CORES = 1.2
#: GIL-bound threads move to processes only where the budget holds this many (one core each):
#: the threads already run about one core of Python, which one process would only match
MIN_PROCESSES = 2


@dataclass(frozen=True)
class Settings:
    """What the tuner sets: worker count, kind (``"thread"``/``"process"``), prefetch depth."""

    workers: int
    kind: str
    prefetch: int


@dataclass(frozen=True)
class Limits:
    """What the tuner may do: ``budget_cores`` of CPU for the workers, at most ``max_workers``,
    which of the three settings are ``"auto"``, and whether workers change only at an epoch
    boundary (``online=False``: process workers)."""

    budget_cores: float
    max_workers: int
    workers: bool = True
    kind: bool = False
    prefetch: bool = False
    per_sample: bool = False  # batches are read per sample in Python (not one read_batch)


@dataclass(frozen=True)
class Reading:
    """One window of the loader's counters (every figure a difference over the window).

    ``wait_s``/``step_s``: the loop's wait and compute; ``busy_s``: the worker stages' seconds
    summed over workers; ``cpu_s``: CPU seconds the workers ran (None where unknown);
    ``starved_s``: seconds an average worker was ready to run but waited for a core (a host
    short of cores; a thread waiting for the GIL is not ready to run); ``span_s``: the window's
    own wall time, where the CPU clocks were read (else the loop's wait and step);
    ``batches``: batches delivered; ``grew_from``: the batches/s of the window before the last
    growth (None when the last decision was not a growth)."""

    wait_s: float
    step_s: float
    busy_s: float
    cpu_s: float | None
    batches: int
    grew_from: float | None = None
    grew_at: int | None = None  # the worker count before the last growth
    starved_s: float = 0.0
    span_s: float | None = None

    @property
    def wall_s(self) -> float:
        return self.wait_s + self.step_s

    @property
    def wait_share(self) -> float:
        wall = self.wall_s
        return self.wait_s / wall if wall > 0 else 0.0

    @property
    def rate(self) -> float:
        """Batches per second in this window."""
        wall = self.wall_s
        return self.batches / wall if wall > 0 else 0.0

    def cores(self) -> float:
        """CPU cores the workers use while they get a core (their busy time where no CPU clock
        reads them): on a host short of cores, what they would take with one free."""
        wall = self.span_s if self.span_s else self.wall_s
        used = self.cpu_s if self.cpu_s is not None else self.busy_s
        return used / max(0.1 * wall, wall - self.starved_s) if wall > 0 else 0.0

    def busy(self, workers: int) -> float:
        """The share of the workers' time spent in worker stages."""
        wall = self.wall_s
        return self.busy_s / (max(1, workers) * wall) if wall > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """New settings and the figure that caused them (one line of the decision log)."""

    settings: Settings
    reason: str
    ceiling: int | None = None  # a worker count not to grow past (growth bought nothing)

    def line(self, before: Settings) -> str:
        """``"workers 2 -> 4 (thread): the loop waited 31% ..."``: what changed, and why."""
        now = self.settings
        parts = []
        if now.workers != before.workers:
            parts.append(f"workers {before.workers} -> {now.workers}")
        if now.kind != before.kind:
            parts.append(f"worker_type {before.kind} -> {now.kind}")
        if now.prefetch != before.prefetch:
            parts.append(f"prefetch_factor {before.prefetch} -> {now.prefetch}")
        return f"{', '.join(parts) or 'no change'}: {self.reason}"


def _figures(r: Reading, s: Settings, limits: Limits) -> str:
    return (
        f"the loop waited {100 * r.wait_share:.0f}% of step time, CPU {r.cores():.2f} of budget "
        f"{limits.budget_cores:.2f} cores, workers {100 * r.busy(s.workers):.0f}% busy"
    )


def _gil_bound(r: Reading, s: Settings, limits: Limits, blocked: bool) -> bool:
    """Thread workers held by the GIL: several workers busy several cores' worth on about one
    core of CPU, with the last growth buying (almost) nothing; or, where no growth is possible
    (``blocked``), one worker reading per sample in Python whose CPU time is its busy time."""
    if s.kind != "thread" or r.cpu_s is None or not 0.5 <= r.cores() <= GIL_CORES:
        return False
    if s.workers >= 2 and r.busy_s >= GIL_QUEUE * r.cpu_s:
        return r.grew_from is not None and r.rate < 1.15 * r.grew_from
    return blocked and limits.per_sample and r.cpu_s >= 0.8 * (r.busy_s - r.starved_s)


def _more(r: Reading, s: Settings, limits: Limits) -> int:
    """How many workers the budget holds at the measured CPU per worker: at most fourfold
    while the loop waits :data:`FAST_WAIT` of its time or more, else twofold."""
    per_worker = r.cores() / max(1, s.workers)
    room = limits.budget_cores - r.cores()
    step = 4 if r.wait_share >= FAST_WAIT else 2
    fit = s.workers + (math.floor(room / per_worker) if per_worker > 1e-3 else step * s.workers)
    return min(fit, step * s.workers, limits.max_workers)


def decide(r: Reading, s: Settings, limits: Limits) -> Decision | None:
    """The new settings for window ``r`` under ``s`` (None: keep them); module docstring."""
    if r.batches < 2 or r.wall_s <= 0:
        return None
    why = _figures(r, s, limits)
    cores = r.cores()
    if limits.workers and s.workers > 1 and cores > OVER_BUDGET * limits.budget_cores:
        return Decision(replace(s, workers=s.workers - 1), f"over budget: {why}")
    if r.wait_share >= GROW_WAIT:
        return _input_bound(r, s, limits, why)
    shrink = limits.workers and s.workers > 1 and r.wait_share < SHRINK_WAIT
    if shrink and r.busy(s.workers) * s.workers / (s.workers - 1) < SHRINK_BUSY:
        return Decision(replace(s, workers=s.workers - 1), f"loop-bound: {why}")
    return None


def _no_gain(r: Reading, s: Settings, why: str) -> Decision | None:
    """Throughput fell below :data:`NO_GAIN` of the window before the last growth: back to the
    count before it, which becomes the ceiling (more workers slow this input down)."""
    if r.grew_from is None or r.grew_at is None or r.grew_at >= s.workers:
        return None
    if r.batches < NO_GAIN_BATCHES:  # too few batches to tell a loss from noise
        return None
    if r.rate >= NO_GAIN * r.grew_from:
        return None
    return Decision(
        replace(s, workers=r.grew_at),
        f"slower with {s.workers} workers (x{r.rate / max(r.grew_from, 1e-9):.2f} the batches/s "
        f"of {r.grew_at}): {why}",
        ceiling=r.grew_at,
    )


def direction(d: Decision | None, s: Settings) -> str:
    """What ``d`` does to ``s``: ``"stay"``, ``"kind"``, ``"grow"``, ``"shrink"`` or
    ``"prefetch"``."""
    if d is None or d.settings == s:
        return "stay"
    if d.settings.kind != s.kind:
        return "kind"
    if d.settings.workers != s.workers:
        return "grow" if d.settings.workers > s.workers else "shrink"
    return "prefetch"


def majority(decisions: list[Decision | None], s: Settings) -> Decision | None:
    """The change a majority of the windows' decisions (oldest first, at most :data:`VOTES`)
    call for, the median of theirs by worker count (the lower one of two); else the latest
    window's decision if it keeps the settings (a note such as "budget exhausted"), or None."""
    ways = [direction(d, s) for d in decisions]
    need = len(decisions) // 2 + 1 if len(decisions) > 1 else 2
    for way in ("kind", "shrink", "grow", "prefetch"):  # the safe way first on a tie
        picked = [d for d, w in zip(decisions, ways, strict=True) if w == way and d is not None]
        if len(picked) >= need:
            picked.sort(key=lambda d: d.settings.workers)
            return picked[(len(picked) - 1) // 2]
    last = decisions[-1] if decisions else None
    return last if ways and ways[-1] == "stay" else None


def processes_in_budget(limits: Limits) -> int:
    """How many process workers the budget holds, projecting one core each (a process worker
    runs its Python on a core of its own; GIL-bound threads share one core between them). Not
    bounded by ``limits.max_workers``: on threads that is the threads' bound (their ceiling
    included), and the budget is never more cores than the host has."""
    return max(1, math.floor(limits.budget_cores))


def _to_processes(r: Reading, s: Settings, limits: Limits, why: str) -> Decision | None:
    """GIL-bound threads to :data:`MIN_PROCESSES` or more process workers, where the budget
    holds them (else None: one process is no faster than threads sharing one core)."""
    most = processes_in_budget(limits)
    if most < MIN_PROCESSES:
        return None
    gain = f", last growth gave x{r.rate / r.grew_from:.2f}" if r.grew_from else ""
    return Decision(
        replace(s, kind="process", workers=max(MIN_PROCESSES, min(s.workers, most))),
        f"GIL-bound threads (busy {r.busy_s / r.wall_s:.2f} cores on CPU "
        f"{r.cores():.2f}{gain}): {why}",
    )


def _input_bound(r: Reading, s: Settings, limits: Limits, why: str) -> Decision | None:
    """Step 1 and 3 of the rule: the loop waits for input."""
    target = _more(r, s, limits) if limits.workers else s.workers
    gil = limits.kind and _gil_bound(r, s, limits, blocked=target <= s.workers)
    if gil:
        move = _to_processes(r, s, limits, why)
        if move is not None:
            return move
        target = min(target, s.workers)  # threads that queue for the GIL: more buy nothing
    undo = _no_gain(r, s, why)
    if undo is not None:
        return undo
    if limits.prefetch and s.prefetch < MAX_PREFETCH and r.busy(s.workers) < SHRINK_BUSY:
        return Decision(replace(s, prefetch=min(MAX_PREFETCH, 2 * s.prefetch)), f"idle: {why}")
    if not limits.workers:
        return None
    if target > s.workers:
        return Decision(replace(s, workers=target), f"input-bound: {why}")
    if gil:
        return Decision(
            s,
            f"GIL-bound threads, and the budget of {limits.budget_cores:.2f} cores holds one "
            f"process worker (no faster than threads on one core), workers stay {s.workers}: "
            f"{why}",
        )
    if s.workers >= limits.max_workers:
        return Decision(s, f"at the most workers ({limits.max_workers}), they stay: {why}")
    return Decision(s, f"budget exhausted, workers stay {s.workers}: {why}")
