"""Snapshot types of :class:`feedpipe.StallMeter`: :class:`StallStats`, :class:`StageStats`."""

from __future__ import annotations

import dataclasses
from typing import Any

from feedpipe.stall.report import format_report, format_summary

__all__ = ["StageStats", "StallStats"]


@dataclasses.dataclass(frozen=True)
class StageStats:
    """Totals for one pipeline stage.

    ``seconds`` is summed over every thread/worker that ran the stage; ``per_batch_s`` is the
    latency of one call (``seconds / calls``); ``effective_s`` divides that latency by the
    stage's parallelism (``workers`` for ``feedpipe.stall.WORKER_STAGES``, else 1): the time
    the stage adds to each batch once its parallel copies overlap. Compare it with the step.
    """

    seconds: float
    bytes: int
    calls: int
    per_batch_s: float
    effective_s: float


@dataclasses.dataclass(frozen=True)
class StallStats:
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

    wall_s: float
    stall_s: float
    step_s: float
    outside_s: float
    stall_fraction: float
    batches: int
    samples: int
    bytes: int
    batches_per_s: float
    samples_per_s: float
    bytes_per_s: float
    wait_mean_s: float
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    step_mean_s: float
    workers: int
    worker_type: str | None
    input_cpu_s: float | None
    input_busy: float | None
    slowest_stage: str | None
    stages: dict[str, StageStats]
    regions: dict[str, float]
    depths: dict[str, int]
    device_idle_s: float | None = None
    device_idle_fraction: float | None = None
    device_batches: int = 0
    skipped: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict, ready for ``json.dumps``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StallStats:
        """Inverse of :meth:`to_dict` (used by the distributed summary)."""
        d = dict(d)
        d["stages"] = {k: StageStats(**v) for k, v in d["stages"].items()}
        return cls(**d)

    def summary(self) -> str:
        """One line: stall %, p50/p99 wait, throughput, slowest stage."""
        return format_summary(self)

    def report(self) -> str:
        """Several lines: totals, per-stage table and a plain-language hint."""
        return format_report(self)
