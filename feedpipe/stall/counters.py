"""The counters behind a stall meter, and the readings taken from them.

:class:`Counters` holds the packed batch log that the hot path appends to, and what it is
folded into: the wait totals and histogram (:class:`~feedpipe.stall.totals.WaitTotals`), the
pass clock (:class:`~feedpipe.stall.clock.PassClock`), the stage totals
(:class:`~feedpipe.stall.stages.StageTotals`), device idle for input
(:class:`~feedpipe.stall.device.DeviceIdle`), user regions, queue depths and skipped samples.
It reads them as one snapshot (:meth:`Counters.stats`) and saves and restores them.
"""

from __future__ import annotations

import array
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from feedpipe.io.forks import ForkLock
from feedpipe.stall.clock import PassClock
from feedpipe.stall.device import DeviceIdle
from feedpipe.stall.records import FIELDS, fold
from feedpipe.stall.robust import outliers, typical_fraction
from feedpipe.stall.stages import WORKER_STAGES, StageTotals
from feedpipe.stall.stats import StallStats
from feedpipe.stall.totals import WaitTotals

__all__ = ["Counters"]


def _cpu_now() -> tuple[float, float, int]:
    """(process CPU seconds, this thread's CPU seconds, this thread's id)."""
    return time.process_time(), time.thread_time(), threading.get_ident()


class Counters:
    """Every counter of one meter (see the module docstring); any thread may read them."""

    def __init__(self) -> None:
        # a child forked while another thread held it finds it free (a plain lock's copy
        # would never be released there): every user looks ``.lock`` up anew
        self._fork = ForkLock()
        #: the batch log: its object never changes (loaders bind it, and its frombytes, per pass)
        self.log: array.array[float] = array.array("d")
        self.clock = PassClock()
        self.stages = StageTotals(self._fork)
        self.device = DeviceIdle()
        self.reset()

    @property
    def lock(self) -> Any:
        """The lock every fold and snapshot takes (a child forked meanwhile has its own)."""
        return self._fork.lock

    def reset(self) -> None:
        """Zero every counter (passes in progress and the device watched are kept)."""
        with self.lock:
            self.clock.reset()
            del self.log[:]
            self.clocked = 0  # numbers at the log's head the clock has seen (fold_clock)
            self.totals = WaitTotals()
            self.skipped = 0  # samples dropped by DataLoader(on_error="skip")
            self.cpu0: tuple[float, float, int] | None = _cpu_now()
            self.stages.reset()
            self.region_s: defaultdict[str, float] = defaultdict(float)
            self.depth: dict[str, int] = {}
            self.device.reset()

    def fold(self) -> None:
        """Fold pending batch records into the totals, clock and stages (any thread)."""
        if not self.log:
            return
        with self.lock:
            log = self.log
            k = len(log) - len(log) % FIELDS  # whole records (each is appended in one call)
            if not k:
                return
            self._clock_upto(k)
            block = fold(log[:k])
            del log[:k]  # records appended meanwhile stay for the next fold
            self.clocked = 0
            self.totals.add(block)
            self.stages.add_folded(block.stages)

    def fold_clock(self) -> None:
        """Hand the pass clock the records it has not seen (their begins and the last wait),
        leaving them in the log for the totals: what a pass boundary needs, at the cost of a
        slice, not a vectorised fold. The totals fold when read or every 4096 batches."""
        if len(self.log) - self.clocked < FIELDS:
            return
        with self.lock:
            log = self.log
            self._clock_upto(len(log) - len(log) % FIELDS)

    def _clock_upto(self, k: int) -> None:
        """The clock's part of a fold of the log's first ``k`` numbers (under the lock)."""
        start, log = self.clocked, self.log
        if k > start:
            self.clock.fold(log[start:k:FIELDS], (log[k - FIELDS], log[k - FIELDS + 1]))
            self.clocked = k

    def pass_begin(self, now: float) -> None:
        """``iter()`` at ``now``, in the loop's thread (the CPU clock is measured from it)."""
        self.fold_clock()
        with self.lock:
            if self.cpu0 is None or self.cpu0[2] != threading.get_ident():
                self.cpu0 = _cpu_now()
            self.clock.pass_begin(now)

    def pass_end(self, now: float) -> None:
        self.fold_clock()
        with self.lock:
            self.clock.pass_end(now)

    def add_region(self, name: str, seconds: float) -> None:
        with self.lock:
            self.region_s[name] += seconds

    def batches(self) -> int:
        return self.totals.batches + len(self.log) // FIELDS

    def last_wait(self) -> tuple[float, float]:
        """``(begin, end)`` of the latest completed wait (0, 0 if none)."""
        log, f = self.log, FIELDS
        k = len(log) - len(log) % f
        if k:
            try:
                return (log[k - f], log[k - f + 1])
            except IndexError:  # folded meanwhile by another thread
                pass
        last = self.clock.last
        return last if last is not None else (0.0, 0.0)

    def input_cpu(self, worker_type: str | None) -> float | None:
        """CPU seconds of threads other than the loop's since the clock began (thread workers
        only; ``None`` for process workers, in-process loading or a call from another thread)."""
        cpu0 = self.cpu0
        if worker_type != "thread" or cpu0 is None or cpu0[2] != threading.get_ident():
            return None
        proc, loop, _ = _cpu_now()
        return max(0.0, (proc - cpu0[0]) - (loop - cpu0[1]))

    def stats(
        self,
        workers: int,
        worker_type: str | None,
        settings: tuple[bool | None, int | None] = (None, None),
    ) -> StallStats:
        """A consistent snapshot of the counters and the rates derived from them;
        ``settings``: the loader's ``(persistent_workers, prefetch_factor)``, for the hint."""
        self.fold()
        stages = self.stages.snapshot(workers)
        with self.lock:
            regions = dict(self.region_s)
        t, clock = self.totals, self.clock
        stall, step, batches = clock.stall_s(t.stall_s), clock.step_s(t.stall_s), self.batches()
        steps = clock.steps(batches)
        wall = stall + step
        worker_s = sum(s.seconds for n, s in stages.items() if n in WORKER_STAGES)
        busy = min(1.0, worker_s / (max(1, workers) * wall)) if worker_s and wall > 0 else None

        def rate(x: float) -> float:
            return x / wall if wall > 0 else 0.0

        idle_s, idle_batches = self.device.totals()
        return StallStats(
            wall_s=wall,
            stall_s=stall,
            step_s=step,
            outside_s=clock.outside_s(),
            stall_fraction=rate(stall),
            batches=batches,
            samples=t.samples,
            bytes=t.bytes,
            batches_per_s=rate(batches),
            samples_per_s=rate(t.samples),
            bytes_per_s=rate(t.bytes),
            wait_mean_s=stall / batches if batches else 0.0,
            wait_p50_s=t.quantile(0.5),
            wait_p99_s=t.quantile(0.99),
            wait_max_s=t.wait_max_s,
            step_mean_s=step / steps if steps else 0.0,
            workers=workers,
            worker_type=worker_type,
            input_cpu_s=self.input_cpu(worker_type),
            input_busy=busy,
            slowest_stage=max(stages, key=lambda n: stages[n].effective_s) if stages else None,
            stages=stages,
            regions=regions,
            depths=dict(self.depth),
            device_idle_s=idle_s,
            device_idle_fraction=None if idle_s is None else rate(idle_s),
            device_batches=idle_batches,
            skipped=self.skipped,
            **self._robust(stall, wall, batches),
            persistent_workers=settings[0],
            prefetch_factor=settings[1],
        )

    def _robust(self, stall: float, wall: float, batches: int) -> dict[str, Any]:
        """The typical stall share and the outlier waits it leaves out (feedpipe.stall.robust)."""
        k = min(outliers(batches), self.totals.batches)
        top = self.totals.top_sum(k)
        return {
            "typical_stall_fraction": typical_fraction(stall, wall, top),
            "outlier_waits": k,
            "outlier_s": top,
        }

    def state_dict(self) -> dict[str, Any]:
        """The counters as a small JSON-able dict, so totals survive a resume."""
        self.fold()
        stages = self.stages.state()
        with self.lock:
            regions = dict(self.region_s)
        idle_s, idle_batches = self.device.totals()
        t, clock = self.totals, self.clock
        waits = t.state()
        return {
            "stall_s": clock.stall_s(t.stall_s),
            "step_s": clock.step_s(t.stall_s),
            "outside_s": clock.outside_s(),
            "wait_max_s": waits["wait_max_s"],
            "batches": self.batches(),
            "samples": t.samples,
            "bytes": t.bytes,
            "hist": waits["hist"],
            **stages,
            "region_s": regions,
            "device_idle_s": idle_s or 0.0,
            "device_batches": idle_batches,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` onto zeroed counters (the wait/step clocks restart)."""
        with self.lock:
            self.totals.load(state)
            outside = float(state.get("outside_s", 0.0))  # older states lack it
            self.clock.restore(self.totals.stall_s, float(state["step_s"]), outside)
            self.stages.load(state)
            self.region_s.update(state["region_s"])
            # older states lack the device counters
            idle = (float(state.get("device_idle_s", 0.0)), int(state.get("device_batches", 0)))
            self.device.reset(idle)
            self.skipped = int(state.get("skipped", 0))  # older states lack it
