"""Stall counters inside ``feedpipe.DataLoader``: in-process, thread and process workers.

A synthetic dataset sleeps a known time per sample and the loop sleeps a known step. The
injector times each sleep itself (a monotonic clock, written to a file per process, so process
workers report too): on a busy machine sleeps overshoot, and the reference is what was really
injected. The meter's stage times, waits and steps must match within 5% or 1 ms per batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import RngFreeItems as _Items

from feedpipe.stall import StallMeter, StallStats

loader_mod = pytest.importorskip(
    "feedpipe.loader.dataloader", reason="feedpipe.DataLoader has not landed"
)
DataLoader = loader_mod.DataLoader

DELAY = 0.015  # per sample: 30 ms batches, so 5% is well above scheduling noise
BATCH = 2
STEP = 0.020
N_BATCHES = 8


class SleepyDataset(torch.utils.data.Dataset[torch.Tensor]):
    """Each read sleeps ``delay`` and appends the time the read really took to ``log_dir/<pid>``."""

    def __init__(self, n: int, delay: float, log_dir: Path | None = None) -> None:
        self.n, self.delay, self.log_dir = n, delay, log_dir
        self._log: Any = None  # opened once per process

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_log": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        t0 = time.monotonic()
        time.sleep(self.delay)
        item = torch.full((4,), i, dtype=torch.int64)
        slept = time.monotonic() - t0
        if self.log_dir is not None:
            if self._log is None or self._log[0] != os.getpid():
                path = self.log_dir / f"{os.getpid()}.log"
                self._log = (os.getpid(), open(path, "a", buffering=1))  # noqa: SIM115
            self._log[1].write(f"{slept!r}\n")
        return item


def _injected(log_dir: Path) -> list[float]:
    return [float(x) for p in log_dir.iterdir() for x in p.read_text().split()]


def _close(actual: float, expected: float, n: int = 1) -> bool:
    """Within 5% or 1 ms per batch."""
    return abs(actual - expected) <= max(0.05 * expected, 1e-3 * n)


def _run(loader: Any, step: float) -> tuple[float, float]:
    """Iterate once sleeping ``step`` per batch; return the waits and steps our own clock saw."""
    waits = steps = 0.0
    last = None
    it = iter(loader)
    while True:
        t0 = time.monotonic()
        if last is not None:
            steps += t0 - last
        try:
            batch = next(it)
        except StopIteration:  # the loop was blocked in next() (workers shutting down): a wait
            waits += time.monotonic() - t0
            break
        t1 = time.monotonic()
        waits += t1 - t0
        assert batch.shape == (BATCH, 4)
        last = t1
        time.sleep(step)
    return waits, steps


def test_in_process_matches_injected_delays(tmp_path: Path) -> None:
    ds = SleepyDataset(N_BATCHES * BATCH, DELAY, tmp_path)
    meter = StallMeter(trace=False)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0, meter=meter)
    assert loader.meter is meter
    ref_wait, ref_step = _run(loader, STEP)
    s = loader.stats
    assert isinstance(s, StallStats)
    assert s.batches == N_BATCHES and s.samples == N_BATCHES * BATCH
    assert s.bytes == N_BATCHES * BATCH * 4 * 8
    slept = _injected(tmp_path)
    assert len(slept) == N_BATCHES * BATCH and min(slept) >= DELAY
    per_batch = sum(slept) / N_BATCHES
    # fetch is the injected read time; in-process loading makes fetch + collate the wait
    fetch = s.stages["fetch"].per_batch_s
    assert _close(fetch, per_batch)
    collate = s.stages["collate"].per_batch_s if "collate" in s.stages else 0.0
    assert _close(s.wait_mean_s, fetch + collate)
    # waits and steps agree with our own clock around next(); the fraction follows
    assert _close(s.stall_s, ref_wait, N_BATCHES) and _close(s.step_s, ref_step, N_BATCHES)
    ref = ref_wait / (ref_wait + ref_step)
    assert abs(s.stall_fraction - ref) <= 0.05 * ref
    assert s.step_mean_s >= STEP
    assert "input-bound" in meter.report()


@pytest.mark.parametrize("worker_type", ["thread", "process"])
@pytest.mark.serial
def test_workers_stage_times_and_stall(worker_type: str, tmp_path: Path) -> None:
    ds = SleepyDataset(N_BATCHES * BATCH, DELAY, tmp_path)
    meter = StallMeter(trace=False)
    loader = DataLoader(
        ds, batch_size=BATCH, num_workers=2, prefetch_factor=2, worker_type=worker_type, meter=meter
    )
    meter.set_workers(2)
    ref_wait, ref_step = _run(loader, STEP)
    s = meter.stats()
    assert s.batches == N_BATCHES and s.samples == N_BATCHES * BATCH
    slept = _injected(tmp_path)
    assert len(slept) == N_BATCHES * BATCH
    fetch = s.stages["fetch"]
    # measured in the workers (shipped back for process workers), summed over workers
    assert fetch.calls == N_BATCHES
    assert _close(fetch.seconds, sum(slept), N_BATCHES)
    assert _close(fetch.effective_s, sum(slept) / N_BATCHES / 2)
    # the meter's waits and steps agree with our own clock around next()
    assert _close(s.stall_s, ref_wait, N_BATCHES) and _close(s.step_s, ref_step, N_BATCHES)
    assert s.step_mean_s >= STEP


def test_disabled_meter_counts_nothing() -> None:
    ds = SleepyDataset(6, 0.0)
    loader = DataLoader(ds, batch_size=BATCH, meter=StallMeter(enabled=False))
    assert sum(1 for _ in loader) == 3
    assert loader.stats.batches == 0


def test_default_meter_is_on_and_shared_meter_adds_up() -> None:
    a = DataLoader(SleepyDataset(6, 0.0), batch_size=BATCH)
    assert isinstance(a.meter, StallMeter) and a.meter.enabled
    assert sum(1 for _ in a) == 3 and a.stats.batches == 3
    shared = StallMeter(trace=False)
    b = DataLoader(SleepyDataset(6, 0.0), batch_size=BATCH, meter=shared)
    c = DataLoader(SleepyDataset(8, 0.0), batch_size=BATCH, meter=shared)
    for _ in zip(b, c, strict=False):
        with shared.region("forward"):
            pass
    s = shared.stats()
    assert s.batches >= 6 and s.samples >= 12
    assert s.regions["forward"] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_counters_off_read_no_clock(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``StallMeter(enabled=False)``: the loader and its fetch path read no clock at all."""
    import feedpipe.loader.fetch as fetch_mod

    def no_clock() -> float:
        raise AssertionError("a clock was read with the counters off")

    monkeypatch.setattr(loader_mod, "_perf", no_clock)
    monkeypatch.setattr(fetch_mod, "_perf", no_clock)
    kw: dict[str, Any] = {"num_workers": workers, "worker_type": "thread"} if workers else {}
    loader = DataLoader(
        SleepyDataset(6, 0.0), batch_size=BATCH, meter=StallMeter(enabled=False), **kw
    )
    assert [b[:, 0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert loader.stats.batches == 0
    on = DataLoader(SleepyDataset(6, 0.0), batch_size=BATCH, **kw)
    with pytest.raises(AssertionError, match="a clock was read"):
        next(iter(on))


def test_one_record_per_batch_and_pending_wait_at_the_end() -> None:
    """The loader records each batch once; StopIteration leaves the last step counted."""
    meter = StallMeter(trace=False)
    loader = DataLoader(SleepyDataset(8, 0.0), batch_size=BATCH, meter=meter)
    n = 0
    for _ in loader:
        n += 1
        time.sleep(0.005)
    s = loader.stats
    assert s.batches == n == 4 and meter.steps == 4  # the step after the last batch counts
    assert s.step_s >= 4 * 0.005 and s.stages["fetch"].calls == 4


def test_sinks_are_polled_from_the_loader(caplog: pytest.LogCaptureFixture) -> None:
    """The loader's per-batch record polls attached sinks, as wait_end does."""
    import logging

    from feedpipe.stall import LoggingSink

    meter = StallMeter(trace=False)
    meter.add_sink(LoggingSink(every_steps=2))
    loader = DataLoader(SleepyDataset(8, 0.0), batch_size=BATCH, meter=meter)
    with caplog.at_level(logging.INFO, logger="feedpipe"):
        assert sum(1 for _ in loader) == 4
    assert len([r for r in caplog.records if "stall" in r.getMessage()]) == 2
    assert meter.stats().batches == 4


@pytest.mark.timeout(60)
@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_first_pass_wait_for_the_checked_batches_is_stall() -> None:
    """The RNG check waits for each worker's first batch inside the first ``next()`` (counted as
    stall), never inside ``iter()`` (before the first pass's clock starts)."""
    loader = DataLoader(_Items(0.15), batch_size=2, num_workers=2, worker_type="thread")
    t0 = time.perf_counter()
    it = iter(loader)
    assert time.perf_counter() - t0 < 0.1
    assert len(list(it)) == 8
    assert loader.stats.stall_s >= 0.25  # worker 1's first batch: two 0.15 s items
