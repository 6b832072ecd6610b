"""Issue 18 section 5: the stall counters cost almost nothing and stay exact.

The hot path packs one 48-byte record per batch (``feedpipe.stall.records``); these tests pin
what that must not cost (memory per pending batch, counts lost between threads) and that the
vectorised fold gives the same totals as adding the records up one by one.
"""

from __future__ import annotations

import math
import random
import struct
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from feedpipe import DataLoader
from feedpipe.stall import StallMeter
from feedpipe.stall.records import NBUCKETS, bucket_value

STALL = Path(__file__).resolve().parent.parent / "feedpipe" / "stall"


@pytest.fixture
def fast_switch() -> object:
    """Switch threads every 1 µs, so that records and folds interleave as much as they can."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield None
    sys.setswitchinterval(old)


def test_a_pending_batch_holds_one_packed_record() -> None:
    """Between folds a batch costs its 48-byte record, not six Python objects (~150 bytes)."""
    m = StallMeter(trace=False)
    n = 3000  # below one fold (4096 batches)
    t = 1000.0
    m.record_batch(t, t + 1e-6, 3, 1000, 1e-7, 2e-7)  # the log's first allocation
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            b = t + i * 1e-3 + 0.5  # fresh floats, as perf_counter returns
            m.record_batch(b, b + 1e-5 * (i % 7), 3, 1000 + i, 1e-7 * i, 2e-7 * i)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert m.batches == n + 1
    assert held / n <= 56, f"{held / n:.0f} bytes per pending batch"


def test_fold_equals_adding_up_the_records() -> None:
    """Totals, maximum, histogram and stage sums after folds equal a one-by-one reference."""
    rng = random.Random(7)
    m = StallMeter(trace=False)
    t, ref_hist = 5.0, [0] * NBUCKETS
    stall = wmax = fetch_s = collate_s = 0.0
    samples = nbytes = fetch_calls = collate_calls = collate_bytes = 0
    for i in range(10_000):  # two folds and a remainder
        w = rng.choice([0.0, 3e-9, 1e-6, 2.5e-4, 0.01, 0.3, 7.0])
        s, nb = rng.randrange(1, 65), rng.randrange(0, 2**40)
        f = rng.random() * 1e-3
        c = rng.random() * 1e-3 if i % 5 else -1.0
        m.record_batch(t, t + w, s, nb, f, c)
        w, t = (t + w) - t, t + w + 1e-3  # the wait as the meter sees it: end - begin
        stall += w
        wmax = max(wmax, w)
        samples += s
        nbytes += nb
        fetch_s += f
        fetch_calls += 1
        if c >= 0:
            collate_s += c
            collate_calls += 1
            collate_bytes += nb
        if w > 0:
            mant, e = math.frexp(w)
            ref_hist[min(NBUCKETS - 1, max(0, (e << 4) + int(mant * 32) + 464))] += 1
        else:
            ref_hist[0] += 1
    st = m.stats()
    assert st.batches == 10_000 and st.samples == samples and st.bytes == nbytes
    assert math.isclose(st.stall_s, stall, rel_tol=1e-12) and st.wait_max_s == wmax
    assert [int(x) for x in m._hist] == ref_hist
    assert st.stages["fetch"].calls == fetch_calls and st.stages["fetch"].bytes == nbytes
    assert math.isclose(st.stages["fetch"].seconds, fetch_s, rel_tol=1e-12)
    assert st.stages["collate"].calls == collate_calls
    assert st.stages["collate"].bytes == collate_bytes
    assert math.isclose(st.stages["collate"].seconds, collate_s, rel_tol=1e-12)
    assert bucket_value(1) > 0


def test_records_from_many_threads_while_others_fold_lose_nothing(fast_switch: object) -> None:
    """Threads record batches and stages while another thread reads (folds) all the time."""
    m = StallMeter(trace=False)
    per, writers = 6000, 4
    stop = threading.Event()
    seen: list[int] = []

    def write(k: int) -> None:
        t = 1.0 + k
        for i in range(per):
            m.record_batch(t, t + 1e-6, 2, 100 + k, 1e-6, -1.0 if i % 2 else 1e-6)
            m.add_stage("h2d", 1e-6, 7)
            t += 1e-5

    def read() -> None:
        while not stop.is_set():
            seen.append(m.stats().batches)

    reader = threading.Thread(target=read)
    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    reader.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    stop.set()
    reader.join(timeout=60)
    st = m.stats()
    n = per * writers
    assert st.batches == n and st.samples == 2 * n
    assert st.bytes == sum(per * (100 + k) for k in range(writers))
    assert st.stages["fetch"].calls == n
    assert st.stages["collate"].calls == n // 2
    assert st.stages["h2d"].calls == n and st.stages["h2d"].bytes == 7 * n
    assert int(m._hist.sum()) == n
    assert seen == sorted(seen) and len(seen) > 1  # reads during the run saw a growing count


def test_loader_counts_are_exact_while_another_thread_reads(fast_switch: object) -> None:
    """Thread workers and a reader thread polling ``stats()`` lose no batch, sample or byte."""
    data = torch.arange(4000, dtype=torch.int64).view(-1, 1)
    loader = DataLoader(list(data), batch_size=3, num_workers=2, worker_type="thread")
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            loader.meter.stats()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        got = sum(len(b) for b in loader)
    finally:
        stop.set()
        reader.join(timeout=60)
    st = loader.meter.stats()
    assert got == st.samples == 4000
    assert st.batches == math.ceil(4000 / 3) == st.stages["fetch"].calls
    assert st.bytes == 4000 * 8 == st.stages["fetch"].bytes


def test_record_values_from_numpy_and_torch_ints() -> None:
    """Counts given as numpy or 0-d torch integers are counted exactly (the record packs them)."""
    m = StallMeter(trace=False)
    m.record_batch(1.0, 2.0, np.int64(5), torch.tensor(2**40 + 3), 0.5, -1.0)
    st = m.stats()
    assert st.samples == 5 and st.bytes == 2**40 + 3 and st.stages["fetch"].bytes == 2**40 + 3
    assert "collate" not in st.stages


def test_bad_record_fails_at_once() -> None:
    """A record that is not numbers fails in the call that made it, not in a later report."""
    m = StallMeter(trace=False)
    with pytest.raises(struct.error):
        m.record_batch(1.0, 2.0, "3", 4)  # type: ignore[arg-type]
    assert m.batches == 0 and m.stats().batches == 0


def test_stall_modules_stay_small() -> None:
    """One concept per module: every stall module is below 800 lines."""
    for path in sorted(STALL.glob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines < 800, f"{path.name}: {lines} lines"


# ------------------------------------------------------------------ issue 28 section 5
def test_a_mid_clock_record_folds_to_the_stage_times_python_would_compute() -> None:
    """A record with the raw clock between read and collate (``MID``) folds to the same stage
    seconds, calls and bytes, to the bit, as one with the times subtracted in Python; mixed in
    one fold with records of stage times and with ``read_batch`` records (no collate)."""
    from feedpipe.stall.records import MID

    rng = random.Random(11)
    raw, done = StallMeter(trace=False), StallMeter(trace=False)
    t = 20_000.0  # a perf_counter-sized clock: the subtraction rounds as in the loader
    for i in range(StallMeter._FOLD // 6 + 900):  # crosses a fold
        wait, cut = rng.random() * 1e-3, rng.random()
        mid, end, nb = t + wait * cut, t + wait, rng.randrange(0, 2**33)
        kind = i % 3
        if kind == 0:  # shared clock, read then collate
            raw.record_batch(t, end, 2, nb, mid, MID)
            done.record_batch(t, end, 2, nb, mid - t, end - mid)
        elif kind == 1:  # shared clock, read_batch: no collate stage
            raw.record_batch(t, end, 2, nb, -1.0, MID)
            done.record_batch(t, end, 2, nb, end - t, -1.0)
        else:  # a source that timed its own stages
            raw.record_batch(t, end, 2, nb, wait / 3, wait / 5)
            done.record_batch(t, end, 2, nb, wait / 3, wait / 5)
        t = end + 1e-4
    a, b = raw.stats(), done.stats()
    assert a.stages.keys() == b.stages.keys() == {"fetch", "collate"}
    for name in ("fetch", "collate"):
        assert a.stages[name].seconds == b.stages[name].seconds, name
        assert a.stages[name].calls == b.stages[name].calls, name
        assert a.stages[name].bytes == b.stages[name].bytes, name
    assert (a.batches, a.bytes, a.stall_s, a.step_s) == (b.batches, b.bytes, b.stall_s, b.step_s)
    assert a.stages["collate"].calls == len(range(0, a.batches, 3)) + len(range(2, a.batches, 3))


def test_the_per_batch_profiler_flag_is_the_meters_flag_at_every_moment() -> None:
    """The loader asks ``flags[key]`` per batch instead of calling the meter's check: for each
    trace mode it equals the check, before, during and after a real torch profiler."""
    import torch.profiler

    from feedpipe.stall.profiler import flag_of

    meters = [StallMeter(), StallMeter(trace=True), StallMeter(trace=False)]
    calls: list[int] = []

    def counted() -> bool:
        calls.append(1)
        return True

    flags = [flag_of(m.profiler_check) for m in meters]
    asked, key = flag_of(counted)

    def agree() -> list[bool]:
        seen = [bool(f[k]) for f, k in flags]
        assert seen == [bool(m.profiler_check()) for m in meters]
        return seen

    assert agree() == [False, True, False]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert agree() == [True, True, False]
    assert agree() == [False, True, False]
    assert asked[key] is True and len(calls) == 1  # any other check is called, each time


def test_a_profiler_started_mid_pass_makes_the_wait_after_next_a_range() -> None:
    """The documented promise of ``Timing``: the flag is read at the end of each record, so a
    profiler started during a step sees the wait after next as a "feedpipe.wait" range, and
    the traced wait is counted like any other (same batch, stage times from the mid clock)."""
    import torch.profiler

    from feedpipe.loader.pipeline import Timing

    meter = StallMeter()  # trace="auto"
    timing = Timing(meter, shared=True)
    t0 = timing.begin()
    timing.record(("a", 1, 8, t0 + 1e-4, -1.0), t0, t0 + 3e-4)  # no profiler: untraced
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = timing.begin()  # armed before the profiler started: untraced
        assert not timing.traced
        timing.record(("b", 1, 8, t0 + 1e-4, -1.0), t0, t0 + 3e-4)
        t0 = timing.begin()  # the wait after next: a range
        assert timing.traced and meter.range_open
        assert timing.record(("c", 2, 8, -1.0, -1.0), t0, timing.now()) == ("c", 2)
        assert not timing.traced and not meter.range_open
    names = [e.name for e in prof.events()]
    assert names.count("feedpipe.wait") == 1
    st = meter.stats()
    assert (st.batches, st.samples, st.bytes) == (3, 4, 24)
    assert st.stages["fetch"].calls == 3 and st.stages["collate"].calls == 2
