"""The save interval chosen for you: Young-Daly from the measured cost of a save and the failures.

``CheckpointManager(DIR, save_interval_steps="auto", mtbf=...)`` answers ``should_save(step)``
with an ``IntervalRule``. Its inputs are measured, its output is a number of steps:

- ``C``, the **blocking cost** of a save: the mean ``SaveStats.blocked_s`` of the recent saves
  (what the training loop paid, back-pressure included: the expected cost the rule needs);
- the **persist time** of each tier that takes every save (the local disk: ``write_s +
  commit_s``, or with a memory tier its tmpfs's, and the disk's persist seconds over
  ``persist_every``; the remote tier: the upload's seconds; the mean of the recent ones): the
  interval is never shorter than the slowest, or saves back up behind it;
- ``M``, the **mean time between failures**: ``mtbf=`` if given; else the failures the run log
  saw across restarts (``ckpt.runlog``), ``M = alive seconds / failures``; with none seen,
  ``DEFAULT_MTBF_S`` or the seconds the runs were alive without a failure, whichever is longer;
- the **step time**: the median time between two ``should_save`` calls for new steps.

The rule (``optimum_s``): Daly's higher-order estimate, ``T = sqrt(2CM) * (1 + sqrt(C/2M)/3 +
(C/2M)/9) - C`` for ``C < 2M``, else ``T = M`` (it reduces to Young's ``sqrt(2CM)`` when ``C << M``;
``young_s`` is kept for reference). ``T`` is compute time between saves; the interval in steps is
``round(T / step time)`` after the bounds: at least the slowest tier's persist time, at most
``AutoInterval.max_s`` (the floor wins when they cross), then from ``min_steps`` to
``max_steps``. docs/interval.md gives the derivation's assumptions and limits.

Before any save was measured (and no cost is recorded in the run log), ``should_save`` answers
``True``: the first step saves to measure. A step answered once gets the same answer again
(never two saves in one step); a step lower than the last save (a rollback) restarts the count.

**Several ranks.** The interval in steps is decided at events every rank reaches at the same
call (its first ``should_save``, and the call after each save) and held until the next one.
With ``AutoInterval(agree=True)`` and ``torch.distributed`` initialized, the ranks agree on the
smallest (``ckpt.agreement``: one ``all_reduce`` per save), so that every rank answers
``should_save`` alike; every rank must then have a manager and call it for the same steps, and
save when it says so. It is off by default: a manager on one rank only (``ckpt.dcp``'s
coordinator, a rank-0 save) would wait forever for the others; decide there and broadcast.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckpt.agreement import Agreement
from ckpt.runlog import RunLog

__all__ = [
    "DEFAULT_MTBF_S",
    "AutoInterval",
    "FixedInterval",
    "IntervalReport",
    "IntervalRule",
    "daly",
    "parse",
    "schedule",
    "young",
]

_MEASURE, _WAIT = -2, -1  # the agreed codes that are not an interval (IntervalRule._agree)
_AGREED = "rank agreement (another rank's smaller interval)"

DEFAULT_MTBF_S = 24 * 3600.0
"""The mean time between failures assumed when none is given and none was seen."""


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: ``sqrt(2 * C * M)`` seconds of compute between saves."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006): ``sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C``
    for ``C < 2M``, else ``M``; seconds of compute between saves."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return young(cost_s, mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


def _positive_s(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class AutoInterval:
    """Options of the automatic interval: ``mtbf_s`` (``None``: from the failures seen);
    ``max_s``: the longest interval, in seconds of compute; ``min_steps``/``max_steps``: the
    bounds in steps; ``window``: how many recent measurements each estimate takes; ``agree``:
    the ranks of ``torch.distributed`` agree on the interval (every rank must then call
    ``should_save`` for the same steps; module docstring)."""

    mtbf_s: float | None = None
    max_s: float = 3600.0
    min_steps: int = 1
    max_steps: int = 1_000_000
    window: int = 16
    agree: bool = False

    def __post_init__(self) -> None:
        if self.mtbf_s is not None:
            object.__setattr__(self, "mtbf_s", _positive_s(self.mtbf_s, "mtbf"))
        object.__setattr__(self, "max_s", _positive_s(self.max_s, "AutoInterval.max_s"))
        _count(self.min_steps, "AutoInterval.min_steps")
        _count(self.max_steps, "AutoInterval.max_steps")
        _count(self.window, "AutoInterval.window")
        if not isinstance(self.agree, bool):
            raise ValueError(f"AutoInterval.agree must be True or False, got {self.agree!r}")
        if self.max_steps < self.min_steps:
            raise ValueError(
                f"AutoInterval.max_steps ({self.max_steps}) < min_steps ({self.min_steps})"
            )

    def to_record(self) -> dict[str, Any]:
        """These options as JSON-able data (``from_record`` reads them back)."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: object) -> AutoInterval:
        """The options ``to_record`` wrote (``ValueError`` naming what is malformed)."""
        if not isinstance(record, dict) or not set(record) <= set(cls.__dataclass_fields__):
            raise ValueError(f"not an AutoInterval record: {record!r:.80}")
        return cls(**record)


def parse(value: object, mtbf: object = None) -> AutoInterval | None:
    """The ``AutoInterval`` that ``save_interval_steps=value, mtbf=mtbf`` asks for: ``"auto"``
    or an ``AutoInterval``; ``None`` for an int or ``None`` (a fixed interval or none).
    ``ValueError`` for anything else, and for ``mtbf`` without ``"auto"``."""
    if isinstance(value, AutoInterval):
        if mtbf is not None:
            return AutoInterval(**{**asdict(value), "mtbf_s": mtbf})
        return value
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(
                f"save_interval_steps must be an int >= 1, 'auto' or an AutoInterval, got {value!r}"
            )
        return AutoInterval(mtbf_s=mtbf)  # type: ignore[arg-type]  # checked there
    if mtbf is not None:
        raise ValueError(f"mtbf= applies only with save_interval_steps='auto' (got {value!r})")
    return None


@dataclass(frozen=True)
class IntervalReport:
    """The current interval and why (``CheckpointManager.interval()``). ``steps``/``seconds``
    are ``None`` until a save was measured; ``bound`` names what set the interval."""

    steps: int | None
    seconds: float | None
    bound: str
    cost_s: float | None
    persist_s: dict[str, float]
    step_s: float | None
    mtbf_s: float
    mtbf_source: str
    optimum_s: float | None
    young_s: float | None
    failures: int
    runs: int
    last_saved: int | None
    next_step: int | None


class SaveSource(Protocol):
    """What the rule reads from the manager's stats (``ckpt.manager.ManagerStats``)."""

    @property
    def last_save(self) -> Any: ...

    @property
    def remote(self) -> Any: ...


@dataclass
class _Measured:
    """Recent measurements (seconds) in bounded windows: the rule takes the mean cost and
    persist time (expected values; a queue backs up when the mean write outlasts the interval)
    and the median step time (a rare slow step, an evaluation, is not the step time)."""

    window: int
    cost: deque[float] = field(default_factory=deque)
    step: deque[float] = field(default_factory=deque)
    persist: dict[str, deque[float]] = field(default_factory=dict)

    def add(self, values: deque[float], value: float) -> None:
        values.append(value)
        while len(values) > self.window:
            values.popleft()

    def add_persist(self, tier: str, seconds: float) -> None:
        self.add(self.persist.setdefault(tier, deque()), seconds)

    def record(self) -> dict[str, Any]:
        """The estimates, JSON-able (what the run log keeps for the next run)."""
        out: dict[str, Any] = {"persist_s": {t: _mean(v) for t, v in self.persist.items() if v}}
        if self.cost:
            out["cost_s"] = _mean(self.cost)
        if self.step:
            out["step_s"] = _median(self.step)
        return out

    def load(self, record: dict[str, Any] | None) -> None:
        """Seed the windows from a record of an earlier run (ignored if malformed)."""
        if not isinstance(record, dict):
            return
        for key, values in (("cost_s", self.cost), ("step_s", self.step)):
            if _is_seconds(record.get(key)):
                self.add(values, float(record[key]))
        persist = record.get("persist_s")
        for tier, seconds in persist.items() if isinstance(persist, dict) else ():
            if _is_seconds(seconds):
                self.add_persist(str(tier), float(seconds))


def _median(values: deque[float]) -> float:
    return float(statistics.median(values))


def _mean(values: deque[float]) -> float:
    return float(statistics.fmean(values))


def _is_seconds(value: object) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and 0 <= value < math.inf  # type: ignore[operator]


class IntervalRule:
    """Decides ``should_save`` with ``save_interval_steps="auto"`` (module docstring).

    ``should_save`` and ``report`` run on the training thread; ``committed`` (an ``on_commit``
    listener) on the persist thread; ``begin``/``end``/``fail`` with the manager's lifecycle."""

    def __init__(self, options: AutoInterval, root: Path) -> None:
        self.options = options
        self.runs = RunLog(root)
        self._m = _Measured(options.window)
        self._lock = threading.Lock()
        self._history = self.runs.history()
        self._m.load(self._history.measured)
        self._seen: Any = None  # the SaveStats last observed
        self._pending: Any = None  # a save observed whose persist time is not known yet
        self._anchor: int | None = None  # the step of the last save (or of the first call)
        self._last: tuple[int, bool] | None = None  # the last step answered, and the answer
        self._t_last: float | None = None
        self._uploaded = -1  # the newest step whose upload time was taken
        self._persists = 0  # the memory tier's persists whose time was taken
        self._agreed = _MEASURE  # the interval agreed at the last event (_agree)
        self._why = ""  # the bound that set it
        self.agreement = Agreement() if options.agree else None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_seen"] = state["_pending"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- lifecycle ------------------------------------------------------------------------
    def begin(self) -> None:
        """Open the run log (the manager became the writer): counts an unclean previous end."""
        if not self.runs.is_open:
            self._history = self.runs.begin(self.options.to_record())

    def committed(self, step: int, path: Path) -> None:
        """An ``on_commit`` listener: record the time alive and the costs (never raises)."""
        del step, path
        with self._lock:
            measured = self._m.record()
        try:
            self.runs.heartbeat(measured)
        except OSError as exc:
            _warn(self.runs.path, exc)

    def persisted(self, tier: str, seconds: float) -> None:
        """Record that ``tier`` took ``seconds`` in the background to absorb one save (the hook
        for a tier the rule does not read from the manager's stats; any thread)."""
        with self._lock:
            self._m.add_persist(tier, float(seconds))

    def fail(self) -> None:
        """Count this run as a failure when it ends (an exception is leaving the run)."""
        self.runs.fail()

    def exit(self, error: object) -> None:
        """The manager's ``with`` block is left with ``error``: an ``Exception`` is a failure
        (``SystemExit`` and ``KeyboardInterrupt`` are deliberate stops, ``None`` a clean end)."""
        if isinstance(error, Exception):
            self.fail()

    def end(self) -> None:
        """Close the run log: a clean end (unless ``fail`` was called)."""
        with self._lock:
            measured = self._m.record()
        try:
            self.runs.end(measured)
        except OSError as exc:  # close goes on: the lock is released all the same
            _warn(self.runs.path, exc)

    # ---- the decision ---------------------------------------------------------------------
    def should_save(self, step: int, stats: SaveSource, now: float | None = None) -> bool:
        """Whether ``step`` is due: no save measured yet, or ``interval`` steps since the last
        save. ``stats``: the manager's counters, read for the saves made since the last call."""
        now = time.monotonic() if now is None else now
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        blocked = self._observe(stats)
        if self._t_last is not None and self._last is not None and step > self._last[0]:
            gap = max(0.0, now - self._t_last - (blocked or 0.0)) / (step - self._last[0])
            with self._lock:
                self._m.add(self._m.step, gap)
        self._t_last = now
        if self._anchor is None or step < self._anchor:
            self._anchor = step  # the first call, or a rollback to an earlier step
        if self._agreed < 1 or blocked is not None:  # an event every rank reaches together
            self._agreed = self._agree()
        due = self._agreed == _MEASURE or step - self._anchor >= self._agreed >= 1
        self._last = (step, due)
        return due

    def _agree(self) -> int:
        """The interval in steps all ranks use until the next save (``ckpt.agreement``: the
        smallest), or ``_MEASURE`` if a rank has no cost yet (save now to measure it), or
        ``_WAIT`` if a rank has a cost but no step time yet (wait one step)."""
        planned = self._steps()
        local = planned[0] if planned is not None else _WAIT if self._m.cost else _MEASURE
        agreed = local if self.agreement is None else self.agreement.min(local)
        self._why = planned[1] if planned is not None and agreed == local else _AGREED
        return agreed

    def _observe(self, stats: SaveSource) -> float | None:
        """Take the blocking cost of a new save (returned, ``None`` without one: the loop paid
        it since the last call, not the step) and the persist times of finished ones."""
        save, blocked = stats.last_save, None
        with self._lock:
            if save is not None and save is not self._seen:
                self._seen = self._pending = save
                self._anchor = int(save.step)
                blocked = float(save.blocked_s)
                self._m.add(self._m.cost, blocked)
            memory = getattr(stats, "memory", None)  # saves land there, persists go to disk
            if self._pending is not None and self._pending.durable_s > 0:
                pending, self._pending = self._pending, None
                tier = "disk" if memory is None else "memory"
                self._m.add_persist(tier, float(pending.write_s + pending.commit_s))
            self._observe_persists(memory)
            self._observe_uploads(stats.remote)
        return blocked

    def _observe_persists(self, memory: Any) -> None:
        """With a memory tier, the disk's time per save: each persist's seconds over the
        ``persist_every`` saves it stands for."""
        persist = None if memory is None else memory.persist
        if persist is not None and persist.persisted > self._persists and persist.last_s > 0:
            self._persists = persist.persisted
            self._m.add_persist("disk", float(persist.last_s) / max(1, memory.persist_every))

    def _observe_uploads(self, remote: Any) -> None:
        """The remote tier's upload seconds of the steps uploaded since the last look."""
        if remote is None:
            return
        for upload in list(remote.uploads.values()):
            if upload.state == "done" and upload.seconds > 0 and upload.step > self._uploaded:
                self._uploaded = upload.step
                self._m.add_persist("remote", float(upload.seconds))

    def _mtbf(self) -> tuple[float, str]:
        if self.options.mtbf_s is not None:
            return self.options.mtbf_s, "given (mtbf=)"
        h = self.runs.history() if self.runs.is_open else self._history
        if h.failures:
            return h.alive_s / h.failures, (
                f"observed: {h.failures} failure(s) in {h.alive_s:.0f} s alive over {h.runs} run(s)"
            )
        if h.alive_s > DEFAULT_MTBF_S:
            return h.alive_s, f"observed: no failure in {h.alive_s:.0f} s alive"
        return DEFAULT_MTBF_S, "default (no mtbf= given, no failure seen)"

    def _plan(self) -> tuple[float, str, float, float, float] | None:
        """``(seconds, bound, optimum, young, floor)``, or ``None`` before a cost is known."""
        if not self._m.cost:
            return None
        cost, (mtbf, _) = _mean(self._m.cost), self._mtbf()
        optimum = daly(cost, mtbf)
        seconds, bound = optimum, "Young-Daly (Daly's higher order)"
        if seconds > self.options.max_s:
            seconds, bound = self.options.max_s, f"max_s ({self.options.max_s:g} s)"
        floor, slowest = 0.0, ""
        for tier, values in self._m.persist.items():
            if values and _mean(values) > floor:
                floor, slowest = _mean(values), tier
        if seconds < floor:
            seconds, bound = floor, f"persist floor ({slowest} tier)"
        return seconds, bound, optimum, young(cost, mtbf), floor

    def _steps(self) -> tuple[int, str] | None:
        """The interval in steps now and the bound that set it (``None``: still measuring)."""
        plan = self._plan()
        if plan is None or not self._m.step:
            return None
        steps, clamp = self._clamp(plan[0], _median(self._m.step))
        return steps, clamp or plan[1]

    def _clamp(self, seconds: float, step_s: float) -> tuple[int, str]:
        """``seconds`` in steps of ``step_s``, within ``min_steps``..``max_steps``."""
        o = self.options
        steps_f = seconds / max(step_s, 1e-9)
        steps = round(steps_f) if steps_f < o.max_steps else o.max_steps + 1
        if steps < o.min_steps:
            return o.min_steps, f"min_steps ({o.min_steps})"
        if steps > o.max_steps:
            return o.max_steps, f"max_steps ({o.max_steps})"
        return steps, ""

    def report(self) -> IntervalReport:
        """The interval now, its inputs and the bound that set it."""
        with self._lock:
            plan, mtbf = self._plan(), self._mtbf()
            step_s = _median(self._m.step) if self._m.step else None
            persist = {t: _mean(v) for t, v in self._m.persist.items() if v}
            cost = _mean(self._m.cost) if self._m.cost else None
        h = self.runs.history() if self.runs.is_open else self._history
        steps = seconds = None
        bound = "measuring: the next step saves to measure the cost of a save"
        if plan is not None:
            bound = plan[1]
            if step_s is not None:
                steps, clamp = self._clamp(plan[0], step_s)
                bound, seconds = clamp or bound, steps * step_s
            else:
                bound = "measuring: the step time (one more step)"
        if self._agreed >= 1:  # what should_save uses until the next save, and its bound
            steps, bound = self._agreed, self._why
            seconds = None if step_s is None else steps * step_s
        nxt = None if steps is None or self._anchor is None else self._anchor + steps
        return IntervalReport(
            steps, seconds, bound, cost, persist, step_s, mtbf[0], mtbf[1],
            None if plan is None else plan[2], None if plan is None else plan[3],
            h.failures, h.runs, self._anchor, nxt,
        )  # fmt: skip


def _warn(path: Path, exc: BaseException) -> None:
    import logging

    logging.getLogger("ckpt").warning("ckpt: could not update %s: %s", path, exc)


class FixedInterval:
    """``save_interval_steps=N``: the multiples of ``N`` (``None``: no step), ``N`` read from
    ``every()`` at each call (the manager's attribute, which may be changed); the same calls as
    an ``IntervalRule``, which do nothing here."""

    def __init__(self, every: Callable[[], int | None]) -> None:
        self.every = every

    def should_save(self, step: int, stats: SaveSource, now: float | None = None) -> bool:
        """Whether ``step`` is a multiple of ``every()``."""
        n = self.every()
        return n is not None and step % n == 0

    def begin(self) -> None:
        """Nothing: no run log without ``"auto"``."""

    def end(self) -> None:
        """Nothing: no run log without ``"auto"``."""

    def exit(self, error: object) -> None:
        """Nothing: no run log without ``"auto"``."""

    def report(self) -> IntervalReport | None:
        """``None``: the interval is fixed."""
        return None


def schedule(
    auto: AutoInterval | None,
    every: Callable[[], int | None],
    root: Path,
    on_commit: list[Callable[[int, Path], None]],
) -> IntervalRule | FixedInterval:
    """The manager's save interval: an ``IntervalRule`` for ``auto`` (its ``committed``
    listener appended to ``on_commit``), else a ``FixedInterval`` of ``every()`` steps."""
    if auto is None:
        return FixedInterval(every)
    rule = IntervalRule(auto, root)
    on_commit.append(rule.committed)
    return rule
