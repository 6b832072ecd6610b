"""Attack on the meter's fork-safe lock: a child forked while another thread of the parent held
the stall meter's counters lock (inside a fold, ``stats()``, ``reset()``, ``state_dict()``)
iterates a loader (process workers forked from it in turn), reads ``loader.stats``, resets the
meter, saves and loads the loader's state and polls a sink, without hanging (a hang is a
failure: the harness kills the child after a timeout)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fork_probe import fork_during, fork_while_held

import feedpipe
from feedpipe.stall.sinks import Sink

N = 64


class _Count(Sink):
    def __init__(self) -> None:
        super().__init__(every_steps=1)
        self.seen = 0

    def write(self, stats: Any) -> None:
        self.seen += 1


@pytest.fixture
def loader(tmp_path: Path) -> Any:
    with feedpipe.MemmapWriter(tmp_path / "ds", shape=(4,), dtype="int32") as w:
        w.append_batch(np.arange(N * 4, dtype=np.int32).reshape(N, 4))
    ds = feedpipe.MemmapDataset(tmp_path / "ds")
    made = feedpipe.DataLoader(ds, batch_size=8, num_workers=0)
    assert sum(len(b) for b in made) == N  # the meter has counted a pass
    yield made
    ds.close()


def _process_workers(loader: Any) -> object:
    loader.num_workers = 2
    loader.multiprocessing_context = "fork"
    return sum(len(b) for b in loader), loader.stats.batches > 0


def _reset_then_pass(loader: Any) -> object:
    loader.meter.reset()
    return sum(len(b) for b in loader), loader.stats.batches


def _state_round_trip(loader: Any) -> object:
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    return sum(len(b) for b in loader)


def _sink_polled(loader: Any) -> object:
    sink = loader.meter.add_sink(_Count())
    return sum(len(b) for b in loader), sink.seen >= N // 8


CHILD: dict[str, tuple[Callable[[Any], object], object]] = {
    "process-workers": (_process_workers, (N, True)),
    "reset": (_reset_then_pass, (N, N // 8)),
    "state-dict": (_state_round_trip, N - 8),
    "sink-poll": (_sink_polled, (N, True)),
}


@pytest.mark.parametrize("what", list(CHILD))
def test_a_child_forked_while_the_meter_lock_was_held_goes_on(loader: Any, what: str) -> None:
    lock = loader.meter._counters.lock
    target, want = CHILD[what]
    got = fork_while_held(lambda: lock, lambda: target(loader), 30)
    assert got == ("ok", want), f"the child's {what}: {got}"
    assert loader.stats.batches >= N // 8  # the parent's meter was left working


def _inside(loader: Any, call: Callable[[], object]) -> Callable[[Callable[[], None]], object]:
    """A ``hold`` for ``fork_during``: ``call()`` (``meter.reset()``, ``load_state_dict``) in
    the other thread, paused inside it where the meter's lock is held (its device counters
    are reset under the lock)."""
    device, parent = loader.meter._counters.device, os.getpid()

    def hold(pause: Callable[[], None]) -> object:
        reset = device.reset

        def paused(offset: tuple[float, int] = (0.0, 0)) -> None:
            assert loader.meter._counters.lock._is_owned(), "not under the meter's lock"
            reset(offset)
            if os.getpid() == parent:  # the child's copy of the patch goes straight on
                pause()

        device.reset = paused
        try:
            return call()
        finally:
            device.reset = reset

    return hold


@pytest.mark.parametrize("inside", ["reset", "load_state_dict"])
def test_a_child_forked_while_a_thread_is_inside_reset_or_load(loader: Any, inside: str) -> None:
    state = loader.meter.state_dict()
    call = {
        "reset": loader.meter.reset,
        "load_state_dict": lambda: loader.meter.load_state_dict(state),
    }[inside]
    got = fork_during(_inside(loader, call), lambda: _reset_then_pass(loader), 30)
    assert got == ("ok", (N, N // 8)), f"the child after a fork inside {inside}(): {got}"
    # the parent's call finished (zeroed, or the state loaded) and its meter counts on
    assert loader.stats.batches == (0 if inside == "reset" else N // 8)
    assert sum(len(b) for b in loader) == N


def test_a_child_forked_while_a_thread_polls_the_device_clock(loader: Any) -> None:
    """A meter watching a CUDA device (``device="cuda"``): ``stats()`` in a reporting thread
    polls the device clock under the clock's own lock. That lock was a plain
    ``threading.Lock``: the child's first ``loader.stats`` waited for ever. The clock is made
    without touching CUDA (no pairs are pending), so this runs on a CPU machine."""
    clock = loader.meter.watch_device("cuda")
    assert clock is not None
    got = fork_while_held(lambda: clock._fork.lock, lambda: _reset_then_pass(loader), 30)
    assert got == ("ok", (N, N // 8)), f"the child's stats(): {got}"
    assert loader.stats.device_idle_s == 0.0  # the parent's clock is usable after the fork
