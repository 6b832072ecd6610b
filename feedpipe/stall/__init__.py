"""Stall counters: how long the training loop waited for input, and which stage is to blame.

:mod:`~feedpipe.stall.meter` holds :class:`StallMeter` (the hot-path counters and how they are
read), :mod:`~feedpipe.stall.records` the packed per-batch records and their vectorised fold,
:mod:`~feedpipe.stall.profiler` the flag that says whether waits are profiler ranges,
:mod:`~feedpipe.stall.stats` the snapshot it returns, :mod:`~feedpipe.stall.report` the
printed report and its hint, :mod:`~feedpipe.stall.sinks` the periodic emitters (log, JSONL,
TensorBoard), :mod:`~feedpipe.stall.device` the CUDA events behind *device idle for input* and
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
