"""The loader's three objects, each step alone: ``LoaderPlan``, ``Pass`` and the per-batch
pipeline of ``feedpipe.loader.pipeline`` (fetch, failure policy, timing, hand-off, finalise)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import DataLoader, DistributedSampler, StallMeter
from feedpipe.errors import DatasetError
from feedpipe.loader.fetch import ALL_BAD, Failed, Mode, Skipped
from feedpipe.loader.index_stream import IndexStream
from feedpipe.loader.loader_pass import Epoch, Pass
from feedpipe.loader.pipeline import FailurePolicy, Fetch, Finalise, Handoff, Timing, dying
from feedpipe.loader.skip import SkipLedger
from feedpipe.loader.skip_iter import SkipPolicy


def _pass(source: Any = (), batches: int = 0, stream: IndexStream | None = None) -> Pass:
    epoch = Epoch()
    epoch.batches = batches
    return Pass(epoch, iter(source), stream=stream)


# ------------------------------------------------------------------------------- the plan
def test_the_plan_is_resolved_once_and_frozen() -> None:
    loader = DataLoader(list(range(10)), batch_size=3)
    plan = loader.plan
    assert plan.worker_type == "process" and plan.mode is Mode.PER_SAMPLE
    assert plan.stream is not None and not plan.iterable and not plan.skip
    assert plan.feed is None and plan.direct is None and plan.feed_info() is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.on_error = "skip"  # type: ignore[misc]
    assert loader.plan is plan


def test_the_plan_refuses_bad_arguments_after_torchs_checks() -> None:
    with pytest.raises(ValueError, match="worker_type must be one of"):
        DataLoader(list(range(4)), worker_type="fiber")
    with pytest.raises(ValueError, match="on_error must be one of"):
        DataLoader(list(range(4)), on_error="ignore")
    with pytest.raises(ValueError, match="direct=True needs device"):
        DataLoader(list(range(4)), direct=True)


def test_thread_plan_counts_its_workers() -> None:
    plan = DataLoader(list(range(4)), num_workers=3, worker_type="thread").plan
    assert plan.threads and plan.worker_kind() == "thread" and plan.concurrent_workers(3) == 3


# -------------------------------------------------------------------------------- the pass
def test_a_pass_counts_into_its_epoch_and_forgets_delivered_batches() -> None:
    stream = IndexStream([])
    stream.sent.update({0: [0, 1], 1: [2, 3]})
    p = _pass(batches=5, stream=stream)
    assert p.first == 5 and p.indices(1) == [2, 3]
    p.count(2)
    assert (p.epoch.batches, p.epoch.samples, p.delivered) == (6, 2, 1)
    assert p.indices(0) is None  # delivered: no longer in flight
    assert p.count_failed(np.array([7, 8, 9])) == 6  # its batch number in the epoch
    assert p.epoch.samples == 5
    p.end()
    assert not p.epoch.active


def test_an_epoch_resumes_counts_and_skips_only_without_a_sampler_state() -> None:
    state = {"in_epoch": True, "batches": 3, "samples": 9, "skipped": {"known": [], "epoch": [4]}}
    epoch = Epoch()
    assert epoch.resume_from(state) == 3
    assert (epoch.batches, epoch.samples, epoch.skipped) == (3, 9, [4])
    assert Epoch().resume_from({**state, "sampler": {}}) == 0
    assert Epoch().resume_from({**state, "in_epoch": False}) == 0


# ------------------------------------------------------------------------------- 1. fetch
def test_fetch_reads_the_source_and_explains_its_failures() -> None:
    def source() -> Any:
        yield ("batch", 1, 0, -1.0, -1.0)
        raise OSError("disk gone")

    p = Pass(Epoch(), source())
    fetch = Fetch(p, lambda exc: RuntimeError(f"explained: {exc}"))
    assert fetch() == (None, ("batch", 1, 0, -1.0, -1.0))
    with pytest.raises(RuntimeError, match="explained: disk gone") as info:
        fetch()
    assert isinstance(info.value.__cause__, OSError)


def test_fetch_for_the_feed_passes_failures_and_all_bad_batches_on() -> None:
    failed = Failed(ValueError("bad"), None, [1])
    p = Pass(Epoch(), iter([failed, Skipped(None, [2]), Skipped((b"x", 1, 0, -1.0, -1.0), [3])]))
    fetch = Fetch(p, lambda exc: exc)
    assert fetch.for_feed() == (None, failed, False)
    assert fetch.for_feed()[2] is False
    batch, info, ok = fetch.for_feed()
    assert (batch, ok) == (b"x", True) and info == Skipped((None, 1, 0, -1.0, -1.0), [3])


def test_dying_tells_a_dying_worker_from_a_reraised_error() -> None:
    assert dying(EOFError()) and dying(RuntimeError("worker exited unexpectedly"))
    assert not dying(EOFError("raised in DataLoader worker process 0"))
    assert not dying(ValueError())


# ---------------------------------------------------------------------- 2. failure policy
def test_failure_policy_counts_and_names_the_batch() -> None:
    p = _pass(batches=2)
    error = FailurePolicy(p).failure(Failed(KeyError("k"), 1, [4, 5]))
    assert isinstance(error, KeyError) and p.epoch.samples == 2
    assert "in DataLoader worker 1 while loading batch 2" in str(getattr(error, "__notes__", []))
    with pytest.raises(AssertionError):
        FailurePolicy(p).skipped(Skipped(None, [1]))


def test_skip_policy_records_drops_and_refuses_an_all_bad_epoch() -> None:
    p, ledger, meter = _pass(), SkipLedger(), StallMeter(trace=False)
    policy = SkipPolicy(p, ledger, meter)
    inner = (b"x", 1, 0, -1.0, -1.0)
    assert policy.skipped(Skipped(inner, [7])) == inner
    assert policy.skipped(Skipped(None, [8, 9])) is ALL_BAD
    assert p.epoch.skipped == [7, 8, 9] and p.epoch.batches == 1 and meter.skipped == 3
    assert ledger.seen == {7, 8, 9} and ledger.state(True, p.epoch.skipped)["epoch"] == [7, 8, 9]
    with pytest.raises(DatasetError, match="every sample of the epoch failed"):
        policy.refuse_all_bad()
    policy.good = 1
    policy.refuse_all_bad()  # a batch was delivered: not an error


def test_the_ledger_refuses_only_a_new_index_over_the_limit() -> None:
    ledger = SkipLedger()
    assert not ledger.add([1, 2], limit=2)
    assert not ledger.add([1, 2], limit=2)  # nothing new
    assert ledger.add([3], limit=2)
    assert ledger.begin_epoch([5], None) == frozenset({5})


# -------------------------------------------------------------------------------- 3. timing
def test_timing_off_reads_no_clock_and_records_nothing() -> None:
    meter = StallMeter(enabled=False)
    timing = Timing(meter, shared=False)
    assert timing.begin() == 0.0 and timing.now() == 0.0
    assert timing.record(("b", 3, 12, 0.1, 0.2), 0.0, 0.0) == ("b", 3)
    assert meter.stats().batches == 0


def test_timing_records_one_batch_with_its_stage_times() -> None:
    meter = StallMeter(trace=False)
    timing = Timing(meter, shared=False)
    t0 = timing.begin()
    assert timing.record(("b", 3, 12, 0.1, 0.2), t0, timing.now()) == ("b", 3)
    stats = meter.stats()
    assert (stats.batches, stats.samples) == (1, 3)
    assert meter.stage_s["fetch"] == pytest.approx(0.1)


def test_a_shared_clock_turns_the_mid_reading_into_stage_times() -> None:
    meter = StallMeter(trace=False)
    timing = Timing(meter, shared=True)
    t0 = timing.begin()
    timing.record(("b", 1, 0, t0 + 0.5, -1.0), t0, t0 + 2.0)
    meter.stats()  # folds the batch log
    assert meter.stage_s["fetch"] == pytest.approx(0.5)
    assert meter.stage_s["collate"] == pytest.approx(1.5)


# -------------------------------------------------------------------------- 4. device hand-off
class _Clock:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self) -> str:
        self.calls.append("begin")
        return "mark"

    def end(self, mark: str) -> None:
        self.calls.append(f"end {mark}")

    def cancel(self, mark: str) -> None:
        self.calls.append(f"cancel {mark}")


def test_handoff_ends_with_a_device_batch_and_cancels_without_one() -> None:
    meter = StallMeter(trace=False)
    assert Handoff(meter, None).begin() is None  # no feed: no clock
    clock = _Clock()
    meter.device_clock = clock  # type: ignore[assignment]
    handoff = Handoff(meter, feed=object())  # type: ignore[arg-type]
    handoff.end(handoff.begin(), on_device=torch.zeros(1))
    handoff.end(handoff.begin(), on_device=None)
    assert clock.calls == ["begin", "end mark", "begin", "cancel mark"]


# ------------------------------------------------------------------------------ 5. finalise
def test_finalise_passes_host_batches_and_counts_torchs_path() -> None:
    assert Finalise(None).host("b") == "b"

    class Slots:
        fallback = 0

    slots = Slots()
    assert Finalise(slots).host("b") == "b" and Finalise(slots).for_feed("c") == "c"  # type: ignore[arg-type]
    assert slots.fallback == 2


# ------------------------------------------------------------------ the sampler's public view
def test_the_distributed_sampler_hands_out_chunks_and_counts_what_was_taken() -> None:
    sampler = DistributedSampler(list(range(10)), num_replicas=2, rank=1, shuffle=False)
    iter(sampler)
    chunks = list(sampler.chunks())
    assert np.concatenate(chunks).tolist() == [1, 3, 5, 7, 9]
    sampler.advance(2)
    assert sampler.state_dict()["consumed"] == 2
