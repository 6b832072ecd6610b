"""meter.gather(): the slowest rank and its slowest stage, in one fixed-size all_gather.

Real gloo ranks (spawned processes on localhost), each iterating a real ``feedpipe.DataLoader``;
one rank's dataset is slowed on purpose. 3 ranks in the default run, 8 under ``slow``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _dist import run_ranks

SLOW_RANK = 2


class _Sleepy:
    """A map-style dataset whose ``__getitem__`` sleeps ``delay`` seconds (the slowed fetch)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([i])


def _rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import feedpipe
    from feedpipe.stall import RECORD_BYTES, StallMeter

    calls: list[tuple[str, int]] = []
    real_all_gather, real_object = dist.all_gather, dist.all_gather_object

    def counting(tensors: Any, tensor: Any, *a: Any, **k: Any) -> Any:
        calls.append(("all_gather", tensor.numel() * tensor.element_size()))
        return real_all_gather(tensors, tensor, *a, **k)

    def counting_object(*a: Any, **k: Any) -> Any:
        calls.append(("all_gather_object", -1))
        return real_object(*a, **k)

    dist.all_gather, dist.all_gather_object = counting, counting_object  # type: ignore[assignment]
    meter = StallMeter(trace=False)
    delay = 0.02 if rank == SLOW_RANK else 0.0
    loader = feedpipe.DataLoader(_Sleepy(8, delay), batch_size=1, meter=meter)
    for _ in loader:
        time.sleep(0.002)  # the step
    if rank == 0:  # content that a variable-size gather would grow with
        for i in range(50):
            meter.add_stage(f"custom-stage-{i}", 1e-6)
            with meter.region(f"region-{i}"):
                pass
    summary = meter.gather()
    try:
        return {
            "calls": calls,
            "record": RECORD_BYTES,
            "slowest_rank": summary.slowest_rank,
            "slowest_stage": summary.slowest_stage,
            "slowest_stage_s": summary.slowest_stage_s,
            "line": summary.line(),
            "ranks": summary.ranks,
            "batches": [s.batches for s in summary.stats],
            "stages": [s.slowest_stage for s in summary.stats],
            "fetch_s": meter.stats().stages["fetch"].effective_s,
        }
    finally:
        dist.all_gather, dist.all_gather_object = real_all_gather, real_object


def _check(results: list[dict[str, Any]], world: int) -> None:
    slow = results[SLOW_RANK]
    for r in results:
        # one collective per call, of a fixed size, whatever each rank reported
        assert r["calls"] == [("all_gather", r["record"])]
        assert r["record"] == 152
        assert r["ranks"] == list(range(world))
        assert r["batches"] == [8] * world
        assert r["slowest_rank"] == SLOW_RANK
        assert r["slowest_stage"] == "fetch"
        assert r["slowest_stage_s"] == pytest.approx(slow["fetch_s"])
        assert r["slowest_stage_s"] >= 0.02
        assert f"slowest is rank {SLOW_RANK}" in r["line"]
        assert "its slowest stage fetch" in r["line"]
        assert f"{world} ranks" in r["line"]


def test_gather_names_slowest_rank_and_stage_3_ranks() -> None:
    _check(run_ranks(_rank, 3, timeout=90.0), 3)


@pytest.mark.slow
def test_gather_names_slowest_rank_and_stage_8_ranks() -> None:
    _check(run_ranks(_rank, 8, timeout=180.0), 8)


def test_record_is_fixed_size_and_round_trips() -> None:
    """The packed record's size does not depend on content; every number survives."""
    import math

    from feedpipe.stall import RECORD_BYTES, StallMeter
    from feedpipe.stall.distributed import _pack, _unpack

    m = StallMeter(trace=False)
    small = m.stats()
    for i in range(200):
        m.add_stage(f"a-very-long-custom-stage-name-number-{i:04d}", 0.5 + i)
    m.wait_pending(0.0)
    m.record_batch(1.0, 3.0, 7, 2**40 + 1, 0.25, 0.125)
    big = m.stats()
    assert len(_pack(small)) == len(_pack(big)) == RECORD_BYTES
    back = _unpack(5, _pack(big))
    assert back.rank == 5 and back.batches == 1 and back.samples == 7
    assert back.bytes == 2**40 + 1 and back.stall_s == big.stall_s
    assert back.slowest_stage == big.slowest_stage[:32]  # type: ignore[index]
    assert back.slowest_stage_s == big.stages[big.slowest_stage].effective_s  # type: ignore[index]
    assert back.device_idle_s is None and back.device_idle_fraction is None
    assert not math.isnan(back.wait_max_s)
