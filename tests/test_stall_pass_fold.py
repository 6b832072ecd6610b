"""A pass boundary hands the stall meter's clock the pass's records without folding the totals
(issue 28: the fold cost ~165 us a pass); the totals fold when read, or every 4096 batches.

Every figure must equal that of a meter folded after every call (the fold at every pass
boundary of before): the same script of passes, waits, breaks and gaps is run on both.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _helpers import FakeClock

from feedpipe.stall import StallMeter

Step = Callable[[StallMeter], None]


@pytest.fixture
def fast_switch() -> Iterator[None]:
    """Switch threads every 1 us, so that a reader's folds land between any two calls."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield None
    sys.setswitchinterval(old)


def _script(clock: FakeClock, seed: int, passes: int) -> list[Callable[[], Step]]:
    """A random run of passes: each entry, called once, advances the fake clock and returns the
    meter call to make at that instant (run on every meter at the same clock reading)."""
    rng = random.Random(seed)
    out: list[Callable[[], Step]] = []

    def at(dt: float, step: Step) -> None:
        def go() -> Step:
            clock.advance(dt)
            return step

        out.append(go)

    def record(dt: float, w: float, s: int, c: float) -> None:
        def go() -> Step:
            clock.advance(dt)
            begin = clock.t
            clock.advance(w)
            end = clock.t
            return lambda m: m.record_batch(begin, end, s, 100 * s, w / 3, c)

        out.append(go)

    for p in range(passes):
        at(rng.choice([0.0, 1e-4, 0.02]), lambda m: m.pass_begin())
        nested = rng.random() < 0.1  # a second loader's pass inside this one (validation)
        if nested:
            at(1e-3, lambda m: m.pass_begin())
        for _ in range(rng.choice([0, 1, 2, 5, 32])):
            record(rng.random() * 1e-3, rng.choice([0.0, 1e-6, rng.random() * 1e-2]),
                   rng.randrange(1, 9), rng.random() * 1e-4 if p % 3 else -1.0)  # fmt: skip
        if nested:
            at(1e-4, lambda m: m.pass_end())
        if rng.random() < 0.6:  # StopIteration: a wait that delivered no batch
            pending = 1e-5 * rng.randrange(1, 9)

            def go(pending: float = pending) -> Step:
                begin = clock.t
                clock.advance(pending)

                def stop(m: StallMeter) -> None:
                    m.wait_pending(begin)
                    m.pass_end()

                return stop

            out.append(go)
        else:  # break
            at(rng.random() * 1e-3, lambda m: m.pass_end())
        if rng.random() < 0.1:  # a wait outside any pass (wait_begin/wait_end callers)
            at(5e-3, lambda m: m.wait_begin())
            at(1e-3, lambda m: m.wait_end(2, 10))
    return out


def _figures(m: StallMeter) -> dict[str, Any]:
    return dataclasses.asdict(m.stats()) | {"hist": [int(x) for x in m._hist]}


def _assert_same(lazy: dict[str, Any], eager: dict[str, Any]) -> None:
    assert lazy.keys() == eager.keys()
    for key, a in lazy.items():
        b = eager[key]
        if key == "stages":
            assert a.keys() == b.keys()
            for name in a:
                assert a[name]["calls"] == b[name]["calls"] and a[name]["bytes"] == b[name]["bytes"]
                assert math.isclose(a[name]["seconds"], b[name]["seconds"], rel_tol=1e-12)
        elif isinstance(a, float) and isinstance(b, float):  # sums: another block order
            assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), key
        else:
            assert a == b, key


@pytest.mark.parametrize("seed", range(6))
def test_many_short_passes_read_as_if_folded_at_every_boundary(clock: FakeClock, seed: int) -> None:
    lazy, eager = StallMeter(trace=False), StallMeter(trace=False)
    for i, go in enumerate(_script(clock, seed, passes=60)):
        step = go()
        step(lazy)
        step(eager)
        eager._fold()  # the reference: every record folded at once
        if i % 97 == 96:  # a read in between folds the lazy meter's totals too
            _assert_same(_figures(lazy), _figures(eager))
    assert lazy.stats().batches > 100
    _assert_same(_figures(lazy), _figures(eager))
    assert lazy.outside_s == eager.outside_s and lazy.steps == eager.steps  # clock: exact
    assert lazy.last_wait == eager.last_wait
    assert lazy.state_dict().keys() == eager.state_dict().keys()


def test_a_pass_end_leaves_the_records_for_the_next_read(clock: FakeClock) -> None:
    """What makes a pass cheap: its end does not fold; a read (or 4096 batches) does."""
    m = StallMeter(trace=False)
    for _ in range(3):
        m.pass_begin()
        for _ in range(4):
            t = clock.t
            clock.advance(1e-3)
            m.record_batch(t, clock.t, 2, 20)
        m.pass_end()
    assert len(m._waits) == 3 * 4 * 6  # unfolded: every record is still in the log
    assert m.batches == 12 and m.last_wait[1] == clock.t
    assert m.wait_max_s == pytest.approx(1e-3)  # a reading folds
    assert len(m._waits) == 0 and m.samples == 24


def test_many_passes_keep_the_log_bounded(clock: FakeClock) -> None:
    m = StallMeter(trace=False)
    for _ in range(2 * StallMeter._FOLD // 32 + 3):
        m.pass_begin()
        for _ in range(32):
            t = clock.t
            clock.advance(1e-5)
            m.record_batch(t, clock.t, 1, 1)
            clock.advance(1e-5)
        m.pass_end()
        assert len(m._waits) < StallMeter._FOLD
    assert m.stats().batches == (2 * StallMeter._FOLD // 32 + 3) * 32


def test_a_reader_folding_from_another_thread_changes_no_figure(
    clock: FakeClock, fast_switch: None
) -> None:
    """A thread polling ``stats()`` folds at any point between the loop's calls (the fake
    clock is advanced only by the loop's thread): the figures are those of the eager fold."""
    script = _script(clock, seed=11, passes=150)
    start = clock.t
    lazy, eager = StallMeter(trace=False), StallMeter(trace=False)
    stop, reads = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            reads.append(lazy.stats().batches)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        _replay(clock, start, script, lazy)
    finally:
        stop.set()
        reader.join(timeout=60)
    assert not reader.is_alive() and reads == sorted(reads)
    _replay(clock, start, script, eager, fold=True)
    _assert_same(_figures(lazy), _figures(eager))
    assert lazy.outside_s == eager.outside_s and lazy.steps == eager.steps


def _replay(
    clock: FakeClock, start: float, script: list[Callable[[], Step]], m: StallMeter, *,
    fold: bool = False,
) -> None:  # fmt: skip
    """Run ``script`` on ``m`` from the clock reading ``start``: the same instants each time."""
    clock.t = start
    for go in script:
        go()(m)
        if fold:
            m._fold()
