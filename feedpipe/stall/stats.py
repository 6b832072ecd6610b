"""Snapshot types of :class:`feedpipe.StallMeter`: :class:`StallStats`, :class:`StageStats`."""

from __future__ import annotations

from feedpipe.stall.figures import StageStats, StallFigures
from feedpipe.stall.report import format_report, format_summary

__all__ = ["StageStats", "StallStats"]


class StallStats(StallFigures):
    """A snapshot of a :class:`StallMeter`; every field is a plain number, string or dict.

    ``wall_s = stall_s + step_s`` is the time inside iteration: from the first wait to the last
    wait's end (or to the end of a pass), less ``outside_s``, the time between passes (from one
    pass's end to the next ``iter()``: validation, logging, checkpoints between epochs).
    ``stall_s`` includes the ``next()`` that raised ``StopIteration`` and a later pass's
    ``iter()`` up to its first wait. ``stall_fraction = stall_s / wall_s``. Rates are per
    second of ``wall_s``. ``worker_type`` is ``"thread"``, ``"process"`` or ``None``
    (in-process); ``input_cpu_s`` is the CPU time of threads other than the loop's (thread
    workers only, else ``None``), which tells a CPU-bound fetch from an I/O-bound one.
    ``input_busy`` is the share of worker time spent in worker stages (``None`` without stage
    data): low means the input pipeline is mostly idle. ``slowest_stage`` is the stage with the
    largest ``effective_s`` (see :class:`StageStats`), or ``None`` when no stage was reported.
    ``device_idle_s`` is *device idle for input*: GPU seconds the consumer's stream waited for
    its batch, from CUDA events at hand-off (``None`` unless the loader feeds a CUDA device; see
    :mod:`feedpipe.stall.device`), over ``device_batches`` batches whose events completed;
    ``device_idle_fraction`` is it per second of ``wall_s``.
    ``skipped`` counts the samples ``DataLoader(on_error="skip")`` dropped (not in ``samples``).
    """

    def summary(self) -> str:
        """One line: stall %, p50/p99 wait, throughput, slowest stage."""
        return format_summary(self)

    def report(self) -> str:
        """Several lines: totals, per-stage table and a plain-language hint."""
        return format_report(self)
