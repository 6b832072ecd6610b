"""Timing events made once and reused: a CUDA event per record costs a create and a destroy,
each a CUDA call that lets the GIL go (see :mod:`feedpipe.device.cudacalls`)."""

from __future__ import annotations

from typing import Any

__all__ = ["EventPool"]


class EventPool:
    """Timing-enabled CUDA events handed out and given back; any thread may take or give
    (a list's ``pop`` and ``extend`` are atomic). An event is given back only once nothing will
    wait on, query or read its last record again.

    Every event of one pool is recorded on one stream (the feed's copy stream): an old
    reference to a recycled event then sees a later record on the same stream, so a wait or
    query through it finishes late, never early. A pool must not be shared across streams."""

    def __init__(self) -> None:
        import torch

        self._new = torch.cuda.Event
        self._free: list[Any] = []

    def take(self) -> Any:
        """A free event, or a new one (torch creates it on the device at its first record)."""
        try:
            return self._free.pop()
        except IndexError:
            return self._new(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated in torch

    def __len__(self) -> int:
        """How many events are free."""
        return len(self._free)

    def give(self, *events: Any) -> None:
        """Return events to the pool."""
        self._free.extend(events)
