"""Device idle for input: how long the GPU's stream waited for a batch, from CUDA events.

Host-side stall (time in ``next()``) misreads asynchronous GPU work: the host may wait while the
GPU is still busy with the last step (no harm done), or return at once while the GPU sits idle
behind a late copy. A :class:`DeviceClock` asks the GPU itself. Per batch it records two events
on the consumer's stream:

- **A**, the first thing ``next()`` does (before the host waits for the batch). The stream
  reaches A when it has finished the work queued before it: the previous step's compute.
- **B**, the last thing ``next()`` does, after the consumer stream was made to wait for the
  batch's copy (the hand-off) and the loader's bookkeeping. The stream reaches B when the
  input is there and the loader has let go of the host thread.

``B - A`` (GPU clock) is the time the stream sat between its last step and its next input:
*device idle for input*. When compute is the bottleneck the copy finished long before, so
``B - A`` is about zero; when input is late (a slow worker, a slow copy) the stream has drained
and waits. Time the GPU idles because the *host* is slow elsewhere (the user's own Python
between steps) is not counted: A is then reached as soon as it is queued. So the figure is
lower than the gaps between CUDA events around each step by the host's own time between
``next()`` and the step's first launch (a few microseconds per step; see
``docs/concepts/stall-counters.md``).

B is the last CUDA call the loader makes before ``next()`` returns: the pairs already recorded
are read before it. With ``FEEDPIPE_CUDA_KEEP_GIL=1`` A and B are also recorded with the GIL
held (:mod:`feedpipe.device.cudacalls`), so nothing between B and the return lets the GIL go.
Otherwise, with worker threads running, the training thread may wait to win the GIL back after
B, before it launches its next step: device idle that B has already closed, so not counted
(docs/benchmarks.md, "Stall counters: device idle for input, checked against CUDA-event
gaps").

Events are reused from a small pool and read without blocking (``query``): a pair counts once
its B has completed, oldest first. Only for CUDA devices; torch is imported by the caller.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from feedpipe.io.forks import ForkLock

__all__ = ["DeviceClock", "DeviceIdle"]


class DeviceClock:
    """CUDA event pairs at batch hand-off; ``idle_s`` sums the completed ones (GPU seconds)."""

    def __init__(self, device: Any) -> None:
        import torch

        from feedpipe.device.cudacalls import cuda_calls
        from feedpipe.device.event_pool import EventPool

        self._torch = torch
        self._calls = cuda_calls()
        self.device = torch.device(device)
        self._pending: deque[tuple[Any, Any]] = deque()
        self.events = EventPool()  # A and B events, reused
        # a plain lock (tests read .locked()) that a forked child finds free: a child forked
        # while another thread polled (a stats() snapshot) would wait for it for ever
        self._fork = ForkLock(reentrant=False)
        self.idle_s = 0.0
        self.batches = 0

    def begin(self, stream: Any = None) -> Any:
        """``next()`` starts: record A on ``stream`` (default: the current stream); returns it."""
        ev = self.events.take()
        stream = stream if stream is not None else self._torch.cuda.current_stream(self.device)
        self._calls.record(ev, stream)
        return ev

    def end(self, begin: Any, stream: Any = None) -> None:
        """Hand-off: record B after the consumer stream waits for the copy; pair it with A.
        B is the last CUDA call: the completed pairs are read first (module docstring)."""
        if len(self._pending) >= 2:
            self.poll()
        ev = self.events.take()
        stream = stream if stream is not None else self._torch.cuda.current_stream(self.device)
        with self._fork.lock:  # poll()/reset() from another thread walk the pairs: wait before B
            self._calls.record(ev, stream)
            self._pending.append((begin, ev))

    def cancel(self, begin: Any) -> None:
        """``next()`` delivered no batch (the epoch ended): give A back to the pool."""
        self.events.give(begin)

    def poll(self, wait: bool = False) -> None:
        """Add the completed pairs (all of them, synchronizing, when ``wait``), oldest first."""
        with self._fork.lock:
            pending, calls = self._pending, self._calls
            total, n = 0.0, 0
            while pending:
                a, b = pending[0]
                if not wait and not calls.query(b):
                    break
                if wait:
                    b.synchronize()
                pending.popleft()
                total += max(0.0, calls.elapsed_ms(a, b)) / 1000.0
                n += 1
                self.events.give(a, b)
            self.idle_s += total
            self.batches += n

    def reset(self) -> None:
        """Forget the totals and the pairs not yet read (their events go back to the pool)."""
        with self._fork.lock:
            for pair in self._pending:
                self.events.give(*pair)
            self._pending.clear()
            self.idle_s = 0.0
            self.batches = 0


class DeviceIdle:
    """A meter's *device idle for input*: its :class:`DeviceClock` (``clock``, once a CUDA
    device is watched) and the totals a restored state brought (``offset``)."""

    def __init__(self) -> None:
        self.clock: DeviceClock | None = None
        self.offset: tuple[float, int] = (0.0, 0)  # idle seconds and batches restored

    def watch(self, device: Any) -> DeviceClock | None:
        """The clock of ``device`` (CUDA only; else ``None``); idempotent for one device."""
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            return None
        if self.clock is None or self.clock.device != dev:
            self.clock = DeviceClock(dev)
        return self.clock

    def reset(self, offset: tuple[float, int] = (0.0, 0)) -> None:
        """Zero the clock's totals and start from ``offset``."""
        self.offset = offset
        if self.clock is not None:
            self.clock.reset()

    def totals(self) -> tuple[float | None, int]:
        """(device idle seconds, batches measured), ``None`` seconds when never measured."""
        clock, (off_s, off_n) = self.clock, self.offset
        if clock is None:
            return (off_s if off_n else None), off_n
        clock.poll()
        return off_s + clock.idle_s, off_n + clock.batches
