"""StallMeter: counters, histogram quantiles, stages, report/hint, state, sinks, profiler ranges."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import pytest
from _helpers import FakeClock

import feedpipe
from feedpipe.stall import (
    DistributedSink,
    JsonlSink,
    LoggingSink,
    StallMeter,
    StallStats,
    TensorBoardSink,
    gather_stats,
)
from feedpipe.stall import meter as stall_mod


def _loop(meter: StallMeter, clock: FakeClock, waits: list[float], step: float) -> None:
    for w in waits:
        meter.wait_begin()
        clock.advance(w)
        meter.wait_end(samples=8, nbytes=800)
        clock.advance(step)


def test_public_names() -> None:
    assert feedpipe.StallMeter is StallMeter
    assert all(hasattr(stall_mod, name) for name in stall_mod.__all__)


def test_totals_and_fraction_exact(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    _loop(m, clock, [0.010] * 50, step=0.030)
    s = m.stats()
    assert s.batches == 50 and s.samples == 400 and s.bytes == 40_000
    assert s.stall_s == pytest.approx(0.5)
    # the step after the last batch has not ended yet: 49 steps
    assert s.step_s == pytest.approx(49 * 0.030)
    assert s.wall_s == pytest.approx(0.5 + 49 * 0.030)
    assert s.stall_fraction == pytest.approx(0.5 / (0.5 + 1.47))
    assert s.step_mean_s == pytest.approx(0.030)
    assert s.samples_per_s == pytest.approx(400 / s.wall_s)
    assert s.wait_max_s == pytest.approx(0.010)


def test_quantiles_within_bucket_precision(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    waits = [i * 1e-3 for i in range(1, 1001)]  # 1 ms .. 1 s
    _loop(m, clock, waits, step=0.0)
    assert m.quantile(0.5) == pytest.approx(0.500, rel=0.035)
    assert m.quantile(0.99) == pytest.approx(0.990, rel=0.035)
    assert m.quantile(1.0) == pytest.approx(1.0, rel=0.035)
    assert m.quantile(0.0) == pytest.approx(0.001, rel=0.035)
    s = m.stats()
    assert s.wait_p50_s == m.quantile(0.5) and s.wait_p99_s == m.quantile(0.99)
    with pytest.raises(ValueError, match="quantile"):
        m.quantile(1.5)


@pytest.mark.parametrize("w", [3e-9, 1e-6, 7.7e-5, 2.5e-3, 0.333, 42.0, 1e5])
def test_histogram_covers_range(clock: FakeClock, w: float) -> None:
    m = StallMeter(trace=False)
    _loop(m, clock, [w], step=0.0)
    m._fold()
    assert int(m._hist.sum()) == 1
    assert m.quantile(0.5) == pytest.approx(w, rel=0.035)  # huge waits clamp to the max


def test_histogram_memory_is_bounded(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    n = len(m._hist)
    _loop(m, clock, [1e-4 * (1 + i % 97) for i in range(10_000)], step=1e-4)
    assert len(m._waits) < StallMeter._FOLD  # folded as it goes
    m._fold()
    assert len(m._hist) == n and int(m._hist.sum()) == 10_000 and m.batches == 10_000


@pytest.mark.serial  # real sleeps against the meter's clock: a preemption between the two
# readings is counted by one and not the other
def test_accuracy_real_sleeps() -> None:
    """Injected wait 8 ms and step 12 ms per batch (40% stall), timed by the injector itself.

    On a busy machine a sleep overshoots, so the reference is what was really injected (a
    monotonic clock around each sleep); the meter must match it within 5% or 1 ms per batch.
    """
    m = StallMeter(trace=False)
    n, wait, step = 15, 0.008, 0.012
    inj_wait = inj_step = 0.0
    for i in range(n):
        m.wait_begin()
        t0 = time.monotonic()
        time.sleep(wait)
        inj_wait += time.monotonic() - t0
        m.wait_end()
        t1 = time.monotonic()
        time.sleep(step)
        if i < n - 1:  # the step after the last batch has not ended for the meter
            inj_step += time.monotonic() - t1
    s = m.stats()
    assert s.stall_s == pytest.approx(inj_wait, rel=0.05, abs=n * 1e-3)
    assert s.step_s == pytest.approx(inj_step, rel=0.05, abs=n * 1e-3)
    assert s.wait_mean_s == pytest.approx(inj_wait / n, rel=0.05, abs=1e-3)
    assert s.step_mean_s == pytest.approx(inj_step / (n - 1), rel=0.05, abs=1e-3)
    ref = inj_wait / (inj_wait + inj_step)
    assert s.stall_fraction == pytest.approx(ref, rel=0.05)
    # a sleep never undershoots: the measured figures are at least the nominal ones
    assert s.wait_mean_s >= wait and s.step_mean_s >= step


def test_stages_effective_time_and_slowest(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    m.set_workers(4)
    _loop(m, clock, [0.001] * 10, step=0.010)
    for _ in range(10):
        m.add_stage("fetch", 0.004, nbytes=1000)
        m.add_stage("decode", 0.020)
        m.add_stage("pin", 0.003, nbytes=1000)
    s = m.stats()
    assert s.stages["decode"].per_batch_s == pytest.approx(0.020)
    assert s.stages["decode"].effective_s == pytest.approx(0.005)  # 4 workers in parallel
    assert s.stages["pin"].effective_s == pytest.approx(0.003)  # one pin thread
    assert s.stages["fetch"].bytes == 10_000 and s.stages["fetch"].calls == 10
    assert s.slowest_stage == "decode"
    # worker time 10 * 24 ms over 4 workers x wall
    assert s.input_busy == pytest.approx(0.240 / (4 * s.wall_s))
    m.set_workers(8)
    assert m.stats().slowest_stage == "pin"  # decode now 2.5 ms effective


def test_add_stage_is_thread_safe() -> None:
    import threading

    m = StallMeter(trace=False)

    def work() -> None:
        for _ in range(2000):
            m.add_stage("fetch", 0.001, nbytes=2)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert m.stage_calls["fetch"] == 8000 and m.stage_bytes["fetch"] == 16000
    assert m.stage_s["fetch"] == pytest.approx(8.0)


def test_hint_input_bound_names_stage(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    m.set_workers(2)
    _loop(m, clock, [0.020] * 10, step=0.005)
    for _ in range(10):
        m.add_stage("fetch", 0.002)
        m.add_stage("decode", 0.040)
    rep = m.report()
    assert "input-bound" in rep and "decode is the slowest stage" in rep
    assert "GPU decode" in rep and "<- slowest" in rep
    assert "stall 81.6%" in m.summary() and "slowest decode" in m.summary()


def test_hint_compute_bound_says_idle(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    m.set_workers(1)
    _loop(m, clock, [0.0001] * 10, step=0.050)
    for _ in range(10):
        m.add_stage("fetch", 0.010)
    s = m.stats()
    assert s.input_busy == pytest.approx(0.1 / s.wall_s)
    assert "compute-bound: input is idle 78% of the time" in m.report()


def test_hint_without_data() -> None:
    assert "no batches" in StallMeter(trace=False).report()


def test_regions_and_depths(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    for _ in range(3):
        with m.region("forward"):
            clock.advance(0.5)
    with pytest.raises(KeyError), m.region("backward"):
        clock.advance(0.25)
        raise KeyError("boom")
    m.set_depth("ready", 3)
    s = m.stats()
    assert s.regions == {"forward": pytest.approx(1.5), "backward": pytest.approx(0.25)}
    assert s.depths == {"ready": 3}
    assert "forward 1.5 s" in m.report() and "ready=3" in m.report()


def test_disabled_meter_records_nothing(clock: FakeClock) -> None:
    m = StallMeter(enabled=False)
    assert isinstance(m, StallMeter) and not m.enabled
    _loop(m, clock, [0.01] * 5, step=0.01)
    m.add_stage("fetch", 1.0)
    m.set_depth("ready", 2)
    with m.region("x"):
        clock.advance(1)
    s = m.stats()
    assert s.batches == 0 and s.stall_s == 0 and s.stages == {} and s.regions == {}
    assert "no batches" in m.report()
    assert StallMeter().enabled


def test_snapshot_is_json_and_round_trips(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    _loop(m, clock, [0.002, 0.004], step=0.01)
    m.add_stage("decode", 0.5, 10)
    s = m.stats()
    d = json.loads(json.dumps(s.to_dict()))
    assert StallStats.from_dict(d) == s


def test_reset_and_state_dict(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    _loop(m, clock, [0.001 * (i + 1) for i in range(20)], step=0.01)
    m.add_stage("fetch", 0.3, 7)
    with m.region("fwd"):
        clock.advance(0.1)
    state = json.loads(json.dumps(m.state_dict()))
    other = StallMeter(trace=False)
    other.load_state_dict(state)
    a, b = m.stats(), other.stats()
    assert a == b
    m.reset()
    assert m.stats().batches == 0 and m.stats().wall_s == 0 and m.quantile(0.5) == 0.0
    # after a reset the first wait does not count the time since the old last batch as step
    clock.advance(100)
    _loop(m, clock, [0.001], step=0.0)
    assert m.stats().step_s == 0.0


def test_shared_by_two_loaders_interleaved(clock: FakeClock) -> None:
    """zip(loader_a, loader_b): both waits count as stall, everything between them as step."""
    m = StallMeter(trace=False)
    for _ in range(10):
        for w in (0.002, 0.003):
            m.wait_begin()
            clock.advance(w)
            m.wait_end(samples=4)
        clock.advance(0.010)
    s = m.stats()
    assert s.batches == 20 and s.samples == 80
    assert s.stall_s == pytest.approx(0.05)
    assert s.step_s == pytest.approx(9 * 0.010)


# ---------------------------------------------------------------------------- sinks
def test_logging_sink_every_steps(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    m = StallMeter(trace=False)
    m.add_sink(LoggingSink("feedpipe.test", every_s=None, every_steps=10))
    with caplog.at_level(logging.INFO, logger="feedpipe.test"):
        _loop(m, clock, [0.001] * 35, step=0.001)
    lines = [r.getMessage() for r in caplog.records if r.name == "feedpipe.test"]
    assert len(lines) == 3
    assert lines[0].startswith("feedpipe: stall ") and "10 batches" in lines[0]
    assert "30 batches" in lines[2]


def test_logging_sink_every_seconds(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    m = StallMeter(trace=False)
    sink = m.add_sink(LoggingSink("feedpipe.test2", every_s=1.0, report=True))
    with caplog.at_level(logging.INFO, logger="feedpipe.test2"):
        _loop(m, clock, [0.05] * 50, step=0.05)  # 5 s
    assert sink.emitted in (4, 5)
    assert "hint:" in caplog.records[0].getMessage()


def test_sink_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="every_s or every_steps"):
        LoggingSink(every_s=None, every_steps=None)
    with pytest.raises(ValueError, match="every_steps must be >= 1"):
        JsonlSink("x.jsonl", every_s=None, every_steps=0)
    with pytest.raises(ValueError, match="every_s must be > 0"):
        LoggingSink(every_s=-1)


def test_jsonl_sink(tmp_path: Any, clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    path = tmp_path / "logs" / "stall.jsonl"
    m.add_sink(JsonlSink(path, every_s=None, every_steps=4))
    _loop(m, clock, [0.003] * 10, step=0.007)
    m.add_stage("decode", 0.01)
    m.close()  # final record for batches 9..10
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["batches"] for r in rows] == [4, 8, 10]
    assert rows[-1]["stall_fraction"] == pytest.approx(0.03 / (0.03 + 0.063))
    assert rows[-1]["stages"]["decode"]["seconds"] == pytest.approx(0.01)
    assert all(isinstance(r["time"], float) for r in rows)


class _RecordingWriter:
    """Duck-typed SummaryWriter that keeps the scalars it receives."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.flushed = 0

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.append((tag, value, global_step))

    def flush(self) -> None:
        self.flushed += 1


def test_tensorboard_sink_scalars(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    w = _RecordingWriter()
    m.add_sink(TensorBoardSink(w, every_steps=5))
    m.set_depth("ready", 2)
    m.add_stage("fetch", 0.002)
    _loop(m, clock, [0.004] * 10, step=0.004)
    m.close()
    tags = {t for t, _, _ in w.scalars}
    assert {"feedpipe/stall_fraction", "feedpipe/wait_p99_ms", "feedpipe/samples_per_s"} <= tags
    assert {"feedpipe/stage/fetch_ms", "feedpipe/depth/ready"} <= tags
    steps = sorted({s for _, _, s in w.scalars})
    assert steps == [5, 10] and w.flushed == 1
    frac = [v for t, v, s in w.scalars if t == "feedpipe/stall_fraction" and s == 10]
    assert frac == [pytest.approx(0.04 / 0.076)]


def test_tensorboard_sink_real_writer(tmp_path: Any, clock: FakeClock) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is optional and not installed")
    m = StallMeter(trace=False)
    m.add_sink(TensorBoardSink(tmp_path / "tb", every_steps=5))
    _loop(m, clock, [0.004] * 10, step=0.004)
    m.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_gather_without_process_group_is_clear() -> None:
    m = StallMeter(trace=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        m.gather()
    with pytest.raises(RuntimeError, match="init_process_group"):
        gather_stats(m.stats())


def test_distributed_sink_is_step_based_only() -> None:
    sink = DistributedSink(every_steps=3)
    assert sink.every_s is None and sink.every_steps == 3


# ---------------------------------------------------------------------------- profiler
def _profiled_names(meter: StallMeter) -> set[str]:
    import torch.profiler

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            meter.wait_begin()
            meter.wait_end()
        with meter.region("forward"):
            pass
    return {e.name for e in prof.events()}


def test_profiler_ranges_auto() -> None:
    m = StallMeter()  # trace="auto": ranges only while a profiler records
    names = _profiled_names(m)
    assert "feedpipe.wait" in names and "feedpipe.region.forward" in names
    assert m._range is None
    m.wait_begin()
    assert m._range is None  # no profiler: nothing opened
    m.wait_end()


def test_profiler_ranges_off() -> None:
    names = _profiled_names(StallMeter(trace=False))
    assert not any(n.startswith("feedpipe.") for n in names)


def test_profiler_ranges_forced_on() -> None:
    m = StallMeter(trace=True)
    m.wait_begin()
    assert m._range is not None
    m.wait_end()
    assert m._range is None and math.isfinite(m.stall_s)


def test_record_batch_equals_the_split_calls(clock: FakeClock) -> None:
    """One ``record_batch`` per batch gives the same snapshot as wait_begin/wait_end/add_stage."""
    split, one = StallMeter(trace=False), StallMeter(trace=False)
    waits = [1e-4 * (1 + i % 13) for i in range(StallMeter._FOLD + 500)]  # crosses a fold
    for i, w in enumerate(waits):
        fetch, collate = w / 2, (w / 4 if i % 3 else -1.0)  # collate absent every third batch
        begin = clock()
        split.wait_begin()
        clock.advance(w)
        split.add_stage("fetch", fetch, 64)
        if collate >= 0:
            split.add_stage("collate", collate, 64)
        split.wait_end(samples=2, nbytes=64)
        one.record_batch(begin, clock(), 2, 64, fetch, collate)
        assert one.last_wait == split.last_wait == (begin, clock())
        clock.advance(3e-4)
    for m in (split, one):
        m.wait_pending(clock())  # the epoch ended: the last step counts
    a, b = split.stats(), one.stats()
    assert a.batches == b.batches == len(waits) and a.samples == b.samples == 2 * len(waits)
    assert b.stages["collate"].calls == sum(1 for i in range(len(waits)) if i % 3)
    assert b.stages["fetch"].bytes == 64 * len(waits)
    for field in ("stall_s", "step_s", "wait_p50_s", "wait_p99_s", "wait_max_s", "step_mean_s"):
        assert math.isclose(getattr(a, field), getattr(b, field), rel_tol=1e-9), field
    for name in ("fetch", "collate"):
        assert math.isclose(a.stages[name].seconds, b.stages[name].seconds, rel_tol=1e-9)
        assert a.stages[name].calls == b.stages[name].calls
    assert math.isclose(b.step_s, 3e-4 * len(waits), rel_tol=1e-9)
    assert one.steps == split.steps == len(waits)


def test_wait_end_without_begin_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="without a matching wait_begin"):
        StallMeter(trace=False).wait_end()


def test_tracing_flag() -> None:
    assert StallMeter(trace=True).tracing and not StallMeter(trace=False).tracing
    assert not StallMeter().tracing  # auto: no profiler is recording
