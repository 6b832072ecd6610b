"""The stall hint suggests nothing already in force and nothing the counters show would not help.

Real loaders (thread workers, in-process) produce the figures; a fake clock gives the exact
cases. The rules are in ``feedpipe.stall.hints``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import pytest
import torch
from _helpers import FakeClock

from feedpipe import DataLoader
from feedpipe.stall import StallMeter
from feedpipe.stall.hints import CPU_BOUND, DEEP_PREFETCH, GIL_CORES, gil_bound, hint, thread_cpu


class GilDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Pure-Python ``__getitem__``: spins until its thread used ``cpu_s`` (holds the GIL)."""

    def __init__(self, n: int, cpu_s: float) -> None:
        self.n, self.cpu_s = n, cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.thread_time() + self.cpu_s
        x = 0
        while time.thread_time() < end:
            x += 1
        return torch.full((4,), i, dtype=torch.int64)


class UnevenDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sleeping reads (GIL released): every ``every``-th sample takes ``slow_s``, others 0."""

    def __init__(self, n: int, slow_s: float, every: int) -> None:
        self.n, self.slow_s, self.every = n, slow_s, every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % self.every == 0:
            time.sleep(self.slow_s)
        return torch.full((4,), i, dtype=torch.int64)


# ------------------------------------------------------------------ GIL-bound thread workers
#: A read longer than the switch interval (5 ms): with 2 or more threads it is interrupted and
#: waits for the GIL inside its stage time, which is what the rule sees. Shorter reads take
#: turns between samples, outside the stages: with 2 ms reads the note came in most runs, but
#: not in every one (a fresh-clone run, 2 workers); docs/concepts/stall-counters.md says so.
GIL_READ_S = 0.012


@pytest.mark.serial  # CPU time against wall time: alone, after the parallel phase
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_gil_bound_threads_get_the_process_note(workers: int) -> None:
    assert 2 * sys.getswitchinterval() < GIL_READ_S
    read_s = 0.002 if workers == 1 else GIL_READ_S  # one thread: no turns to see
    loader = DataLoader(
        GilDataset(40, read_s), batch_size=1, num_workers=workers, worker_type="thread"
    )
    for _ in loader:
        pass  # no step: the loop waits for the Python reads
    s = loader.stats
    cpu = thread_cpu(s)
    assert cpu is not None, s
    on_cpu, cores = cpu
    assert on_cpu * workers >= CPU_BOUND and cores <= GIL_CORES, (cpu, s)  # turns on one core
    text = hint(s)
    assert gil_bound(s) and text.startswith("input-bound"), text
    assert 'worker_type="process"' in text and "holds the GIL" in text
    assert "more workers" not in text  # more threads run one at a time


def test_sleeping_thread_reads_get_no_gil_note() -> None:
    loader = DataLoader(
        UnevenDataset(24, 0.004, 1), batch_size=1, num_workers=2, worker_type="thread"
    )
    for _ in loader:
        pass
    s = loader.stats
    assert not gil_bound(s) and "GIL" not in hint(s)


def _thread_stats(clock: FakeClock, workers: int, cpu_s: float) -> Any:
    m = StallMeter(trace=False)
    m.set_workers(workers, "thread")
    for _ in range(20):
        m.wait_begin()
        clock.advance(0.030)
        m.wait_end(samples=1, nbytes=8)
        clock.advance(0.010)
    for _ in range(20):
        m.add_stage("fetch", 0.020 * workers, 8)  # each read waits for the others' GIL turn
        m.add_stage("collate", 0.0001, 8)
    return dataclasses.replace(m.stats(), input_cpu_s=cpu_s)


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_gil_rule_is_cores_while_busy_not_per_thread(clock: FakeClock, workers: int) -> None:
    # the threads were in their stages 0.4 s each: 0.4 CPU-s is one core, whatever their number
    s = _thread_stats(clock, workers, 0.4)
    on_cpu, cores = thread_cpu(s) or (0.0, 0.0)
    assert on_cpu == pytest.approx(1 / workers, rel=0.01) and 0.5 <= cores <= 1.0
    assert gil_bound(s) and 'worker_type="process"' in hint(s) and "more workers" not in hint(s)
    if workers > 1:  # as many cores as threads: the reads release the GIL, more threads help
        free = dataclasses.replace(s, input_cpu_s=0.4 * workers)
        assert not gil_bound(free) and "GIL" not in hint(free)
        assert "try more workers" in hint(free)


# ------------------------------------------------------------------ settings already in force
def _even_stats(clock: FakeClock, **settings: Any) -> Any:
    """2 process workers, every stage faster than the step, waits 20%, two passes."""
    m = StallMeter(trace=False)
    m.set_workers(2, "process")
    m.set_settings(settings.get("persistent_workers"), settings.get("prefetch_factor"))
    for _ in range(2):
        m.pass_begin()
        for _ in range(20):
            m.wait_begin()
            clock.advance(0.002)
            m.wait_end(samples=1, nbytes=8)
            clock.advance(0.008)
            m.add_stage("fetch", 0.010)  # 5 ms effective with 2 workers, step 8 ms
        m.wait_begin()
        m.pass_end()
        clock.advance(0.5)
    return m.stats()


def test_no_persistent_workers_hint_when_set(clock: FakeClock) -> None:
    off = hint(_even_stats(clock, persistent_workers=False, prefetch_factor=2))
    assert "no stage is to blame" in off and "persistent_workers=True" in off
    on = hint(_even_stats(clock, persistent_workers=True, prefetch_factor=2))
    assert "no stage is to blame" in on and "persistent_workers=True" not in on
    assert "larger prefetch_factor" in on and "now 2" in on


def test_no_prefetch_hint_when_already_deep(clock: FakeClock) -> None:
    text = hint(_even_stats(clock, persistent_workers=True, prefetch_factor=DEEP_PREFETCH))
    assert "prefetch_factor" in text and "larger prefetch_factor" not in text
    assert "persistent_workers=True" not in text and "already cover" in text


def test_one_pass_does_not_suggest_persistent_workers(clock: FakeClock) -> None:
    s = dataclasses.replace(_even_stats(clock, persistent_workers=False), outside_s=0.0)
    assert "persistent_workers" not in hint(s)  # workers started once: nothing to keep


def test_real_loader_passes_its_settings_to_the_hint() -> None:
    ds = UnevenDataset(32, 0.010, 4)
    for persistent in (False, True):
        loader = DataLoader(
            ds,
            batch_size=1,
            num_workers=2,
            worker_type="thread",
            persistent_workers=persistent,
            prefetch_factor=DEEP_PREFETCH,
        )
        for _ in range(2):
            for _ in loader:
                time.sleep(0.004)
        s = loader.stats
        assert (s.persistent_workers, s.prefetch_factor) == (persistent, DEEP_PREFETCH)
        text = hint(s)
        assert "larger prefetch_factor" not in text
        if persistent:
            assert "persistent_workers=True" not in text, text
