"""``num_workers="auto"``, ``prefetch_factor="auto"``, ``worker_type="auto"`` (issue 28, item 1).

Auto-tuning changes how many workers read, never what they read: every case compares the
batches of an auto-tuned loader with those of ``num_workers=0`` over the same sampler chain,
with the worker count changing during the run (thread pools grow and shrink mid-epoch; process
workers between epochs). Resume is exact across a change of worker count. The decision rule is
tested alone on synthetic readings (``feedpipe.loader.tuner_policy``), and the budget on a real
CPU-heavy dataset.
"""

from __future__ import annotations

import copy
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _dist import run_ranks

import feedpipe
from feedpipe.loader import tuner_policy as tp
from feedpipe.loader.tuner import DEFAULT_CPU_BUDGET, Tuner, available_cores

ROOT = Path(__file__).resolve().parents[1]


class _Slow(tud.Dataset):  # type: ignore[type-arg]
    """``i``, after sleeping ``delay`` (an I/O-bound read: releases the GIL)."""

    def __init__(self, n: int = 96, delay: float = 0.002) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        return i


class _Burn(_Slow):
    """``i``, after ``delay`` seconds of numpy sorting: CPU-heavy, and it releases the GIL, so
    each thread worker can take a core of its own."""

    def __getitem__(self, i: int) -> int:
        data = np.random.default_rng(i).random(20_000)
        end = time.thread_time() + self.delay
        while time.thread_time() < end:
            np.sort(data, kind="stable")
        return i


def _batches(loader: Any) -> list[list[int]]:
    return [b.tolist() for b in loader]


def _loader(ds: Any, workers: Any = 0, **kw: Any) -> feedpipe.DataLoader:
    kw.setdefault("batch_size", 4)
    return feedpipe.DataLoader(ds, num_workers=workers, **kw)


def _fast(loader: feedpipe.DataLoader) -> feedpipe.DataLoader:
    """Decide over short windows, so a small test sees the tuner act."""
    assert loader.tuner is not None
    loader.tuner.window_s = 0.02
    return loader


ORDERS: dict[str, Any] = {
    "shuffle": lambda: {"shuffle": True, "generator": torch.Generator().manual_seed(7)},
    "sampler": lambda: {
        "sampler": tud.RandomSampler(range(96), generator=torch.Generator().manual_seed(3))
    },
    "drop_last": lambda: {
        "batch_size": 5,
        "drop_last": True,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(1),
    },
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_auto_threads_give_the_batches_of_fixed_settings_while_the_pool_resizes(order: str) -> None:
    auto = _fast(
        _loader(_Slow(), "auto", worker_type="auto", prefetch_factor="auto", **ORDERS[order]())
    )
    fixed = _loader(_Slow(delay=0), 0, **ORDERS[order]())
    for _ in range(2):
        assert _batches(auto) == _batches(fixed)
    tuning = auto.tuning
    assert tuning is not None and tuning["worker_type"] == "thread"
    assert tuning["num_workers"] > 1  # the loop waited on a sleeping read: the pool grew
    assert any(line.startswith("workers 1 -> ") for line in tuning["log"])


def test_growing_and_shrinking_threads_mid_epoch_keeps_order(monkeypatch: Any) -> None:
    """The pool follows whatever the tuner says, batch by batch: 1 -> 3 -> 1 -> 4 -> 2; each
    new thread runs worker_init_fn."""
    inited: list[int] = []
    loader = _loader(
        _Slow(delay=0.001),
        "auto",
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        worker_type="thread",
        worker_init_fn=inited.append,
    )
    plan = iter([3, 3, 1, 1, 4, 4, 4, 2])
    seen: list[int] = []
    tuner = loader.tuner
    assert tuner is not None

    def online(workers: int, tids: Any = None) -> tp.Settings | None:
        seen.append(workers)
        n = next(plan, None)
        return None if n is None else tp.Settings(n, "thread", 2)

    monkeypatch.setattr(tuner, "online", online)
    ref = _loader(_Slow(delay=0), 0, shuffle=True, generator=torch.Generator().manual_seed(5))
    assert _batches(loader) == _batches(ref)
    assert seen[:9] == [1, 3, 3, 1, 1, 4, 4, 4, 2]  # the pool ran each count it was given
    assert sorted(set(inited)) == [0, 1, 2, 3]  # workers 1-3 started mid-epoch, ran it


def test_auto_process_workers_change_between_epochs_with_the_same_batches() -> None:
    gen = torch.Generator().manual_seed(11)
    auto = _fast(
        _loader(_Slow(48, 0.004), "auto", worker_type="process", shuffle=True, generator=gen)
    )
    ref = _loader(_Slow(48, 0), 0, shuffle=True, generator=torch.Generator().manual_seed(11))
    counts = []
    for _ in range(3):
        assert _batches(auto) == _batches(ref)
        counts.append(auto.num_workers)
    assert counts[0] == 1 and 2 in counts  # grew at an epoch boundary (2 cores: at most 2)
    tuning = auto.tuning
    assert tuning is not None and tuning["worker_type"] == "process"


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_persistent_workers_keep_the_draws_of_a_fixed_persistent_loader(kind: str) -> None:
    """Persistent workers draw their base seed once: a tuned loader must not draw again (the
    next epoch's shuffle would differ). Threads resize in place; processes keep their count."""

    def make(n: Any, delay: float) -> feedpipe.DataLoader:
        gen = torch.Generator().manual_seed(12)
        return _loader(_Slow(48, delay), n, worker_type=kind, shuffle=True,
                       persistent_workers=True, generator=gen)  # fmt: skip

    auto, ref = _fast(make("auto", 0.004)), make(1, 0)
    for _ in range(3):
        assert _batches(auto) == _batches(ref)
    tuner = auto.tuner
    assert tuner is not None
    if kind == "thread":  # the pool grew, in place
        assert tuner.settings.workers > 1
    else:
        assert tuner.settings.workers == 1 and auto.num_workers == 1


def _resume_case(first: feedpipe.DataLoader, second: feedpipe.DataLoader, k: int) -> None:
    ref = _batches(
        _loader(_Slow(delay=0), 0, shuffle=True, generator=torch.Generator().manual_seed(2))
    )
    it = iter(first)
    head = [next(it).tolist() for _ in range(k)]
    state = first.state_dict()
    del it
    second.load_state_dict(state)
    assert head + _batches(second) == ref


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((2, "thread"), (4, "thread")),
        ((4, "thread"), ("auto", "auto")),
        (("auto", "auto"), (0, "process")),
        ((2, "process"), (4, "thread")),
    ],
)
def test_resume_is_exact_across_a_change_of_worker_count(before: Any, after: Any) -> None:
    def make(setting: Any, delay: float) -> feedpipe.DataLoader:
        n, kind = setting
        ld = _loader(
            _Slow(delay=delay),
            n,
            worker_type=kind,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
        )
        return _fast(ld) if ld.tuner is not None else ld

    _resume_case(make(before, 0.002), make(after, 0.001), k=9)


def test_a_cpu_heavy_dataset_never_gets_more_workers_than_the_budget() -> None:
    """Each thread worker burns a full core; a budget of half of 2 cores holds one (on a host
    short of cores a worker gets less, and the tuner counts what it takes while it runs)."""
    loader = _fast(_loader(_Burn(64, 0.003), "auto", worker_type="thread", cpu_budget=0.5))
    tuner = loader.tuner
    assert tuner is not None and tuner.limits.budget_cores == 0.5 * tuner.cores
    most = 0
    for _ in range(2):
        for _ in loader:
            most = max(most, tuner.settings.workers)
    allowed = max(1, int(tuner.limits.budget_cores))  # one core per worker
    assert most <= allowed
    assert any("budget exhausted" in line for line in tuner.log), tuner.log


def test_each_decision_is_in_the_meters_report_once() -> None:
    loader = _fast(_loader(_Slow(), "auto", worker_type="thread"))
    for _ in range(2):
        _batches(loader)
    tuning = loader.tuning
    assert tuning is not None and tuning["log"]
    report = loader.meter.report()
    assert report.count("tuning: ") == len(tuning["log"])
    for line in tuning["log"]:
        assert report.count(f"tuning: {line}\n") + report.endswith(f"tuning: {line}") == 1
        assert "the loop waited" in line and "of budget" in line  # the figures behind it


# ------------------------------------------------------------------ the rule, synthetic readings
LIMITS = tp.Limits(budget_cores=4.0, max_workers=16, kind=True, prefetch=True)
THREADS = tp.Settings(2, "thread", 2)


def _reading(wait: float, cpu: float | None, busy: float, **kw: Any) -> tp.Reading:
    """A 1-second window: the loop waited ``wait`` s, workers used ``cpu``, busy ``busy`` s."""
    return tp.Reading(wait_s=wait, step_s=1.0 - wait, busy_s=busy, cpu_s=cpu, batches=100, **kw)


def test_rule_input_bound_grows_within_the_budget() -> None:
    d = tp.decide(_reading(0.3, 1.0, 1.9), THREADS, LIMITS)  # 0.5 core per worker, 3 free
    assert d is not None and d.settings.workers == 4  # at most doubling
    assert d.line(THREADS).startswith("workers 2 -> 4: input-bound: the loop waited 30%")
    d = tp.decide(_reading(0.6, 0.2, 1.9), THREADS, LIMITS)  # waiting most of the time
    assert d is not None and d.settings.workers == 8  # 4x in one step
    tight = tp.Limits(budget_cores=1.6, max_workers=16)
    d = tp.decide(_reading(0.3, 1.0, 1.9), THREADS, tight)
    assert d is not None and d.settings.workers == 3  # 1.5 cores fit, not 2


def test_rule_loop_bound_stays_or_shrinks() -> None:
    assert tp.decide(_reading(0.01, 1.0, 1.6), THREADS, LIMITS) is None  # busy: stay
    d = tp.decide(_reading(0.01, 0.2, 0.3), tp.Settings(4, "thread", 2), LIMITS)
    assert d is not None and d.settings.workers == 3 and d.reason.startswith("loop-bound")
    assert tp.decide(_reading(0.05, 1.0, 1.0), THREADS, LIMITS) is None  # in between: stay


def test_rule_budget_exhausted_stops() -> None:
    d = tp.decide(
        _reading(0.5, 3.9, 3.9),
        tp.Settings(4, "process", 2),
        tp.Limits(budget_cores=4.0, max_workers=16),
    )
    assert d is not None and d.settings.workers == 4 and "budget exhausted" in d.reason
    d = tp.decide(
        _reading(0.5, 8.0, 8.0),
        tp.Settings(8, "process", 2),
        tp.Limits(budget_cores=4.0, max_workers=16),
    )
    assert d is not None and d.settings.workers == 7 and d.reason.startswith("over budget")


def test_rule_gil_bound_threads_go_to_processes() -> None:
    # 4 threads busy 3.8 cores' worth on 1 core of CPU, no faster than at 2 threads
    r = _reading(0.4, 1.0, 3.8, grew_from=100.0)
    d = tp.decide(r, tp.Settings(4, "thread", 2), LIMITS)
    assert d is not None and d.settings.kind == "process" and "GIL-bound" in d.reason
    # the same with the growth paying off is not GIL-bound
    r = _reading(0.4, 1.0, 3.8, grew_from=50.0)
    d = tp.decide(r, tp.Settings(4, "thread", 2), LIMITS)
    assert d is not None and d.settings.kind == "thread"
    # one per-sample Python worker whose CPU is its busy time (more than a core: the host is
    # short of cores), no room for a second thread, and a budget of 2 cores: two processes
    two = tp.Limits(budget_cores=2.0, max_workers=8, kind=True, per_sample=True)
    d = tp.decide(_reading(0.4, 1.1, 1.1), tp.Settings(1, "thread", 2), two)
    assert d is not None and d.settings == tp.Settings(2, "process", 2)
    # room for a second thread at the measured CPU: it is tried first (GIL-bound or not)
    d = tp.decide(_reading(0.4, 0.9, 0.95), tp.Settings(1, "thread", 2), two)
    assert d is not None and d.settings == tp.Settings(2, "thread", 2)
    # I/O-bound threads (little CPU) are never sent to processes
    d = tp.decide(_reading(0.4, 0.1, 3.8, grew_from=100.0), tp.Settings(4, "thread", 2), LIMITS)
    assert d is not None and d.settings.kind == "thread"


def test_rule_gil_bound_threads_stay_where_the_budget_holds_one_process() -> None:
    """GIL-bound threads already run about one core of Python: with a budget of one core (the
    default on 2 cores) one process would run no more, so they stay threads, and no thread is
    added (it would only queue for the GIL); the decision says why."""
    one = tp.Limits(budget_cores=1.0, max_workers=8, kind=True, per_sample=True)
    for cores in (1.0, 1.5, 1.75):  # no room for a second thread at 0.9 cores, one process
        budget = tp.Limits(budget_cores=cores, max_workers=8, kind=True, per_sample=True)
        d = tp.decide(_reading(0.4, 0.9, 0.95), tp.Settings(1, "thread", 2), budget)
        assert d is not None and d.settings == tp.Settings(1, "thread", 2), cores
        assert d.reason.startswith(f"GIL-bound threads, and the budget of {cores:.2f} cores")
    # 3 threads queueing for the GIL (busy 2.8 cores on CPU 1.0), their growth bought nothing
    r = _reading(0.4, 1.0, 2.8, grew_from=100.0)
    d = tp.decide(r, tp.Settings(3, "thread", 2), one)
    assert d is not None and d.settings == tp.Settings(3, "thread", 2)
    assert "holds one process worker" in d.reason
    # with a larger budget the same readings move them: as many processes as the budget holds
    # at a core each, never fewer than the threads' one core could match
    d = tp.decide(r, tp.Settings(3, "thread", 2), tp.Limits(6.4, 64, kind=True))
    assert d is not None and d.settings == tp.Settings(3, "process", 2)
    d = tp.decide(r, tp.Settings(3, "thread", 2), tp.Limits(2.5, 64, kind=True))
    assert d is not None and d.settings == tp.Settings(2, "process", 2)
    # a thread that is not GIL-bound (its CPU under its busy time: it waits on I/O) may grow
    d = tp.decide(_reading(0.4, 0.3, 0.95), tp.Settings(1, "thread", 2), one)
    assert d is not None and d.settings.workers > 1 and d.settings.kind == "thread"
    assert tp.processes_in_budget(one) == 1
    # a thread ceiling of 1 (a second thread bought nothing) does not bound the processes
    capped = tp.Limits(6.4, 1, kind=True, per_sample=True)
    d = tp.decide(_reading(0.4, 0.9, 0.95), tp.Settings(1, "thread", 2), capped)
    assert d is not None and d.settings == tp.Settings(2, "process", 2)
    assert tp.processes_in_budget(tp.Limits(6.4, 1)) == 6
    # the default budget (0.4 of the cores, at least one) holds one process up to 4 cores
    for cores, most in ((2, 1), (4, 1), (5, 2), (16, 6)):
        default = max(1.0, DEFAULT_CPU_BUDGET * cores)
        assert tp.processes_in_budget(tp.Limits(default, 4 * cores)) == most, cores


class _Python(_Slow):
    """``i``, after ``delay`` seconds of a pure-Python loop: it holds the GIL throughout."""

    def __getitem__(self, i: int) -> int:
        end, acc = time.perf_counter() + self.delay, 0
        while time.perf_counter() < end:
            acc = (acc * 31 + i) & 0xFFFF
        return i


def test_a_gil_bound_dataset_stays_on_threads_within_a_one_core_budget() -> None:
    """A per-sample pure-Python read on a budget of one core: the auto loader never moves to
    processes (one would run no more Python than the threads); the batches are those of
    fixed settings."""

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(5)

    auto = _fast(
        _loader(_Python(64, 0.002), "auto", worker_type="auto", cpu_budget=1 / available_cores(),
                shuffle=True, generator=gen())
    )  # fmt: skip
    ref = _loader(_Slow(64, 0), 0, shuffle=True, generator=gen())
    tuner = auto.tuner
    assert tuner is not None and tuner.limits.budget_cores == pytest.approx(1.0)
    for _ in range(2):
        assert _batches(auto) == _batches(ref)
        assert auto.worker_type == "thread" and tuner.settings.kind == "thread"
    assert not any("worker_type" in line for line in tuner.log), tuner.log


def test_rule_a_growth_that_bought_nothing_is_undone_and_becomes_the_ceiling() -> None:
    # 2 -> 4 workers, and the batches/s fell to 100 (the window before: 125)
    r = _reading(0.3, 0.4, 3.0, grew_from=125.0, grew_at=2)
    d = tp.decide(r, tp.Settings(4, "process", 2), LIMITS)
    assert d is not None and d.settings.workers == 2 and d.ceiling == 2
    assert d.reason.startswith("slower with 4 workers")
    # the same growth with a gain, or within noise of none, stands (and may go on)
    r = _reading(0.3, 0.4, 3.0, grew_from=105.0, grew_at=2)
    d = tp.decide(r, tp.Settings(4, "process", 2), LIMITS)
    assert d is None or d.settings.workers >= 4


def test_after_a_growth_that_bought_nothing_the_pool_stays_under_the_ceiling(
    monkeypatch: Any,
) -> None:
    """The first window says "slower past 1 worker": the slow read stays input-bound, but the
    real rule (called for every later window) may not grow past the ceiling."""
    import feedpipe.loader.tuner as tuner_mod

    calls: list[int] = []

    def first_no_gain(r: tp.Reading, s: tp.Settings, limits: tp.Limits) -> tp.Decision | None:
        calls.append(limits.max_workers)
        if len(calls) == 1:
            return tp.Decision(s, "slower with 2 workers", ceiling=1)
        return tp.decide(r, s, limits)

    monkeypatch.setattr(tuner_mod, "decide", first_no_gain)
    auto = _fast(_loader(_Slow(64, 0.003), "auto", worker_type="thread"))
    _batches(auto)
    assert len(calls) > 2 and calls[1:] == [1] * (len(calls) - 1)
    assert auto.tuning is not None and auto.tuning["num_workers"] == 1


def test_rule_idle_workers_deepen_the_prefetch() -> None:
    d = tp.decide(_reading(0.3, 0.1, 0.4), THREADS, LIMITS)  # waiting, workers 20% busy
    assert d is not None and d.settings.prefetch == 4 and d.settings.workers == 2


def test_tuner_logs_a_stop_once_in_a_row() -> None:
    tuner = Tuner(
        workers=True, prefetch=False, kind=False, start=tp.Settings(1, "thread", 2), cpu_budget=0.5
    )
    meter = feedpipe.StallMeter()
    tuner.begin(meter)
    for _ in range(3):  # three windows saying the same: one line
        d = tp.Decision(tuner.settings, "budget exhausted, workers stay 1: x")
        tuner.log_decision(d, tuner.settings)
    assert tuner.log == ["no change: budget exhausted, workers stay 1: x"]
    assert meter.report().count("tuning: no change") == 1


# ------------------------------------------------------------------------- arguments and copies
@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"num_workers": "many"}, ValueError, "num_workers must be a non-negative int or 'auto'"),
        ({"num_workers": "auto", "cpu_budget": 0}, ValueError, r"cpu_budget must be .* \(0, 1\]"),
        ({"num_workers": "auto", "cpu_budget": 1.5}, ValueError, "cpu_budget must be"),
        ({"num_workers": "auto", "cpu_budget": -0.2}, ValueError, "cpu_budget must be"),
        ({"num_workers": "auto", "cpu_budget": "half"}, TypeError, "cpu_budget must be"),
        ({"num_workers": 2, "cpu_budget": 0.5}, ValueError, "cpu_budget applies only"),
        ({"num_workers": 2, "prefetch_factor": "deep"}, ValueError, "prefetch_factor must be"),
    ],
)
def test_bad_values_are_clear_errors(kw: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        feedpipe.DataLoader(_Slow(8), batch_size=2, **kw)


def test_default_budget_leaves_room_for_the_training_process() -> None:
    loader = _loader(_Slow(8), "auto")
    tuning = loader.tuning
    assert tuning is not None and tuning["cpu_budget"] == DEFAULT_CPU_BUDGET
    assert tuning["budget_cores"] == max(1.0, DEFAULT_CPU_BUDGET * loader.tuner.cores)  # type: ignore[union-attr]
    assert _loader(_Slow(8), 2).tuning is None  # nothing auto, no tuner


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))])
def test_an_auto_loader_copies_and_pickles(copier: Any) -> None:
    loader = _fast(
        _loader(
            _Slow(32),
            "auto",
            worker_type="auto",
            prefetch_factor="auto",
            shuffle=True,
            generator=torch.Generator().manual_seed(4),
        )
    )
    _batches(loader)
    again = copier(loader)
    assert again.tuning is not None and again.tuning["log"] == loader.tuning["log"]  # type: ignore[index]
    ref = _loader(_Slow(32, 0), 0, shuffle=True, generator=torch.Generator().manual_seed(4))
    _batches(ref)  # the copies' generator stands after one epoch
    assert _batches(again) == _batches(ref)


def test_the_tuner_has_no_collective() -> None:
    """Each rank tunes from its own counters: nothing in the tuner waits on another rank."""
    for name in ("tuner.py", "tuner_policy.py"):
        text = (ROOT / "feedpipe" / "loader" / name).read_text()
        assert "torch.distributed" not in text and "all_reduce" not in text, name


def test_arrays_batches_are_the_same_with_read_batch_datasets() -> None:
    """A read_batch dataset (numpy gathers) under auto: threads, same batches."""
    data = np.arange(400, dtype=np.int64).reshape(100, 4)

    class Rows(tud.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> Any:
            return torch.from_numpy(data[i])

        def read_batch(self, idx: Any, out: Any = None) -> Any:
            time.sleep(0.001)
            return torch.from_numpy(data[np.asarray(idx)])

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(9)

    auto = _fast(
        feedpipe.DataLoader(
            Rows(),
            batch_size=8,
            num_workers="auto",
            shuffle=True,
            worker_type="auto",
            generator=gen(),
        )
    )
    ref = feedpipe.DataLoader(Rows(), batch_size=8, shuffle=True, generator=gen())
    for _ in range(2):
        assert [b.tolist() for b in auto] == [b.tolist() for b in ref]


def test_a_gil_bound_decision_moves_threads_to_processes_at_the_epoch_boundary(
    monkeypatch: Any,
) -> None:
    """The rule's GIL-bound verdict (tested above on readings) takes effect at the next
    ``iter()``: this pass stays on threads, the next runs processes; the batches never change."""
    import feedpipe.loader.tuner as tuner_mod

    def gil(r: tp.Reading, s: tp.Settings, limits: tp.Limits) -> tp.Decision | None:
        if s.kind == "thread":
            return tp.Decision(tp.Settings(1, "process", s.prefetch), "GIL-bound threads: x")
        return None

    monkeypatch.setattr(tuner_mod, "decide", gil)
    auto = _fast(
        _loader(
            _Slow(48, 0.002),
            "auto",
            worker_type="auto",
            shuffle=True,
            generator=torch.Generator().manual_seed(8),
        )
    )
    ref = _loader(_Slow(48, 0), 0, shuffle=True, generator=torch.Generator().manual_seed(8))
    kinds = []
    for _ in range(2):
        it = iter(auto)
        kinds.append(auto.worker_type)  # the kind this pass runs
        assert [b.tolist() for b in it] == _batches(ref)
    assert kinds == ["thread", "process"]
    assert auto.tuning is not None
    assert auto.tuning["log"] == [
        "worker_type thread -> process: GIL-bound threads: x (from the next epoch)"
    ]
    assert auto.meter.report().count("worker_type thread -> process") == 1


def _rank_tunes_alone(rank: int, world: int) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Rank 0 reads slowly (its tuner grows the pool), rank 1 fast; every step all-reduces, as a
    training step does: the ranks stay in step while their tuners decide apart."""
    import torch.distributed as dist

    def sampler() -> tud.DistributedSampler:  # type: ignore[type-arg]
        return tud.DistributedSampler(_Slow(128, 0), num_replicas=world, rank=rank, seed=3)

    # 16 batches a rank: windows enough for a change voted by two of them (Tuner online)
    ds = _Slow(128, 0.004 if rank == 0 else 0.0)
    auto = _fast(_loader(ds, "auto", worker_type="thread", sampler=sampler()))
    got = []
    for batch in auto:
        total = torch.tensor([1.0])
        dist.all_reduce(total)  # a step every rank takes: no tuning decision waits on it
        got.append(batch.tolist())
    ref = _batches(_loader(_Slow(128, 0), 0, sampler=sampler()))
    assert auto.tuner is not None
    return got, ref, list(auto.tuner.log)


def test_each_rank_tunes_on_its_own_counters_under_gloo() -> None:
    out = run_ranks(_rank_tunes_alone, 2)
    for got, ref, _ in out:
        assert got == ref
    assert any(line.startswith("workers 1 -> ") for line in out[0][2])  # the slow rank grew


class _Stream(tud.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        for i in range(40):
            time.sleep(0.002)
            yield i


def test_an_iterable_dataset_keeps_one_worker() -> None:
    """It shards itself by the worker count: another count would change its batches."""
    auto = _fast(_loader(_Stream(), "auto", worker_type="thread"))
    for _ in range(2):
        assert _batches(auto) == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert auto.num_workers == 1 and auto.tuning is not None
    assert not any(line.startswith("workers") for line in auto.tuning["log"])


def test_rule_never_goes_below_one_worker() -> None:
    idle = _reading(0.0, 0.01, 0.01)
    assert tp.decide(idle, tp.Settings(1, "thread", 2), LIMITS) is None


def test_with_the_counters_off_the_settings_stay_where_they_start() -> None:
    off = feedpipe.StallMeter(enabled=False)
    auto = _fast(_loader(_Slow(48), "auto", worker_type="thread", meter=off))
    for _ in range(2):
        assert _batches(auto) == [list(range(i, i + 4)) for i in range(0, 48, 4)]
    assert auto.tuning is not None and auto.tuning["num_workers"] == 1
    assert auto.tuning["log"] == []


@pytest.mark.gpu
def test_auto_with_a_device_feed_gives_the_batches_of_fixed_settings() -> None:
    """With device="cuda" the pool keeps its count within a pass (the ring is sized for it);
    the tuner's changes apply at the next iter(). Not run here: no GPU this session."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def make(n: Any) -> feedpipe.DataLoader:
        gen = torch.Generator().manual_seed(6)
        return _loader(_Slow(48, 0.003 if n == "auto" else 0), n, worker_type="thread",
                       shuffle=True, generator=gen, device="cuda")  # fmt: skip

    auto, ref = _fast(make("auto")), make(1)
    for _ in range(3):
        assert [b.cpu().tolist() for b in auto] == [b.cpu().tolist() for b in ref]
    assert auto.tuning is not None and auto.tuning["num_workers"] >= 1


# ---------------------------------------------------------------- autotune (merged from main)


@pytest.mark.parametrize(
    "kw", [{"num_workers": np.int64(2)}, {"num_workers": 2, "prefetch_factor": np.int64(3)}]
)
def test_numpy_integer_settings_are_accepted_as_torch_does(kw: dict[str, Any]) -> None:
    """A drop-in replacement: torch takes ``num_workers=np.int64(2)``; the auto-tuning argument
    check refused it ("must be a non-negative int or 'auto'")."""
    import feedpipe

    data: Any = list(range(8))
    got = [b.tolist() for b in feedpipe.DataLoader(data, batch_size=2, **kw)]
    want = [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=2, **kw)]
    assert got == want


def test_process_worker_cpu_is_this_loaders_workers_only() -> None:
    """A subprocess of the training script (a validation loader's worker, a compression tool)
    reaped during the window counted as this loader's workers' CPU: with a validation pass of a
    CPU-heavy loader inside the epoch, a sleep-bound auto loader read "budget exhausted"."""
    import subprocess

    from feedpipe.loader.tuner import Tuner
    from feedpipe.loader.tuner_policy import Settings
    from feedpipe.stall.meter import StallMeter

    tuner = Tuner(workers=True, prefetch=False, kind=False, start=Settings(1, "process", 2))
    meter = StallMeter()
    tuner.begin(meter)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=30)
    reading = tuner._read(meter)  # no worker of this loader ran meanwhile
    assert reading.cpu_s is None or reading.cpu_s < 0.1
    # and with a worker of this loader alive (idle) while another child burns and is reaped
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert tuner.watch([idle.pid]) is not None
        subprocess.run([sys.executable, "-c", burn], check=True, timeout=30)
        reading = tuner._read(meter)
        assert reading.cpu_s is not None and reading.cpu_s < 0.2  # its start-up, not the burn
    finally:
        idle.communicate(b"", timeout=30)


def test_a_tuning_window_across_a_meter_reset_and_restore_is_void() -> None:
    """``feedpipe.headspace`` resets the loader's meter for its live run and loads the saved
    counters back after: an auto loader's next decision then took its figures across both and
    logged "the loop waited 137% of step time", "workers 126% busy"."""
    from feedpipe.loader.tuner import Tuner
    from feedpipe.loader.tuner_policy import Settings
    from feedpipe.stall.meter import StallMeter

    meter = _meter_with_waits(10)
    saved = meter.state_dict()
    tuner = Tuner(workers=True, prefetch=False, kind=False, start=Settings(1, "thread", 2))
    tuner.begin(meter)  # a window starts at 10 batches
    meter.reset()  # headspace's live run
    for _ in range(30):
        meter.wait_begin()
        meter.wait_end(1, 10)
    meter.load_state_dict(saved)  # and its restore: 10 batches again
    for _ in range(20):
        meter.wait_begin()
        meter.wait_end(1, 10)
    reading = tuner._read(meter)
    assert reading.batches == 0  # void, never 20 batches' figures against another baseline
    assert isinstance(meter, StallMeter) and meter.resets == 2


def _meter_with_waits(n: int) -> Any:
    from feedpipe.stall.meter import StallMeter

    m = StallMeter()
    for _ in range(n):
        m.wait_begin()
        m.wait_end(1, 10)
    return m


def test_rule_a_change_needs_a_majority_of_the_windows() -> None:
    grow = tp.Decision(tp.Settings(4, "thread", 2), "input-bound")
    more = tp.Decision(tp.Settings(8, "thread", 2), "input-bound")
    stay = tp.Decision(THREADS, "budget exhausted, workers stay 2")
    assert tp.majority([grow], THREADS) is None  # one window never moves the workers
    assert tp.majority([None, grow, None], THREADS) is None  # one noisy window of three
    assert tp.majority([grow, stay], THREADS) is stay  # the latest note, no change
    assert tp.majority([grow, None, more], THREADS) is grow  # the lower of two growths
    shrink = tp.Decision(tp.Settings(1, "thread", 2), "over budget")
    assert tp.majority([shrink, grow, shrink], THREADS) is shrink


def test_one_noisy_window_does_not_move_the_workers() -> None:
    """Online, a window that alone says input-bound (a burst of the host's load) changes nothing;
    a second one that agrees grows the pool, from the median batches/s of the two."""
    tuner = Tuner(workers=True, prefetch=False, kind=False, start=tp.Settings(1, "thread", 2))
    waiting = _reading(0.5, 0.1, 0.95)
    tuner._decide(_reading(0.0, 0.1, 0.3), online=True)  # loop-bound
    tuner._decide(waiting, online=True)
    tuner._decide(_reading(0.0, 0.1, 0.3), online=True)
    assert tuner.settings.workers == 1 and tuner.log == []
    tuner._decide(waiting, online=True)  # two of the last three windows wait
    assert tuner.settings.workers > 1 and tuner.log[-1].startswith("workers 1 -> ")
