"""Stall counters: how long the training loop waited for input, and which stage is to blame.

:mod:`~feedpipe.stall.meter` holds :class:`StallMeter` (the hot-path counters and how they are
read), :mod:`~feedpipe.stall.stats` the snapshot it returns, :mod:`~feedpipe.stall.report` the
printed report and its hint, :mod:`~feedpipe.stall.sinks` the periodic emitters (log, JSONL,
TensorBoard) and :mod:`~feedpipe.stall.distributed` the cross-rank summary. The public names are
re-exported here; ``feedpipe.stall.X`` is the path to use.
"""

from __future__ import annotations

from feedpipe.stall.distributed import DistributedSink, DistributedSummary, gather_stats
from feedpipe.stall.meter import WORKER_STAGES, NullMeter, StallMeter
from feedpipe.stall.sinks import JsonlSink, LoggingSink, Sink, TensorBoardSink
from feedpipe.stall.stats import StageStats, StallStats

__all__ = [
    "WORKER_STAGES",
    "DistributedSink",
    "DistributedSummary",
    "JsonlSink",
    "LoggingSink",
    "NullMeter",
    "Sink",
    "StageStats",
    "StallMeter",
    "StallStats",
    "TensorBoardSink",
    "gather_stats",
]
