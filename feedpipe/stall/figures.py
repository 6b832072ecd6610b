"""The figures of a stall snapshot: :class:`StageStats` and :class:`StallFigures`, the fields of
:class:`feedpipe.stall.stats.StallStats` (which adds the text of :mod:`feedpipe.stall.report`)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["StageStats", "StallFigures"]

_F = TypeVar("_F", bound="StallFigures")


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
class StallFigures:
    """The fields of a :class:`~feedpipe.stall.stats.StallStats` snapshot (see there)."""

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
    typical_stall_fraction: float | None = None
    outlier_waits: int = 0
    outlier_s: float = 0.0
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict, ready for ``json.dumps``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[_F], d: dict[str, Any]) -> _F:
        """Inverse of :meth:`to_dict` (used by the distributed summary)."""
        d = dict(d)
        d["stages"] = {k: StageStats(**v) for k, v in d["stages"].items()}
        return cls(**d)
