"""The pass clock of a stall meter: where the time between waits goes (step, outside, stall).

Waits and steps alternate inside a pass, so the step total is derived: from the first wait's
begin to the last wait's end (or a later pending wait, or the pass's end), less the stall and
the time *outside* (between one pass's end and the next pass's first wait). The loader's own
time at the turn of an epoch (the ``next()`` that raised ``StopIteration``, a later pass's
``iter()`` up to its first wait) is stall, kept here as ``stall_extra``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["PassClock"]


class PassClock:
    """The instants and gaps of a meter's passes (the meter calls it under its lock, except
    for ``wait_start`` and ``first_begin``, which the loop's thread sets on the hot path)."""

    def __init__(self) -> None:
        self.passes = 0  # passes in progress (iterators alive)
        self.reset()

    def reset(self) -> None:
        """Forget every instant and total (passes in progress stay)."""
        self.wait_start: float | None = None  # begin of a wait in progress (None: stepping)
        self.first_begin: float | None = None
        self.last: tuple[float, float] | None = None  # (begin, end) of the latest folded wait
        self.gap: float | None = None  # start of the open gap (no pass active since then)
        self.setup: float | None = None  # iter() of a later pass, until its first wait (stall)
        self.stall_extra = 0.0  # waits that delivered no batch: StopIteration, iter()
        self.outside_folded = 0.0  # closed gaps between passes
        # restored totals (load_state_dict): from before the clocks restarted
        self.stall_offset = 0.0
        self.step_offset = 0.0
        self.outside_offset = 0.0

    def restore(self, stall_s: float, step_s: float, outside_s: float) -> None:
        """Start from a saved meter's totals."""
        self.stall_offset = stall_s
        self.step_offset = step_s
        self.outside_folded = self.outside_offset = outside_s

    def pass_begin(self, now: float) -> None:
        """``iter()`` at ``now``: closes the open gap; until the first wait it is stall."""
        self.passes += 1
        gap = self.gap
        if gap is not None:
            self.outside_folded += max(0.0, now - gap)
            self.gap = None
            self.setup = max(now, gap)

    def pass_end(self, now: float) -> None:
        """A pass ended at ``now``: a pending wait counts as stall up to now; with no other pass
        active, a gap opens."""
        self.passes = max(0, self.passes - 1)
        last, begin = self.last, self.wait_start
        if last is None and self.first_begin is None:
            return  # nothing measured yet: the next wait starts the clock anyway
        if begin is not None and (last is None or begin > last[1]) and self.gap is None:
            self.stall_extra += max(0.0, now - begin)  # the wait that ended the pass
            self.wait_start = now  # consumed; the step clock stands at now
        if not self.passes and self.gap is None:
            self.gap = max(now, last[1]) if last is not None else now

    def fold(self, begins: Sequence[float], last: tuple[float, float]) -> None:
        """Waits not seen before, in record order (their ``begins``; ``last``: the latest's
        ``(begin, end)``): close a gap or a setup they began after. The counters hand each
        record here once, in order, before any pass boundary after it (``fold_clock``)."""
        if self.first_begin is None:
            self.first_begin = float(begins[0])
        gap, setup, last_begin = self.gap, self.setup, last[0]
        if gap is not None and last_begin >= gap:  # a wait without pass_begin: close it
            self.outside_folded += float(begins[bisect_left(begins, gap)]) - gap
            self.gap = None
        if setup is not None and last_begin >= setup:  # iter() until the first wait
            self.stall_extra += float(begins[bisect_left(begins, setup)]) - setup
            self.setup = None
        self.last = last

    def stall_s(self, folded: float) -> float:
        """The stall: ``folded`` waits, the turns of epochs and an open ``iter()``."""
        return folded + self.stall_extra + self._open_setup()

    def step_s(self, folded: float) -> float:
        """The step total, given the ``folded`` waits' stall."""
        first, last, begin, gap = self.first_begin, self.last, self.wait_start, self.gap
        if first is None or last is None:
            return self.step_offset
        end = last[1]
        if begin is not None and begin > end:  # a wait began (or ended in StopIteration)
            end = begin
        if gap is not None and gap > end:  # the pass ended (break) after its last step
            end = gap
        stall = self.stall_s(folded) - self.stall_offset
        inside = end - first - stall - self._open_outside()
        return self.step_offset + max(0.0, inside - (self.outside_folded - self.outside_offset))

    def outside_s(self) -> float:
        """Seconds outside iteration: from each pass's end to the next pass's first wait."""
        return self.outside_folded + self._open_outside()

    def steps(self, batches: int) -> int:
        """Completed steps: one before each wait after the first, plus the one in progress when
        a wait is pending or a pass ended with ``break``."""
        last, begin, gap = self.last, self.wait_start, self.gap
        pending = last is not None and (
            (begin is not None and begin > last[1]) or (gap is not None and gap > last[1])
        )
        return max(0, batches - 1) + pending

    def _open_setup(self) -> float:
        """``iter()`` up to a traced first wait that began after it (0 while none began)."""
        setup, begin = self.setup, self.wait_start
        return begin - setup if setup is not None and begin is not None and begin > setup else 0.0

    def _open_outside(self) -> float:
        """The open gap up to a traced wait that began after it (0 while no wait began)."""
        gap, begin = self.gap, self.wait_start
        return begin - gap if gap is not None and begin is not None and begin > gap else 0.0
