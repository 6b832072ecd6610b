"""One ``iter(loader)``: the :class:`Epoch` it counts into and the :class:`Pass` it runs.

- :class:`Epoch` is where the current epoch stands (batches and samples delivered, the RNG
  states at its start, the state it resumed from, the samples skipped so far). The loader keeps
  the latest one, as ``state_dict()`` reads it between passes; each ``iter()`` makes a fresh
  one, so an abandoned iterator cannot count into the next pass's.
- :class:`Pass` is what one iterator owns: that epoch, the worker handles (the source, the
  device feed's prefetcher, process workers' shared slots) and the index batches in flight
  (the stream's ``sent`` record, for error messages, and ``dropped``, the known-bad samples
  the stream took out). It goes with its iterator: the loader never holds a pass, so a
  dropped iterator ends its workers at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from feedpipe.device.feed import Prefetcher
from feedpipe.loader.index_stream import IndexStream
from feedpipe.loader.rng_state import RngStates
from feedpipe.loader.slots import Slots

__all__ = ["Epoch", "Pass"]


class Epoch:
    """Where the current epoch stands: updated per batch (a plain object, cheap to write)."""

    __slots__ = ("active", "batches", "resumed", "rng", "samples", "skipped")

    def __init__(self, resumed: dict[str, Any] | None = None) -> None:
        self.active = False
        self.batches = 0  # batches delivered this epoch (including before a resume)
        self.samples = 0  # samples delivered this epoch (including before a resume)
        self.rng: RngStates | None = None  # RNG states at the start of the epoch
        self.resumed = resumed  # the state this pass resumes from
        self.skipped: list[int] = []  # on_error="skip": indices dropped this epoch, delivered

    def resume_from(self, state: dict[str, Any]) -> int:
        """Take a saved state's counts; the index batches to skip (0: the sampler resumes)."""
        if not state["in_epoch"]:
            return 0
        self.batches, self.samples = int(state["batches"]), int(state["samples"])
        if "skipped" in state:
            self.skipped = list(state["skipped"]["epoch"])
        return self.batches if "sampler" not in state else 0


class Pass:
    """What one ``iter()`` owns (module docstring)."""

    __slots__ = ("delivered", "dropped", "epoch", "feed", "first", "lag", "sent", "slots", "source")

    def __init__(
        self,
        epoch: Epoch,
        source: Any,
        *,
        feed: Prefetcher | None = None,
        stream: IndexStream | None = None,
        slots: Slots | None = None,
        lag: int = 0,
    ) -> None:
        self.epoch = epoch
        self.source = source  # the workers: InlineSource, ThreadWorkers or torch's iterator
        self.feed = feed
        self.slots = slots  # process workers' shared slots (feedpipe.loader.slots)
        self.first = epoch.batches  # batch number (in the epoch) of this pass's first batch
        self.delivered = 0
        self.sent = stream.sent if stream is not None else None
        self.dropped = stream.dropped if stream is not None else None
        # out of order, batch n is delivered within the prefetch window of the n-th delivery
        self.lag = lag

    def count(self, samples: int) -> None:
        """One more batch of ``samples`` delivered (or failed) this epoch."""
        epoch = self.epoch
        epoch.batches += 1
        epoch.samples += samples
        if self.sent is not None:
            self.sent.pop(self.delivered - self.lag, None)
        self.delivered += 1

    def count_failed(self, indices: Any) -> int:
        """Count a failed batch (its samples as consumed); its batch number in the epoch."""
        self.count(len(indices) if isinstance(indices, (list, tuple, np.ndarray)) else 0)
        return self.first + self.delivered - 1

    def indices(self, batch: int) -> Any:
        """The indices of this pass's ``batch``-th index batch, if still in flight (else None)."""
        return self.sent.get(batch) if self.sent is not None else None

    def skip(self, indices: list[int]) -> None:
        """Samples dropped from a delivered batch: consumed, not delivered."""
        self.epoch.skipped.extend(indices)
        self.epoch.samples += len(indices)

    def take_dropped(self, batch: int) -> int:
        """How many known-bad samples the stream took out of this pass's ``batch``-th batch."""
        if self.dropped is None:
            return 0
        dropped = self.dropped.pop(batch, 0)
        self.epoch.samples += dropped
        return dropped

    def end(self) -> None:
        """The epoch ran out (``StopIteration``)."""
        self.epoch.active = False
