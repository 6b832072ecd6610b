"""The feed's copy times: CUDA event pairs read as the ``"h2d"`` stage once they have completed.

A pair is read without blocking (oldest first) and only once its batch is the consumer's (handed
over): its end event is the one the consumer's stream waited on, so it goes back to the
:class:`~feedpipe.device.event_pool.EventPool` only after that wait was enqueued. A recycled
event may still be queried through an older reference (a ring slot's); its newer record follows
the old one on the same copy stream, so such a query can only report completion later, never
too soon.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from feedpipe.device.cudacalls import CudaCalls
from feedpipe.device.event_pool import EventPool

__all__ = ["CopyTimes"]


class CopyTimes:
    """Pending ``(start, end, nbytes, ticket)`` copy timings; ``handed`` is the last ticket
    handed to the consumer (a pair with ticket 0 waits for no hand-over). Any thread may
    :meth:`add` or harvest (an abandoned iterator's ``finish()`` may run in the thread that
    drops it): one harvest at a time, so each pair is read and pooled once."""

    def __init__(self, calls: CudaCalls, pool: EventPool) -> None:
        self._calls, self._pool = calls, pool
        self._pending: deque[tuple[Any, Any, int, int]] = deque()
        self._lock = threading.Lock()
        self.handed = 0

    def add(self, start: Any, end: Any, nbytes: int, ticket: int = 0) -> None:
        """A copy of ``nbytes`` between ``start`` and ``end`` (recorded on the copy stream)."""
        self._pending.append((start, end, nbytes, ticket))

    def harvest(self, meter: Any | None, block: bool) -> None:
        """Report completed copies to ``meter`` (``"h2d"``), oldest first; with ``block``, every
        pending one (the epoch is over: its batches will not be handed over). Without ``block``
        it returns at once while another thread harvests (the GIL is not let go to wait)."""
        if not self._lock.acquire(blocking=block):
            return
        try:
            self._harvest(meter, block)
        finally:
            self._lock.release()

    def _harvest(self, meter: Any | None, block: bool) -> None:
        pending, calls = self._pending, self._calls
        while pending:
            start, end, nbytes, ticket = pending[0]
            if not block and (ticket > self.handed or not calls.query(end)):
                return
            if block:
                end.synchronize()
            pending.popleft()
            if meter is not None:
                meter.add_stage("h2d", calls.elapsed_ms(start, end) / 1000.0, nbytes)
            self._pool.give(start, end)
