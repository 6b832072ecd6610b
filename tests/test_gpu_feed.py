"""GPU feed: ring logic, slot reuse, nesting, fallback warning, size errors and stall stages.

The CPU tests drive the same ring and ordering code as the GPU path (with unpinned slots and a
host copy out of the slot); the ``gpu`` tests check correctness under reuse on a real device.
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from collections import OrderedDict, deque, namedtuple
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from feedpipe.device.feed import GPUFeed, GPUFeedWarning, resolve_device
from feedpipe.device.ring import Ring, flatten, map_tensors
from feedpipe.stall import StallMeter

Pair = namedtuple("Pair", ["a", "b"])
HAS_CUDA = torch.cuda.is_available()


def _feed(**kw: Any) -> GPUFeed:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return GPUFeed("cpu", **kw)


def _batch(i: int, rows: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "x": torch.randn(rows, 3, 5, generator=g),
        "y": torch.randint(0, 1000, (rows,), generator=g),
        "meta": [f"batch-{i}", i],
    }


def _thread_loader(
    feed: GPUFeed, make: Callable[[int], Any], n: int, workers: int = 3
) -> Iterator[Any]:
    """A minimal thread-worker loader: each task gathers batch ``seq`` into ``out_for`` when the
    ring offers a slot (FIFO task order, like a real loader), results consumed in order."""

    def task(seq: int) -> Any:
        src = make(seq)
        rows = int(src["x"].shape[0])
        out = feed.out_for(seq, rows)
        if out is None:
            return src
        out["x"].copy_(src["x"])  # the "gather" straight into the pinned slot
        out["y"].copy_(src["y"])
        out["meta"] = src["meta"]
        return out

    with ThreadPoolExecutor(workers) as pool:
        # like a real loader: a bounded number of tasks ahead, dispatched as batches are taken
        futures = deque(pool.submit(task, s) for s in range(min(n, workers)))
        for s in range(workers, n + workers):
            f = futures.popleft()
            yield f.result(timeout=30)
            if s < n:
                futures.append(pool.submit(task, s))


def _assert_batch(got: Any, i: int, rows: int = 4) -> None:
    want = _batch(i, rows)
    assert torch.equal(got["x"].cpu(), want["x"])
    assert torch.equal(got["y"].cpu(), want["y"])
    assert got["meta"] == want["meta"]


# --------------------------------------------------------------------------- structure walker
def test_nested_structures_round_trip_and_leave_non_tensors_alone() -> None:
    marker = object()
    batch = {
        "img": torch.ones(2, 3),
        "pair": Pair(torch.zeros(2), "label"),
        "list": [torch.arange(2), (torch.tensor([1.5]), marker)],
        "od": OrderedDict(k=torch.tensor([7])),
        "n": 3,
        "none": None,
    }
    leaves, rebuild = flatten(batch)
    assert len(leaves) == 5
    out = map_tensors(lambda t: t * 2, batch)
    assert isinstance(out["pair"], Pair) and out["pair"].b == "label"
    assert isinstance(out["list"][1], tuple) and out["list"][1][1] is marker
    assert isinstance(out["od"], OrderedDict)
    assert torch.equal(out["img"], torch.full((2, 3), 2.0))
    assert out["n"] == 3 and out["none"] is None
    assert rebuild(leaves)["list"][0] is batch["list"][0]


def test_flatten_leaves_no_reference_cycle() -> None:
    """Cyclic garbage holding batch tensors would be freed late (and, holding CUDA memory,
    inside forked workers): flatten must not create any."""
    import gc
    import weakref

    t = torch.ones(3)
    ref = weakref.ref(t)
    gc.disable()
    try:
        leaves, rebuild = flatten({"a": [t, (t, "x")], "b": Pair(t, 1)})
        del leaves, rebuild, t
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_feed_moves_nested_batches_and_keeps_structure() -> None:
    feed = _feed(prefetch=2)
    batches = [
        {"a": [torch.full((2,), i), Pair(torch.tensor([i]), f"s{i}")], "i": i} for i in range(6)
    ]
    got = list(feed.iterate(batches))
    assert [b["i"] for b in got] == list(range(6))
    for i, b in enumerate(got):
        assert torch.equal(b["a"][0], torch.full((2,), i))
        assert isinstance(b["a"][1], Pair) and b["a"][1].b == f"s{i}"
        assert torch.equal(b["a"][1].a, torch.tensor([i]))


def test_plain_tensor_batches_and_batches_without_tensors() -> None:
    feed = _feed()
    assert [int(t.sum()) for t in feed.iterate(torch.arange(12).view(4, 3))] == [3, 12, 21, 30]
    feed2 = _feed()
    assert list(feed2.iterate([["a", 1], ["b", 2]])) == [["a", 1], ["b", 2]]


# --------------------------------------------------------------------------- device / fallback
def test_cpu_device_falls_back_with_exactly_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed = GPUFeed("cpu", prefetch=2)
        got = list(feed.iterate(_batch(i) for i in range(5)))
    assert [w.category for w in caught] == [GPUFeedWarning]
    assert feed.device == torch.device("cpu") and not feed.on_gpu and feed.copy_stream is None
    assert feed.info["pinned"] is False
    for i, b in enumerate(got):
        _assert_batch(b, i)


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback on a machine without CUDA")
def test_missing_gpu_falls_back_with_exactly_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed = GPUFeed("cuda:0")
        list(feed.iterate(_batch(i) for i in range(3)))
    assert len(caught) == 1 and issubclass(caught[0].category, GPUFeedWarning)
    assert "CUDA is not available" in str(caught[0].message)
    assert feed.device.type == "cpu"


@pytest.mark.parametrize("bad", ["mps", "meta", "tpu"])
def test_unsupported_device_is_a_clear_error(bad: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match="device"):
        resolve_device(bad)


def test_negative_prefetch_is_an_error() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        _feed(prefetch=-1)


# --------------------------------------------------------------------------- ring logic
def test_ring_is_allocated_once_sized_from_prefetch_and_fillers_and_reused() -> None:
    feed = _feed(prefetch=3, fillers=2)
    assert feed.info["slots"] == 7 and feed.info["ring_bytes"] == 0
    list(feed.iterate(_batch(i) for i in range(10)))
    ring = feed._ring
    ptrs = [b.data_ptr() for s in ring.slots for b in s.buffers]
    info = feed.info
    per_batch = 4 * 3 * 5 * 4 + 4 * 8
    assert info["slot_bytes"] == per_batch and info["ring_bytes"] == 7 * per_batch
    # every slot was used, in seq % n order
    assert sorted(s.seq for s in ring.slots) == [3, 4, 5, 6, 7, 8, 9]
    assert all(s.seq % ring.n == s.index for s in ring.slots)
    # a second epoch reuses exactly the same buffers; nothing grows
    got = list(feed.iterate(_batch(i) for i in range(10)))
    assert [b.data_ptr() for s in ring.slots for b in s.buffers] == ptrs
    assert feed.info["ring_bytes"] == 7 * per_batch and feed.info["reallocations"] == 0
    for i, b in enumerate(got):
        _assert_batch(b, i)


def test_consumer_batches_never_alias_slots() -> None:
    """Batches kept by the consumer stay intact while their slots are refilled many times."""
    feed = _feed(prefetch=1)
    kept = list(feed.iterate(_batch(i) for i in range(20)))
    slot_ptrs = {b.data_ptr() for s in feed._ring.slots for b in s.buffers}
    for i, b in enumerate(kept):
        _assert_batch(b, i)
        assert b["x"].data_ptr() not in slot_ptrs


def test_prefetch_keeps_that_many_batches_submitted_ahead() -> None:
    pulled: list[int] = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(8):
            pulled.append(i)
            yield torch.tensor([i])

    feed = _feed(prefetch=2)
    it = feed.iterate(source())
    assert int(next(it)) == 0
    assert pulled == [0, 1, 2]  # batch 0 handed over, batches 1 and 2 in flight
    assert int(next(it)) == 1 and pulled == [0, 1, 2, 3]
    assert [int(t) for t in it] == list(range(2, 8))


def test_short_last_batch_and_thread_workers_gather_in_place() -> None:
    meter = StallMeter()
    feed = _feed(prefetch=2, fillers=3, batch_size=4, meter=meter)
    sizes = [4] * 9 + [3]

    def make(i: int) -> Any:
        return _batch(i, sizes[i])

    got = list(feed.iterate(_thread_loader(feed, make, len(sizes))))
    for i, b in enumerate(got):
        _assert_batch(b, i, sizes[i])
    total = sum(4 * r * 15 + 8 * r for r in sizes)
    assert meter.stage_bytes["h2d"] == total
    # the first batch(es) were copied into slots ("pin"); later ones were gathered in place
    assert 0 < meter.stage_bytes["pin"] < total
    assert feed.info["reallocations"] == 0


def test_out_for_is_none_until_the_ring_is_laid_out_and_for_non_batch_major() -> None:
    feed = _feed()
    assert feed.out_for(0, 4) is None
    feed2 = _feed()
    it = feed2.iterate([{"a": torch.ones(4, 2), "b": torch.ones(3)}] * 3)
    next(it)
    assert feed2.out_for(4, 4) is None  # leaves have different first dimensions
    list(it)


def test_filler_waits_for_the_slot_previous_batch_then_for_its_copy() -> None:
    ring = Ring(2, pin=False, batch_size=None, timeout=30)
    leaves, rebuild = flatten([torch.zeros(4, 2)])
    ring.allocate(leaves, rebuild)

    class Pending:
        done = threading.Event()

        def query(self) -> bool:
            return self.done.is_set()

    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(ring.out_for(2, 4, 0)))
    t.start()  # batch 2 reuses slot 0: it must wait for batch 0 to be submitted...
    slot, _, _ = ring.fill(0, leaves)
    event = Pending()
    ring.submitted(slot, 0, event)  # ...and for batch 0's copy out of slot 0 to complete
    t.join(0.3)
    assert t.is_alive() and not got
    event.done.set()
    t.join(10)
    assert not t.is_alive() and got[0][0].data_ptr() == slot.buffers[0].data_ptr()


def test_close_wakes_waiting_fillers() -> None:
    feed = _feed(prefetch=0)
    it = feed.iterate(torch.ones(3, 2))
    next(it)
    got: list[Any] = ["unset"]
    t = threading.Thread(target=lambda: got.__setitem__(0, feed.out_for(50, 2)))
    t.start()
    feed.close()
    t.join(10)
    assert not t.is_alive() and got[0] is None
    it.close()


def test_slot_copy_that_never_completes_times_out_naming_the_slot() -> None:
    ring = Ring(2, pin=False, batch_size=None, timeout=0.05)
    leaves, rebuild = flatten(torch.zeros(2))
    ring.allocate(leaves, rebuild)

    class Never:
        def query(self) -> bool:
            return False

    slot, _, _ = ring.fill(0, leaves)
    ring.submitted(slot, 0, Never())
    ring.fill(1, leaves)
    ring.submitted(ring.slots[1], 1, None)
    with pytest.raises(TimeoutError, match="batch 0 out of ring slot 0"):
        ring.fill(2, leaves)


def test_out_of_order_submission_is_an_error() -> None:
    ring = Ring(3, pin=False, batch_size=None, timeout=1)
    leaves, rebuild = flatten(torch.zeros(2))
    ring.allocate(leaves, rebuild)
    with pytest.raises(RuntimeError, match="in order: got 1, expected 0"):
        ring.fill(1, leaves)


# --------------------------------------------------------------------------- size changes
def test_bigger_batch_reallocates_once_with_a_logged_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    feed = _feed(prefetch=1)
    sizes = [2, 2, 8, 8, 8, 8, 3]
    with caplog.at_level(logging.INFO, logger="feedpipe.gpu"):
        got = list(feed.iterate(_batch(i, sizes[i]) for i in range(len(sizes))))
    for i, b in enumerate(got):
        _assert_batch(b, i, sizes[i])
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "bigger than ring slot" in warns[0].getMessage()
    assert any("ring of 3 host slots" in r.getMessage() for r in caplog.records)
    info = feed.info
    assert info["slots"] == 3 and info["reallocations"] == 3  # each slot grew once
    assert info["slot_bytes"] == 8 * (15 * 4 + 8)
    before = [b.data_ptr() for s in feed._ring.slots for b in s.buffers]
    list(feed.iterate(_batch(i, 8) for i in range(6)))  # no further growth
    assert [b.data_ptr() for s in feed._ring.slots for b in s.buffers] == before


def test_batch_with_a_different_structure_is_a_clear_error() -> None:
    feed = _feed()
    batches = [{"x": torch.ones(2)}, {"x": torch.ones(2), "y": torch.ones(2)}]
    with pytest.raises(ValueError, match=r"batch has 2 tensors.*laid out for 1"):
        list(feed.iterate(batches))


# --------------------------------------------------------------------------- stall stages
def test_pin_and_h2d_stages_are_reported_with_bytes() -> None:
    meter = StallMeter()
    feed = _feed(meter=meter)
    list(feed.iterate(_batch(i) for i in range(5)))
    per_batch = 4 * 15 * 4 + 4 * 8
    assert meter.stage_bytes["pin"] == 5 * per_batch
    assert meter.stage_bytes["h2d"] == 5 * per_batch
    assert meter.stage_s["pin"] > 0 and meter.stage_s["h2d"] > 0


# --------------------------------------------------------------------------- GPU
def _checksums_on_device(
    feed: GPUFeed,
    batches: Iterator[Any],
    consumer_cycles: int,
    copy_cycles: int,
) -> list[torch.Tensor]:
    """Consume batches with slow kernels on the consumer stream; optionally delay each copy."""
    if copy_cycles:
        copy = feed._copier.copy

        def slow_copy(views: list[torch.Tensor]) -> Any:
            with torch.cuda.stream(feed.copy_stream):
                torch.cuda._sleep(copy_cycles)
            return copy(views)

        feed._copier.copy = slow_copy  # type: ignore[method-assign]
    sums = []
    try:
        for b in feed.iterate(batches):
            assert b["x"].device == feed.device
            torch.cuda._sleep(consumer_cycles)
            w = torch.arange(1, b["x"].numel() + 1, device=feed.device, dtype=torch.float64)
            x = (b["x"].double().flatten() * w).sum()
            sums.append(torch.stack([x, b["y"].double().sum()]))
            del b  # freed here: only record_stream keeps its memory from the next copy
        torch.cuda.synchronize()
    finally:
        vars(feed._copier).pop("copy", None)  # no feed <-> closure cycle left behind
    return sums


def _expected(i: int, rows: int) -> torch.Tensor:
    b = _batch(i, rows)
    w = torch.arange(1, b["x"].numel() + 1, dtype=torch.float64)
    return torch.stack([(b["x"].double().flatten() * w).sum(), b["y"].double().sum()])


def _bad_batches(threads: bool, consumer_cycles: int, copy_cycles: int) -> list[int]:
    rows, n = 2048, 24
    feed = GPUFeed("cuda", prefetch=2, fillers=3 if threads else 0)
    source = (
        _thread_loader(feed, lambda i: _batch(i, rows), n)
        if threads
        else (_batch(i, rows) for i in range(n))
    )
    sums = _checksums_on_device(feed, source, consumer_cycles, copy_cycles)
    return [i for i, s in enumerate(sums) if not torch.allclose(s.cpu(), _expected(i, rows))]


_CASES = [(2_000_000, 0), (0, 4_000_000), (1_000_000, 4_000_000)]  # (consumer, copy) delays


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize(("consumer", "copy"), _CASES)
def test_gpu_every_batch_is_correct_under_slot_reuse(
    threads: bool, consumer: int, copy: int
) -> None:
    assert _bad_batches(threads, consumer, copy) == []


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("disable", "consumer", "copy"),
    [
        ("slot_wait", 0, 4_000_000),
        ("consumer_wait", 0, 4_000_000),
        ("record_stream", 4_000_000, 0),
    ],
)
def test_gpu_reuse_check_catches_missing_synchronisation(
    monkeypatch: pytest.MonkeyPatch, disable: str, consumer: int, copy: int
) -> None:
    """The check above has teeth: with one safety step removed, it sees corrupted batches."""
    from feedpipe.device import feed as gpu
    from feedpipe.device import ring as _ring

    if disable == "slot_wait":
        monkeypatch.setattr(_ring.Ring, "wait_copied", lambda self, slot: None)
    elif disable == "consumer_wait":
        monkeypatch.setattr(
            gpu._CudaCopier,
            "hand_over",
            lambda self, outs, event: [t.record_stream(torch.cuda.current_stream()) for t in outs],
        )
    else:
        monkeypatch.setattr(
            gpu._CudaCopier,
            "hand_over",
            lambda self, outs, event: torch.cuda.current_stream().wait_event(event),
        )
    assert _bad_batches(False, consumer, copy) != []


@pytest.mark.gpu
def test_gpu_batches_land_on_the_device_with_h2d_timed_by_events() -> None:
    meter = StallMeter()
    feed = GPUFeed("cuda", prefetch=2, meter=meter)
    got = list(feed.iterate(_batch(i, 64) for i in range(6)))
    for i, b in enumerate(got):
        assert b["x"].is_cuda and b["y"].is_cuda and b["meta"] == [f"batch-{i}", i]
        _assert_batch(b, i, 64)
    assert feed.info["pinned"] is True and all(
        b.is_pinned() for s in feed._ring.slots for b in s.buffers
    )
    assert meter.stage_bytes["h2d"] == 6 * 64 * (15 * 4 + 8) and meter.stage_s["h2d"] > 0


@pytest.mark.gpu
def test_gpu_unknown_device_index_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        GPUFeed(f"cuda:{torch.cuda.device_count()}")


def test_skipped_failed_batch_keeps_in_place_gathers_aligned() -> None:
    """Driven step by step like the loader: batch 3 fails in its worker and is skipped."""
    feed = _feed(prefetch=1, fillers=3)
    feed.start()
    source = _thread_loader(feed, _batch, 12)
    got = {}
    for seq, batch in enumerate(source):
        if seq == 3:
            feed.skip()  # whatever the worker wrote into slot 3 is never read
            continue
        got[seq] = feed.hand_over(feed.submit(batch))
    feed.finish()
    assert sorted(got) == [s for s in range(12) if s != 3]
    for seq, b in got.items():
        _assert_batch(b, seq)


def test_abandoned_epoch_with_lent_slots_gets_a_fresh_ring() -> None:
    """A filler of an abandoned epoch may still write into its slot: that ring is not reused."""
    feed = _feed(prefetch=1, fillers=2)
    out_for = feed.start()
    first = feed.submit(_batch(0))
    feed.hand_over(first)
    lent = out_for(1, 4)  # a worker of this epoch got slot 1 ... and the epoch is abandoned
    assert lent is not None
    old = feed._ring
    waiting: list[Any] = ["unset"]
    t = threading.Thread(target=lambda: waiting.__setitem__(0, out_for(40, 4)))
    t.start()
    out_for2 = feed.start()
    t.join(10)
    assert not t.is_alive() and waiting[0] is None  # the old epoch's fillers are turned away
    assert feed._ring is not old
    lent["x"].fill_(-1.0)  # the stale worker finishes its gather: nobody sees it
    got = list(feed.iterate(_thread_loader(feed, _batch, 8)))
    for i, b in enumerate(got):
        _assert_batch(b, i)
    assert out_for2(0, 4) is None  # iterate's own start() ended out_for2's epoch
    # a finished epoch leaves nothing lent: the next one reuses the same ring
    ring = feed._ring
    list(feed.iterate(_batch(i) for i in range(3)))
    assert feed._ring is ring


class _Rows:
    """A dataset with ``read_batch(indices, out=None)`` (like MemmapDataset's): row i = i."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.in_place = 0

    def __len__(self) -> int:
        return self.n

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        idx = torch.as_tensor(list(indices), dtype=torch.float32)
        rows = idx[:, None].expand(-1, 6)
        if out is None:
            return {"x": rows.clone(), "i": idx.long()}
        self.in_place += 1
        out["x"].copy_(rows)
        out["i"].copy_(idx.long())
        return out


def test_prefetcher_with_in_place_gathers_and_a_failed_batch() -> None:
    """The loader's path: workers read batch ``seq`` into its slot; a failure comes in order."""
    meter = StallMeter()
    feed = _feed(prefetch=2, fillers=4, meter=meter)
    ds = _Rows(100)
    batches = [list(range(i, min(i + 8, 100))) for i in range(0, 100, 8)]

    def run_epoch() -> list[tuple[Any, Any]]:
        pending = iter(enumerate(batches))
        pool = ThreadPoolExecutor(2)
        futures: deque[Any] = deque()

        def read(seq: int, indices: list[int]) -> Any:  # a thread worker's task
            out = pre.out_for(seq, len(indices))
            return ds.read_batch(indices) if out is None else ds.read_batch(indices, out=out)

        def pull() -> tuple[Any, Any, bool]:
            for seq, indices in itertools.islice(pending, 4 - len(futures)):
                futures.append(pool.submit(read, seq, indices))  # in order, bounded ahead
            if not futures:
                raise StopIteration
            batch = futures.popleft().result(timeout=30)
            ok = int(batch["i"][0]) != 40  # pretend the worker of batch 5 failed
            return batch, int(batch["i"][0]), ok

        pre = feed.prefetcher(pull)
        try:
            return list(pre)
        finally:
            pool.shutdown()

    for _ in range(2):  # two epochs on the same ring
        got = run_epoch()
        assert [info for _, info in got] == list(range(0, 100, 8))
        for batch, first in got:
            if first == 40:
                assert batch is None  # delivered in its turn, for the loader to raise
                continue
            want = torch.arange(first, min(first + 8, 100))
            assert torch.equal(batch["i"], want)
            assert torch.equal(batch["x"], want[:, None].float().expand(-1, 6))
    assert ds.in_place > 10  # most batches were read straight into their slots
    assert feed.info["reallocations"] == 0 and feed.info["slots"] == 8


def test_closing_a_stale_epoch_does_not_touch_the_current_one() -> None:
    feed = _feed(prefetch=1)
    old = feed.prefetcher(iter([(torch.ones(2), 0, True)] * 3).__next__)
    next(old)
    new = feed.prefetcher(iter([(torch.full((2,), float(i)), i, True) for i in range(4)]).__next__)
    old.close()  # e.g. the abandoned iterator is garbage-collected late
    assert [info for _, info in new] == [0, 1, 2, 3]
    assert new.out_for(9, 2) is None  # the finished epoch turns fillers away
