"""Per-stage totals of a stall meter: seconds, bytes and calls per stage, and their snapshot.

``add`` is callable from any thread and takes no lock on the way (``list.append`` is atomic);
records are folded into the totals a few thousand at a time or when the totals are read.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from feedpipe.io.forks import ForkLock
from feedpipe.stall.figures import StageStats

__all__ = ["WORKER_STAGES", "StageTotals"]

#: Stages that run inside loader workers and therefore in parallel, ``workers`` at a time.
WORKER_STAGES = frozenset({"fetch", "decode", "collate"})

_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


class StageTotals:
    """Seconds, bytes and calls per stage name ("fetch", "decode", "pin", ...)."""

    FOLD = 4096  # pending add records folded at a time

    def __init__(self, lock: ForkLock) -> None:
        # the meter's (``lock.lock``, looked up each time: a forked child's is a new one): a
        # snapshot reads these and its other totals at once
        self._fork = lock
        self.reset()

    def reset(self) -> None:
        """Zero every stage (call under the meter's lock)."""
        self._logs: dict[str, list[tuple[float, int]]] = {}
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._bytes: defaultdict[str, int] = defaultdict(int)
        self._calls: defaultdict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float, nbytes: int = 0) -> None:
        """Add ``seconds`` (and ``nbytes``) to stage ``name``; callable from any thread."""
        try:
            log = self._logs[name]
        except KeyError:
            with self._fork.lock:
                log = self._logs.setdefault(name, [])
        log.append((seconds, nbytes))
        if len(log) >= self.FOLD:
            self.fold()

    def add_folded(self, stages: Mapping[str, tuple[float, int, int]]) -> None:
        """Add a folded block's stages, ``name: (seconds, calls, bytes)`` (under the lock)."""
        for name, (seconds, calls, nbytes) in stages.items():
            self._seconds[name] += seconds
            self._calls[name] += calls
            self._bytes[name] += nbytes

    def fold(self) -> None:
        """Fold pending ``add`` records into the totals (any thread)."""
        with self._fork.lock:
            for name, log in list(self._logs.items()):
                n = len(log)
                if not n:
                    continue
                items = log[:n]
                del log[:n]  # records appended meanwhile stay for the next fold
                self._seconds[name] += math.fsum(map(_first, items))
                self._bytes[name] += sum(map(_second, items))
                self._calls[name] += n

    def seconds(self) -> dict[str, float]:
        self.fold()
        return dict(self._seconds)

    def nbytes(self) -> dict[str, int]:
        self.fold()
        return dict(self._bytes)

    def calls(self) -> dict[str, int]:
        self.fold()
        return dict(self._calls)

    def snapshot(self, workers: int) -> dict[str, StageStats]:
        """Each stage's totals, latency per call and effective time per batch (the latency
        divided by ``workers`` for :data:`WORKER_STAGES`)."""
        seconds, nbytes, calls = self.seconds(), self.nbytes(), self.calls()
        par = max(1, workers)
        stages = {}
        for name in sorted(seconds):
            n = calls.get(name, 0)
            per = seconds[name] / n if n else 0.0
            eff = per / par if name in WORKER_STAGES else per
            stages[name] = StageStats(seconds[name], nbytes.get(name, 0), n, per, eff)
        return stages

    def state(self) -> dict[str, Any]:
        """``stage_s``, ``stage_bytes`` and ``stage_calls`` of a meter's state dict."""
        return {
            "stage_s": self.seconds(),
            "stage_bytes": self.nbytes(),
            "stage_calls": self.calls(),
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state` (under the lock, after a reset)."""
        self._seconds.update(state["stage_s"])
        self._bytes.update(state["stage_bytes"])
        self._calls.update(state["stage_calls"])
