"""The feed's copy times: CUDA event pairs read as the ``"h2d"`` stage once they have completed.

A pair is read without blocking (oldest first) and only once its batch is the consumer's (handed
over): its end event is the one the consumer's stream waited on, so it goes back to the
:class:`~feedpipe.device.event_pool.EventPool` only after that wait was enqueued. A recycled
event may still be queried through an older reference (a ring slot's); its newer record follows
the old one on the same copy stream, so such a query can only report completion later, never
too soon.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from feedpipe.device.cudacalls import CudaCalls
from feedpipe.device.event_pool import EventPool

__all__ = ["CopyTimes"]


class CopyTimes:
    """Pending ``(start, end, nbytes, ticket)`` copy timings; ``handed`` is the last ticket
    handed to the consumer (a pair with ticket 0 waits for no hand-over). Any thread may
    :meth:`add` or harvest, also re-entrantly (an abandoned iterator's ``finish()`` runs in the
    thread that drops it, or in a garbage collection inside a harvest): a harvest takes a pair
    off the queue before it reads it, so each pair is read and pooled once, with no lock."""

    def __init__(self, calls: CudaCalls, pool: EventPool) -> None:
        self._calls, self._pool = calls, pool
        self._pending: deque[tuple[Any, Any, int, int]] = deque()
        self.handed = 0

    def add(self, start: Any, end: Any, nbytes: int, ticket: int = 0) -> None:
        """A copy of ``nbytes`` between ``start`` and ``end`` (recorded on the copy stream)."""
        self._pending.append((start, end, nbytes, ticket))

    def harvest(self, meter: Any | None, block: bool) -> None:
        """Report completed copies to ``meter`` (``"h2d"``), oldest first; with ``block``, every
        pending one (the epoch is over: its batches will not be handed over)."""
        pending, calls = self._pending, self._calls
        while True:
            try:
                pair = pending.popleft()  # taken first: no other harvest can read it too
            except IndexError:
                return
            start, end, nbytes, ticket = pair
            if not block and (ticket > self.handed or not calls.query(end)):
                pending.appendleft(pair)  # not yet: back at the head
                return
            if block:
                end.synchronize()
            if meter is not None:
                meter.add_stage("h2d", calls.elapsed_ms(start, end) / 1000.0, nbytes)
            self._pool.give(start, end)
