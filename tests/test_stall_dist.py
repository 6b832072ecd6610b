"""Distributed stall summary on real gloo ranks (spawned processes on localhost, with a timeout)."""

from __future__ import annotations

import logging
import time
from typing import Any

from _dist import run_ranks

WORLD = 3
SLOW_RANK = 1


def _rank_loop(rank: int, world: int) -> dict[str, Any]:
    """Each rank runs 12 batches; rank 1 waits 12 ms per batch, the others 1 ms."""
    import torch.distributed as dist

    from feedpipe.stall import DistributedSink, StallMeter

    seen: list[Any] = []
    logs: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append(record.getMessage())

    logger = logging.getLogger(f"feedpipe.test.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.addHandler(_Keep())
    meter = StallMeter(trace=False)
    sink = meter.add_sink(DistributedSink(every_steps=6, logger=logger, callback=seen.append))
    wait = 0.012 if rank == SLOW_RANK else 0.001
    for _ in range(12):
        meter.wait_begin()
        time.sleep(wait)
        meter.wait_end(samples=4)
        time.sleep(0.003)
    # an explicit gather on a sub-group of ranks 0 and 2 (every rank must create it)
    sub = dist.new_group([0, 2])
    sub_summary = meter.gather(sub) if rank in (0, 2) else None
    assert sink.last is seen[-1]
    last = seen[-1]
    return {
        "n": len(seen),
        "slowest": [s.slowest_rank for s in seen],
        "ranks": last.ranks,
        "gap": last.gap,
        "median": last.median_stall_fraction,
        "fractions": [s.stall_fraction for s in last.stats],
        "batches": [s.batches for s in last.stats],
        "line": last.line(),
        "logs": logs,
        "sub_ranks": None if sub_summary is None else sub_summary.ranks,
        "sub_slowest": None if sub_summary is None else sub_summary.slowest_rank,
    }


def test_distributed_summary_names_slowest_rank() -> None:
    results = run_ranks(_rank_loop, WORLD, timeout=90.0)
    for rank, r in enumerate(results):
        assert r["n"] == 2  # gathered at batches 6 and 12
        assert r["slowest"] == [SLOW_RANK, SLOW_RANK]
        assert r["ranks"] == [0, 1, 2] and r["batches"] == [12, 12, 12]
        fr = r["fractions"]
        assert fr[SLOW_RANK] > 2 * max(fr[0], fr[2])
        assert r["median"] == sorted(fr)[1]
        assert r["gap"] == fr[SLOW_RANK] - r["median"] and r["gap"] > 0.2
        assert f"slowest is rank {SLOW_RANK}" in r["line"] and "3 ranks" in r["line"]
        # logged on rank 0 only
        assert len(r["logs"]) == (2 if rank == 0 else 0)
    assert results[0]["sub_ranks"] == [0, 2] and results[2]["sub_ranks"] == [0, 2]
    assert results[0]["sub_slowest"] in (0, 2)
    assert results[1]["sub_ranks"] is None
