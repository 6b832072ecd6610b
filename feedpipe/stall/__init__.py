"""Stall counters: how long the training loop waited for input, and which stage is to blame.

:mod:`~feedpipe.stall.meter` holds :class:`StallMeter` (the hot path, passes, ranges and
sinks) and the disabled :class:`NullMeter`; :mod:`~feedpipe.stall.counters` the counters it
owns: the packed per-batch records and their vectorised fold (:mod:`~feedpipe.stall.records`),
the wait totals (:mod:`~feedpipe.stall.totals`), the pass clock (:mod:`~feedpipe.stall.clock`)
and the stage totals (:mod:`~feedpipe.stall.stages`); :mod:`~feedpipe.stall.profiler` the
profiler ranges and the flag that says whether waits are ranges,
:mod:`~feedpipe.stall.stats` the snapshot it returns (its fields in
:mod:`~feedpipe.stall.figures`), :mod:`~feedpipe.stall.report` the printed report and its
hint, :mod:`~feedpipe.stall.sinks` the periodic emitters (log, JSONL, TensorBoard),
:mod:`~feedpipe.stall.device` the CUDA events behind *device idle for input* and
:mod:`~feedpipe.stall.distributed` the cross-rank summary. The public names are
re-exported here; ``feedpipe.stall.X`` is the path to use.
"""

from __future__ import annotations

from feedpipe.stall.device import DeviceClock
from feedpipe.stall.distributed import (
    RECORD_BYTES,
    DistributedSink,
    DistributedSummary,
    RankStats,
    gather_stats,
)
from feedpipe.stall.meter import WORKER_STAGES, StallMeter
from feedpipe.stall.null import NullMeter
from feedpipe.stall.sinks import JsonlSink, LoggingSink, Sink, TensorBoardSink
from feedpipe.stall.stats import StageStats, StallStats

__all__ = [
    "RECORD_BYTES",
    "WORKER_STAGES",
    "DeviceClock",
    "DistributedSink",
    "DistributedSummary",
    "JsonlSink",
    "LoggingSink",
    "NullMeter",
    "RankStats",
    "Sink",
    "StageStats",
    "StallMeter",
    "StallStats",
    "TensorBoardSink",
    "gather_stats",
]
