"""Where stall counters go: Python logging, JSON lines, TensorBoard scalars.

A sink is polled by its :class:`~feedpipe.stall.StallMeter` after each batch (in ``wait_end``)
and emits a :class:`~feedpipe.stall.StallStats` snapshot every ``every_s`` seconds and/or every
``every_steps`` batches, whichever comes first. Attach with ``meter.add_sink(sink)``;
``meter.close()`` emits a final snapshot and closes the sinks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from feedpipe.errors import MissingExtraError

if TYPE_CHECKING:  # pragma: no cover
    from feedpipe.stall.stats import StallStats

__all__ = ["JsonlSink", "LoggingSink", "Sink", "SinkSet", "TensorBoardSink"]


class Sink:
    """Base class: decides *when* to emit; subclasses implement :meth:`write` (*what*/*where*).

    Args:
        every_s: emit at most this often, in seconds of wall time (``None``: not time-based).
        every_steps: emit every this many batches (``None``: not step-based).
    """

    def __init__(self, every_s: float | None = None, every_steps: int | None = None) -> None:
        if every_s is None and every_steps is None:
            raise ValueError(f"{type(self).__name__}: give every_s or every_steps")
        if every_s is not None and not every_s > 0:
            raise ValueError(f"{type(self).__name__}: every_s must be > 0, got {every_s}")
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"{type(self).__name__}: every_steps must be >= 1, got {every_steps}")
        self.every_s = every_s
        self.every_steps = every_steps
        self._last_t = -math.inf
        self._last_b = 0
        self.emitted = 0

    def restart(self, now: float, batches: int = 0) -> None:
        """Start the interval clocks at ``now`` / ``batches`` (called on attach and reset)."""
        self._last_t = now
        self._last_b = batches

    def due(self, now: float, batches: int) -> bool:
        if self.every_steps is not None and batches - self._last_b >= self.every_steps:
            return True
        return self.every_s is not None and now - self._last_t >= self.every_s

    def emit(self, stats: StallStats, now: float, meter: object | None = None) -> None:
        self._last_t = now
        self._last_b = stats.batches
        self.emitted += 1
        self.write(stats)

    def write(self, stats: StallStats) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self, stats: StallStats | None = None) -> None:
        """Emit a final snapshot if batches arrived since the last one, then release resources."""
        if stats is not None and stats.batches > self._last_b:
            self.emit(stats, time.perf_counter())


class LoggingSink(Sink):
    """Log ``meter.summary()`` (or the full report) through Python :mod:`logging`."""

    def __init__(
        self,
        logger: logging.Logger | str | None = None,
        *,
        level: int = logging.INFO,
        every_s: float | None = 30.0,
        every_steps: int | None = None,
        report: bool = False,
    ) -> None:
        super().__init__(every_s, every_steps)
        if logger is None or isinstance(logger, str):
            logger = logging.getLogger(logger or "feedpipe.stall")
        self.logger = logger
        self.level = level
        self.report = report

    def write(self, stats: StallStats) -> None:
        text = stats.report() if self.report else stats.summary()
        self.logger.log(self.level, "feedpipe: %s", text)


class JsonlSink(Sink):
    """Append one JSON object per emit to ``path``: ``{"time": unix_s, **stats.to_dict()}``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        every_s: float | None = 10.0,
        every_steps: int | None = None,
    ) -> None:
        super().__init__(every_s, every_steps)
        self.path = Path(path)
        self._file: IO[str] | None = None

    def write(self, stats: StallStats) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        record = {"time": time.time(), **stats.to_dict()}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self, stats: StallStats | None = None) -> None:
        super().close(stats)
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink(Sink):
    """Write scalars to a ``torch.utils.tensorboard.SummaryWriter`` (or a log directory).

    Scalars (under ``prefix/``): ``stall_fraction``, ``device_idle_fraction`` (with a CUDA
    device: device idle for input), ``outside_s`` (seconds between passes),
    ``wait_p50_ms``, ``wait_p99_ms``,
    ``samples_per_s``, ``batches_per_s``, ``stage/NAME_ms`` (effective per-batch time) and
    ``depth/NAME``; the global step is the meter's batch count. TensorBoard is optional: passing
    a directory needs ``pip install tensorboard``.
    """

    def __init__(
        self,
        writer: Any,
        *,
        every_steps: int | None = 100,
        every_s: float | None = None,
        prefix: str = "feedpipe",
    ) -> None:
        super().__init__(every_s, every_steps)
        self._owned = isinstance(writer, (str, os.PathLike))
        if self._owned:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise MissingExtraError(
                    "TensorBoardSink needs the 'tensorboard' package: pip install tensorboard"
                ) from exc
            writer = SummaryWriter(log_dir=os.fspath(writer))
        self.writer = writer
        self.prefix = prefix.rstrip("/")

    def scalars(self, stats: StallStats) -> dict[str, float]:
        """The tag -> value pairs written at each emit."""
        p = self.prefix
        out = {
            f"{p}/stall_fraction": stats.stall_fraction,
            f"{p}/outside_s": stats.outside_s,
            f"{p}/wait_p50_ms": stats.wait_p50_s * 1e3,
            f"{p}/wait_p99_ms": stats.wait_p99_s * 1e3,
            f"{p}/samples_per_s": stats.samples_per_s,
            f"{p}/batches_per_s": stats.batches_per_s,
        }
        if stats.device_idle_fraction is not None:
            out[f"{p}/device_idle_fraction"] = stats.device_idle_fraction
        for name, st in stats.stages.items():
            out[f"{p}/stage/{name}_ms"] = st.effective_s * 1e3
        for name, n in stats.depths.items():
            out[f"{p}/depth/{name}"] = float(n)
        return out

    def write(self, stats: StallStats) -> None:
        for tag, value in self.scalars(stats).items():
            self.writer.add_scalar(tag, value, global_step=stats.batches)

    def close(self, stats: StallStats | None = None) -> None:
        super().close(stats)
        self.writer.flush()
        if self._owned:
            self.writer.close()


class SinkSet:
    """The sinks attached to one meter: polled after a batch, restarted on reset, closed."""

    def __init__(self) -> None:
        self.sinks: list[Sink] = []

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def add(self, sink: Sink, now: float, batches: int) -> None:
        sink.restart(now, batches)
        self.sinks.append(sink)

    def remove(self, sink: Sink) -> None:
        self.sinks.remove(sink)

    def restart(self, now: float) -> None:
        """Every sink's interval clocks start again (the meter's counters were zeroed)."""
        for sink in self.sinks:
            sink.restart(now, 0)

    def poll(
        self, now: float, batches: int, stats: Callable[[], StallStats], meter: object
    ) -> None:
        """Emit one snapshot (``stats()``, taken only when some sink is due) to the due ones."""
        due = [s for s in self.sinks if s.due(now, batches)]
        if due:
            snapshot = stats()
            for sink in due:
                sink.emit(snapshot, now, meter)

    def close(self, stats: Callable[[], StallStats]) -> None:
        """A final snapshot to every sink, closed and detached."""
        snapshot = stats() if self.sinks else None
        for sink in self.sinks:
            if snapshot is not None:
                sink.close(snapshot)
        self.sinks.clear()
