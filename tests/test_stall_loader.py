"""Stall counters inside ``feedpipe.DataLoader``: in-process, thread and process workers.

A synthetic dataset sleeps a known time per sample and the loop sleeps a known step; the meter's
per-stage times and stall must match the injected delays (and an independent clock around each
``next()``) within 5% or 1 ms per batch.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from feedpipe.stall import StallMeter, StallStats

loader_mod = pytest.importorskip("feedpipe.loader", reason="feedpipe.DataLoader has not landed")
DataLoader = loader_mod.DataLoader

DELAY = 0.004  # per sample
BATCH = 2
STEP = 0.006
N_BATCHES = 10


class SleepyDataset(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((4,), i, dtype=torch.int64)


def _close(actual: float, expected: float, n: int = 1) -> bool:
    """Within 5% or 1 ms per batch."""
    return abs(actual - expected) <= max(0.05 * expected, 1e-3 * n)


def _run(loader: Any, step: float) -> tuple[float, float]:
    """Iterate once with a sleep as the step; return the waits and steps seen by our own clock."""
    waits = steps = 0.0
    last = None
    it = iter(loader)
    while True:
        t0 = time.monotonic()
        if last is not None:
            steps += t0 - last
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.monotonic()
        waits += t1 - t0
        assert batch.shape == (BATCH, 4)
        last = t1
        time.sleep(step)
    return waits, steps


def test_in_process_matches_injected_delays() -> None:
    ds = SleepyDataset(N_BATCHES * BATCH, DELAY)
    meter = StallMeter(trace=False)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0, meter=meter)
    assert loader.meter is meter
    ref_wait, ref_step = _run(loader, STEP)
    s = loader.stats()
    assert isinstance(s, StallStats)
    assert s.batches == N_BATCHES and s.samples == N_BATCHES * BATCH
    assert s.bytes == N_BATCHES * BATCH * 4 * 8
    # fetch is the injected sleep: BATCH * DELAY per batch
    assert _close(s.stages["fetch"].per_batch_s, BATCH * DELAY)
    # in-process loading: the whole fetch is a wait
    assert _close(s.wait_mean_s, BATCH * DELAY)
    assert _close(s.step_mean_s, STEP)
    expected = BATCH * DELAY / (BATCH * DELAY + STEP)
    assert abs(s.stall_fraction - expected) <= 0.05 * expected
    assert _close(s.stall_s, ref_wait, N_BATCHES) and _close(s.step_s, ref_step, N_BATCHES)
    assert "input-bound" in meter.report()


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_workers_stage_times_and_stall(worker_type: str) -> None:
    ds = SleepyDataset(N_BATCHES * BATCH, DELAY)
    meter = StallMeter(trace=False)
    loader = DataLoader(
        ds, batch_size=BATCH, num_workers=2, prefetch_factor=2, worker_type=worker_type, meter=meter
    )
    meter.set_workers(2)
    ref_wait, ref_step = _run(loader, STEP)
    s = meter.stats()
    assert s.batches == N_BATCHES and s.samples == N_BATCHES * BATCH
    fetch = s.stages["fetch"]
    # measured in the workers (shipped back for process workers), summed over workers
    assert fetch.calls == N_BATCHES
    assert _close(fetch.seconds, N_BATCHES * BATCH * DELAY, N_BATCHES)
    assert _close(fetch.effective_s, BATCH * DELAY / 2)
    # the meter's waits and steps agree with our own clock around next()
    assert _close(s.stall_s, ref_wait, N_BATCHES) and _close(s.step_s, ref_step, N_BATCHES)
    assert _close(s.step_mean_s, STEP)


def test_disabled_meter_counts_nothing() -> None:
    ds = SleepyDataset(6, 0.0)
    loader = DataLoader(ds, batch_size=BATCH, meter=StallMeter(enabled=False))
    assert sum(1 for _ in loader) == 3
    assert loader.stats().batches == 0


def test_default_meter_is_on_and_shared_meter_adds_up() -> None:
    a = DataLoader(SleepyDataset(6, 0.0), batch_size=BATCH)
    assert isinstance(a.meter, StallMeter) and a.meter.enabled
    assert sum(1 for _ in a) == 3 and a.stats().batches == 3
    shared = StallMeter(trace=False)
    b = DataLoader(SleepyDataset(6, 0.0), batch_size=BATCH, meter=shared)
    c = DataLoader(SleepyDataset(8, 0.0), batch_size=BATCH, meter=shared)
    for _ in zip(b, c, strict=False):
        with shared.region("forward"):
            pass
    s = shared.stats()
    assert s.batches >= 6 and s.samples >= 12
    assert s.regions["forward"] > 0
