"""Retention policies: which committed steps to keep (anchor: Orbax's ``preservation_policy``).

A policy is a small object whose ``select(view)`` returns the steps it keeps, each with why.
Policies compose: ``KeepLast(3) | KeepEvery(1000)`` (an ``AnyOf``) keeps a step if any of them
keeps it. One policy object drives all three users: ``CheckpointManager`` (built from its
``keep_last=``, ``keep_every=``, ``keep_best=`` shorthands), the remote tier
(``keep_last_remote=`` takes an int or a policy) and ``ckpt gc`` (``--keep-last``,
``--keep-every``, ``--keep-best``).

The rules every policy follows:

- Only restorable steps count (every checksum verified, ``ckpt.retention.checks.restorable``). A
  policy asks ``view.restorable(step)`` only about the steps it would keep, newest or best first.
- ``KeepLast(n)``: the newest ``n`` restorable steps; a step that is not restorable and is newer
  than the oldest of them is kept too (not counted, never displacing a good step).
- ``KeepEvery(n)``: every restorable step that is a multiple of ``n``. Step 0 is a multiple of
  every ``n``, so it is kept.
- ``KeepBest(metric, k, mode)``: the ``k`` restorable steps with the lowest (``"min"``) or
  highest (``"max"``) value of ``metric``, as saved with ``save(step, state, metrics=...)``; on a
  tie the newer step wins. **A step without that metric is not ranked**: ``KeepBest`` never keeps
  it, and the other policies decide its fate.
- Whatever the policy, ``ckpt.retention.rules.plan`` also keeps the newest restorable step, so a
  policy can never delete the last good checkpoint, and locally the step ``latest`` names (the
  last one saved, even when a lower step was saved after a higher one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "AnyOf",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "Policy",
    "StepView",
    "from_options",
    "from_record",
    "to_record",
]


class StepView:
    """What a policy sees: the committed steps (``newest_first``) and cached, lazy lookups of
    whether a step is restorable and of its saved metrics."""

    def __init__(
        self,
        steps: Iterable[int],
        is_restorable: Callable[[int], bool],
        metrics: Callable[[int], Mapping[str, float]] | None = None,
    ) -> None:
        self.newest_first = sorted(set(steps), reverse=True)
        self._is_restorable = is_restorable
        self._metrics = metrics
        self._good: dict[int, bool] = {}
        self._seen: dict[int, Mapping[str, float]] = {}

    def restorable(self, step: int) -> bool:
        """Whether ``step`` restores with every checksum verified (asked once per step)."""
        if step not in self._good:
            self._good[step] = bool(self._is_restorable(step))
        return self._good[step]

    def metric(self, step: int, name: str) -> float | None:
        """The finite value (an int or a float) of metric ``name`` saved with ``step``, else
        ``None``."""
        if self._metrics is None:
            return None
        if step not in self._seen:  # the caller maps an unreadable manifest to {}
            self._seen[step] = self._metrics(step)
        value = self._seen[step].get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        try:
            finite = math.isfinite(float(value))
        except OverflowError:
            return None
        return value if finite else None  # an int stays an int: ranked exactly


class Policy:
    """A retention policy: ``select`` returns ``{step: why}`` for the steps it keeps."""

    def select(self, view: StepView) -> dict[int, str]:
        raise NotImplementedError

    def __or__(self, other: Policy) -> AnyOf:
        return AnyOf(self, other)


@dataclass(frozen=True)
class KeepLast(Policy):
    """The newest ``n`` restorable steps (and not-restorable steps newer than the oldest)."""

    n: int

    def __post_init__(self) -> None:
        _positive(self.n, "KeepLast.n")

    def select(self, view: StepView) -> dict[int, str]:
        kept: dict[int, str] = {}
        good = 0
        for step in view.newest_first:
            if good >= self.n:
                break
            if view.restorable(step):
                good += 1
                kept[step] = (
                    "newest valid checkpoint"
                    if good == 1
                    else (f"one of the newest {self.n} valid")
                )
            else:
                kept[step] = "not restorable, not counted"
        return kept


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Every restorable step that is a multiple of ``n`` (step 0 included), kept for good."""

    n: int

    def __post_init__(self) -> None:
        _positive(self.n, "KeepEvery.n")

    def select(self, view: StepView) -> dict[int, str]:
        return {
            s: f"multiple of keep_every={self.n}"
            for s in view.newest_first
            if s % self.n == 0 and view.restorable(s)
        }


@dataclass(frozen=True)
class KeepBest(Policy):
    """The ``k`` restorable steps with the best ``metric`` (``mode`` "min" or "max"); a step
    without a finite value of ``metric`` is not ranked. Ties: the newer step wins."""

    metric: str
    k: int
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest.metric must be a metric name, got {self.metric!r}")
        _positive(self.k, "KeepBest.k")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")

    def select(self, view: StepView) -> dict[int, str]:
        sign = 1 if self.mode == "min" else -1  # an int: int metrics rank exactly
        ranked = []
        for step in view.newest_first:
            value = view.metric(step, self.metric)
            if value is not None:
                ranked.append((sign * value, -step, value))
        ranked.sort()
        kept: dict[int, str] = {}
        for _, neg_step, value in ranked:
            if len(kept) >= self.k:
                break
            if view.restorable(-neg_step):
                why = f"one of the {self.k} best by {self.metric} ({self.mode}): {value}"
                kept[-neg_step] = why
        return kept


@dataclass(frozen=True, init=False)
class AnyOf(Policy):
    """Keeps a step if any of ``policies`` keeps it (the reasons are joined)."""

    policies: tuple[Policy, ...]

    def __init__(self, *policies: Policy) -> None:
        flat: list[Policy] = []
        for p in policies:
            if not isinstance(p, Policy):
                raise TypeError(f"AnyOf takes retention policies, got {p!r}")
            flat.extend(p.policies if isinstance(p, AnyOf) else (p,))
        object.__setattr__(self, "policies", tuple(flat))

    def select(self, view: StepView) -> dict[int, str]:
        kept: dict[int, str] = {}
        for policy in self.policies:
            for step, why in policy.select(view).items():
                if step not in kept:
                    kept[step] = why
                elif why not in kept[step].split("; "):
                    kept[step] = f"{kept[step]}; {why}"
        return kept


def from_options(
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: KeepBest | tuple[str, int, str] | None = None,
) -> Policy | None:
    """The policy of the shorthand options (``None`` where every option is ``None``: keep all).
    ``keep_best`` is a ``KeepBest`` or a ``(metric, k, "min" | "max")`` tuple."""
    parts: list[Policy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if keep_best is not None:
        if not isinstance(keep_best, KeepBest):
            if not isinstance(keep_best, (tuple, list)) or len(keep_best) != 3:
                raise ValueError(f"keep_best must be (metric, k, 'min'|'max'), got {keep_best!r}")
            metric, k, mode = keep_best
            keep_best = KeepBest(metric, k, mode)  # type: ignore[arg-type]
        parts.append(keep_best)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AnyOf(*parts)


def _positive(n: object, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {n!r}")


def to_record(policy: Policy | None) -> list[dict[str, object]] | None:
    """``policy`` as JSON-able data (``[]`` for ``None``: keep every step), or ``None`` if it is
    not made of the policies of this module (a custom ``Policy`` cannot be written down)."""
    parts = () if policy is None else policy.policies if isinstance(policy, AnyOf) else (policy,)
    out: list[dict[str, object]] = []
    for p in parts:
        if type(p) is KeepLast:
            out.append({"keep_last": p.n})
        elif type(p) is KeepEvery:
            out.append({"keep_every": p.n})
        elif type(p) is KeepBest:
            out.append({"keep_best": [p.metric, p.k, p.mode]})
        else:
            return None
    return out


def from_record(record: object) -> Policy | None:
    """The policy that ``to_record`` wrote (``ValueError`` naming what is malformed)."""
    if not isinstance(record, list):
        raise ValueError(f"a retention record is a list of policies, got {record!r:.80}")
    parts: list[Policy] = []
    for item in record:
        if not isinstance(item, dict) or len(item) != 1:
            raise ValueError(f"a retention policy record has one key, got {item!r:.80}")
        ((key, value),) = item.items()
        if key == "keep_last":
            parts.append(KeepLast(value))
        elif key == "keep_every":
            parts.append(KeepEvery(value))
        elif key == "keep_best" and isinstance(value, list) and len(value) == 3:
            parts.append(KeepBest(*value))
        else:
            raise ValueError(f"unknown retention policy record {item!r:.80}")
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AnyOf(*parts)
