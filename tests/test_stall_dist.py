"""Distributed stall summary on real gloo ranks (spawned processes on localhost, with a timeout)."""

from __future__ import annotations

import logging
import time
from typing import Any

from _dist import run_ranks

WORLD = 3
SLOW_RANK = 1


def _rank_loop(rank: int, world: int) -> dict[str, Any]:
    """Each rank runs 12 batches; rank 1 waits 30 ms per batch, the others 1 ms."""
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
    wait = 0.030 if rank == SLOW_RANK else 0.001
    injected = 0.0  # what each wait really slept (sleeps overshoot on a busy machine)
    for _ in range(12):
        meter.wait_begin()
        t0 = time.monotonic()
        time.sleep(wait)
        injected += time.monotonic() - t0
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
        "stall_s": [s.stall_s for s in last.stats],
        "injected": injected,
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
        assert fr[SLOW_RANK] == max(fr)
        # every rank's gathered stall matches what that rank injected (5% or 1 ms per batch)
        for i, other in enumerate(results):
            assert abs(r["stall_s"][i] - other["injected"]) <= max(0.05 * other["injected"], 0.012)
        assert r["median"] == sorted(fr)[1]
        assert r["gap"] == fr[SLOW_RANK] - r["median"] and r["gap"] > 0.2
        assert f"slowest is rank {SLOW_RANK}" in r["line"] and "3 ranks" in r["line"]
        # logged on rank 0 only
        assert len(r["logs"]) == (2 if rank == 0 else 0)
    assert results[0]["sub_ranks"] == [0, 2] and results[2]["sub_ranks"] == [0, 2]
    assert results[0]["sub_slowest"] in (0, 2)
    assert results[1]["sub_ranks"] is None
