"""atk9: attacks on the reused timing events, the meter's clock and the GIL-held call wrapper
(commit 5bc7c35), the parts that run without CUDA.

Real objects wherever this machine has them (``EventPool``, ``CopyTimes``, ``DeviceClock``,
``StallMeter``, ``CudaCalls`` with torch's own calls, ``DirectReader``, the loader). CUDA events
cannot be had without CUDA, so the event objects are stand-ins with torch's ``Event`` methods
(``record``, ``query``, ``synchronize``, ``elapsed_time``; ``cuda_event`` 0 sends every call to
them, as for an event torch has not created yet); ``tests/test_attack9_gpu.py`` repeats the
ordering attacks with real events.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import mmap
import pickle
import sys
import threading
import warnings
from collections import deque
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import pytest
import torch

import feedpipe
from feedpipe.device import cudacalls
from feedpipe.device.copy_times import CopyTimes
from feedpipe.device.cudacalls import CudaCalls
from feedpipe.device.direct import DirectReader
from feedpipe.device.event_pool import EventPool
from feedpipe.device.feed import GPUFeedWarning
from feedpipe.io.cuda import cudart_paths
from feedpipe.stall import DeviceClock, StallMeter

STREAM = object()  # the consumer stream: the stand-in events ignore it


class FakeGpu:
    """Stand-in events on one in-order stream: a record completes at once (``auto``) or when
    :meth:`complete` is called; every call is logged in order."""

    def __init__(self, auto: bool = True) -> None:
        self.auto = auto
        self.log: list[tuple[str, Any]] = []
        self.made = 0
        self._tick = itertools.count(1)

    def event(self, enable_timing: bool = True) -> FakeEvent:
        self.made += 1
        return FakeEvent(self)

    def complete(self, *events: FakeEvent) -> None:
        for e in events:
            e.done = True


class FakeEvent:
    cuda_event = 0  # not created: CudaCalls hands every call to the object's own methods

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.done, self.t = gpu, False, 0
        self.hook: Any = None  # run once inside the next query (a finalizer, a thread switch)

    def record(self, stream: Any = None) -> None:
        self.t, self.done = next(self.gpu._tick), self.gpu.auto
        self.gpu.log.append(("record", self))

    def query(self) -> bool:
        self.gpu.log.append(("query", self))
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        self.gpu.log.append(("elapsed", self))
        assert self.done and end.done, "elapsed time read before both records completed"
        return float(end.t - self.t)


def _events(gpu: FakeGpu, n: int) -> list[FakeEvent]:
    events = [gpu.event() for _ in range(n)]
    for e in events:
        e.record()
    return events


def _distinct(events: list[Any]) -> bool:
    return len({id(e) for e in events}) == len(events)


# --------------------------------------------------------------------------- the direct path
def test_direct_reader_takes_its_events_from_the_feeds_pool() -> None:
    """``DirectReader(events=feed.events)``: the events its copies are timed with go back to the
    feed's pool (``note_copy``), so it must take them from there. ``events or EventPool()``
    tested the pool's truth, and an empty pool (every pool at plan time) is falsy: the reader
    made its own, took two new CUDA events per batch from it for ever and the feed's pool grew
    by two per batch (never reused, never bounded)."""
    pool = EventPool()
    reader = DirectReader([1, 2, 3], torch.device("cuda"), None, lambda *a: None, pool)
    assert reader.events is pool


# ------------------------------------------------------------------------------- CopyTimes
def test_copy_times_reads_a_pair_only_after_its_hand_over_oldest_first() -> None:
    gpu = FakeGpu()
    pool = EventPool()
    times = CopyTimes(CudaCalls(None), pool)
    meter = StallMeter()
    e = _events(gpu, 8)
    times.add(e[0], e[1], 100, ticket=1)
    times.add(e[2], e[3], 20, ticket=0)  # a direct-path copy: waits for no hand-over
    times.add(e[4], e[5], 3, ticket=2)
    times.harvest(meter, block=False)
    assert meter.stage_bytes.get("h2d", 0) == 0 and len(pool) == 0  # batch 1 not handed yet
    times.handed = 1
    times.harvest(meter, block=False)
    assert meter.stage_bytes["h2d"] == 120 and len(pool) == 4  # ticket 2 waits for its turn
    e[7].done = False  # the next copy is still running on the copy stream
    times.add(e[6], e[7], 4000, ticket=3)
    times.handed = 3
    times.harvest(meter, block=False)
    assert meter.stage_bytes["h2d"] == 123 and len(pool) == 6  # not read before completion
    times.harvest(meter, block=True)  # the epoch is over: synchronizes
    assert meter.stage_bytes["h2d"] == 4123
    taken = [pool.take() for _ in range(len(pool))]
    assert _distinct(taken) and {id(x) for x in taken} == {id(x) for x in e}


def test_copy_times_with_copies_noted_from_worker_threads() -> None:
    """The direct path's ``note_copy`` from worker threads while the main thread harvests:
    every pair is reported once and each event comes back to the pool exactly once."""
    gpu = FakeGpu()
    pool = EventPool()
    times = CopyTimes(CudaCalls(None), pool)
    meter = StallMeter()
    per, threads = 300, 4
    go = threading.Barrier(threads + 1, timeout=30)

    def worker() -> None:
        go.wait()
        for _ in range(per):
            start, end = gpu.event(), gpu.event()
            start.record()
            end.record()
            times.add(start, end, 1)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    go.wait()
    while any(t.is_alive() for t in workers):
        times.harvest(meter, block=False)
        workers[0].join(0.001)
    for t in workers:
        t.join(30)
        assert not t.is_alive()
    times.harvest(meter, block=True)
    assert meter.stage_bytes["h2d"] == per * threads
    taken = [pool.take() for _ in range(len(pool))]
    assert len(taken) == 2 * per * threads and _distinct(taken)


def _code_with(cls: type, text: str) -> Any:
    """The method of ``cls`` whose source holds ``text`` (its code object) and that line."""
    for fn in vars(cls).values():
        if callable(fn) and hasattr(fn, "__code__"):
            try:
                return fn.__code__, _line_of(fn, text)
            except AssertionError:
                continue
    raise AssertionError(f"{text!r} not found in {cls.__name__}")


def test_copy_times_harvested_by_two_threads_at_once() -> None:
    """``finish()`` of an abandoned iterator runs in the thread that drops it (``LoaderIter.
    __del__`` -> ``Prefetcher.close``), possibly while the training thread's ``hand_over``
    harvests: step by step, the second harvest runs between the first one's read of the oldest
    pair and its ``popleft``. The first then popped from an empty deque (or another pair,
    pooling one pair's events twice: one event then times two copies). Now the
    second takes the pairs the first has not taken (each harvest takes a pair off the queue
    before reading it)."""
    gpu = FakeGpu()
    pool = EventPool()
    times = CopyTimes(CudaCalls(None), pool)
    meter = StallMeter()
    e = _events(gpu, 6)
    for i in range(3):
        times.add(e[2 * i], e[2 * i + 1], 10**i, ticket=i + 1)
    times.handed = 3
    code, line = _code_with(CopyTimes, "pending.popleft()")
    hit: list[threading.Thread] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == line and not hit:
            t = threading.Thread(target=times.harvest, args=(meter, True), daemon=True)
            hit.append(t)
            t.start()
            t.join(1.0)
        return trace

    sys.settrace(trace)
    try:
        times.harvest(meter, block=False)
    finally:
        sys.settrace(None)
    assert hit, "harvest no longer pops this way: update the test"
    hit[0].join(30)
    assert not hit[0].is_alive()
    assert meter.stage_bytes["h2d"] == 111 and meter.stats().stages["h2d"].calls == 3
    taken = [pool.take() for _ in range(len(pool))]
    assert len(taken) == 6 and _distinct(taken)


def test_copy_times_harvest_reentered_from_inside_a_query() -> None:
    """The same thread re-enters: a garbage collection inside the harvest's query (any
    allocation may run one) finalizes an abandoned iterator, whose ``finish()`` harvests with
    ``block``. No deadlock (a lock here would wait for itself), each pair read once."""
    gpu = FakeGpu()
    pool = EventPool()
    times = CopyTimes(CudaCalls(None), pool)
    meter = StallMeter()
    e = _events(gpu, 6)
    for i in range(3):
        times.add(e[2 * i], e[2 * i + 1], 10**i, ticket=i + 1)
    times.handed = 3
    e[1].hook = lambda: times.harvest(meter, block=True)
    errors: list[BaseException] = []

    def harvest() -> None:
        try:
            times.harvest(meter, block=False)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=harvest, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the re-entered harvest deadlocked"
    assert errors == []
    assert meter.stage_bytes["h2d"] == 111 and meter.stats().stages["h2d"].calls == 3
    taken = [pool.take() for _ in range(len(pool))]
    assert len(taken) == 6 and _distinct(taken)


# ----------------------------------------------------------------------------- DeviceClock
def _clock(gpu: FakeGpu) -> DeviceClock:
    clock = DeviceClock("cuda")
    clock._calls = CudaCalls(None)
    clock._torch = SimpleNamespace(cuda=SimpleNamespace(Event=gpu.event))  # type: ignore[assignment]  # stand-in events
    clock.events._new = gpu.event  # the pool makes stand-in events
    return clock


def _batch(clock: DeviceClock) -> None:
    clock.end(clock.begin(STREAM), STREAM)


def test_clock_reads_completed_pairs_before_recording_b() -> None:
    gpu = FakeGpu()
    clock = _clock(gpu)
    _batch(clock)
    _batch(clock)
    del gpu.log[:]
    a = clock.begin(STREAM)
    del gpu.log[:]
    clock.end(a, STREAM)
    kinds = [k for k, _ in gpu.log]
    assert kinds[-1] == "record" and "elapsed" in kinds[:-1], kinds
    assert clock.batches == 2  # the two completed pairs, read before B


def test_clock_events_are_recycled_once_through_cancel_and_reset() -> None:
    gpu = FakeGpu(auto=False)
    clock = _clock(gpu)
    for _ in range(50):  # next() that delivered nothing (the epoch ended)
        clock.cancel(clock.begin(STREAM))
    assert gpu.made == 1
    _batch(clock)
    _batch(clock)  # two pairs whose B never completed
    meter = StallMeter()
    meter.device_clock = clock
    meter.reset()  # the pairs not read go back to the pool; none counts
    assert clock.batches == 0 and not clock._pending
    assert _distinct(clock.events._free) and len(clock.events._free) == gpu.made
    for e in clock.events._free:
        e.done = True
    assert meter.stats().device_idle_s == 0.0  # nothing from before the reset


class _Guarded(deque[Any]):
    """The clock's pending pairs, checking that they change only under the clock's lock."""

    lock: Any = None

    def append(self, x: Any) -> None:
        assert self.lock.locked(), "pending pairs appended without the clock's lock"
        super().append(x)

    def popleft(self) -> Any:
        assert self.lock.locked(), "pending pairs read without the clock's lock"
        return super().popleft()


def test_clock_pending_pairs_change_only_under_its_lock() -> None:
    """``meter.stats()`` (``poll``) and ``meter.reset()`` may run in another thread while the
    loop records: the pending pairs they walk must not change under them."""
    gpu = FakeGpu()
    clock = _clock(gpu)
    pending = _Guarded()
    pending.lock = clock._fork.lock
    clock._pending = pending
    for _ in range(5):
        _batch(clock)
    clock.poll(wait=True)
    assert clock.batches == 5


def _line_of(fn: Any, text: str) -> int:
    """The number of the line of ``fn`` (its own lines only) that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    for n, source in enumerate(lines, first):
        if text in source:
            return n
    raise AssertionError(f"{text!r} not found in {fn.__qualname__}")


def test_meter_reset_in_another_thread_while_the_loop_ends_a_batch() -> None:
    """The interleaving, step by step: ``meter.reset()`` (a monitoring thread) walks the
    clock's pending pairs; the training thread's ``end()`` (``next()``'s last step) appends one
    in the middle. The append did not take the clock's lock: ``reset()`` failed with "deque
    mutated during iteration" (and a pair appended after the walk was dropped unpooled). With
    the lock, ``end()`` waits for ``reset()`` (the join below then times out: no timing is
    asserted, only that the walk was not broken and the pair is kept)."""
    gpu = FakeGpu(auto=False)
    clock = _clock(gpu)
    meter = StallMeter()
    meter.device_clock = clock
    _batch(clock)  # one pending pair: end() below will not poll
    a = clock.begin(STREAM)
    line = _line_of(DeviceClock.reset, "give(*pair)")
    hit: list[threading.Thread] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not DeviceClock.reset.__code__:
            return None
        if event == "line" and frame.f_lineno == line and not hit:
            t = threading.Thread(target=clock.end, args=(a, STREAM), daemon=True)
            hit.append(t)
            t.start()
            t.join(1.0)  # the training thread's end(), "during" the walk
        return trace

    sys.settrace(trace)
    try:
        meter.reset()
    finally:
        sys.settrace(None)
    assert hit, "reset() no longer walks its pending pairs this way: update the test"
    hit[0].join(30)
    assert not hit[0].is_alive()
    assert len(clock._pending) == 1  # the pair ended after the reset counts later
    assert clock._pending[0][0] is a


def test_meter_stats_from_another_thread_while_the_loop_runs() -> None:
    """A thread reads ``meter.stats()`` (which polls the clock) in a loop while the training
    thread ends 2000 batches: each counted once, each event pooled at most once."""
    gpu = FakeGpu()
    clock = _clock(gpu)
    meter = StallMeter()
    meter.device_clock = clock
    stop = threading.Event()
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            meter.stats()
            reads[0] += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        for _ in range(2000):
            _batch(clock)
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    clock.poll(wait=True)
    assert clock.batches == 2000
    assert _distinct(clock.events._free) and len(clock.events._free) == gpu.made <= 8


# ------------------------------------------------------------------------ the env switch
@pytest.fixture
def fresh_calls() -> Any:
    saved = list(cudacalls._CALLS)
    cudacalls._CALLS.clear()
    yield
    cudacalls._CALLS[:] = saved


@pytest.mark.parametrize("value", ["", "2", "maybe", "tru", "0 1", "keep"])
def test_keep_gil_switch_refuses_what_it_cannot_read(
    fresh_calls: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FEEDPIPE_CUDA_KEEP_GIL", value)
    with pytest.raises(ValueError, match=rf"FEEDPIPE_CUDA_KEEP_GIL={value!r}: expected one of"):
        cudacalls.cuda_calls()
    assert not cudacalls._CALLS  # nothing cached: the next call reads the variable again
    monkeypatch.setenv("FEEDPIPE_CUDA_KEEP_GIL", "0")
    assert cudacalls.cuda_calls().lib is None


@pytest.mark.parametrize("value", ["0", "off", " No ", "FALSE"])
def test_keep_gil_switch_off_words(
    fresh_calls: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FEEDPIPE_CUDA_KEEP_GIL", value)
    calls = cudacalls.cuda_calls()
    assert calls.lib is None and cudacalls.cuda_calls() is calls


def test_torch_calls_fallback_has_torchs_effect() -> None:
    """``CudaCalls(None)`` (no libcudart, or the switch off) calls torch's methods."""
    gpu = FakeGpu(auto=False)
    calls = CudaCalls(None)
    a, b = gpu.event(), gpu.event()
    calls.record(a, STREAM)
    calls.record(b, STREAM)
    assert calls.query(b) is False
    gpu.complete(a, b)
    assert calls.query(b) is True and calls.elapsed_ms(a, b) == 1.0
    waited: list[Any] = []
    calls.wait(SimpleNamespace(wait_event=waited.append), b)
    assert waited == [b]


# ------------------------------------------------------------------ finding torch's libcudart
def test_cudart_found_under_a_directory_with_a_space(tmp_path: Path) -> None:
    lib = tmp_path / "my venv" / "lib" / "libcudart.so.13"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(lib, "rb") as f:
        mapped = mmap.mmap(f.fileno(), mmap.PAGESIZE, prot=mmap.PROT_READ)
    try:
        assert str(lib) in cudart_paths()
    finally:
        mapped.close()


def test_cudart_found_when_mapped(tmp_path: Path) -> None:
    lib = tmp_path / "lib" / "libcudart.so.13"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(lib, "rb") as f:
        mapped = mmap.mmap(f.fileno(), mmap.PAGESIZE, prot=mmap.PROT_READ)
    try:
        assert str(lib) in cudart_paths()
    finally:
        mapped.close()


# ------------------------------------------------------------------------- copy and pickle
def test_device_loader_copies_and_pickles_mid_epoch() -> None:
    """``copy.deepcopy`` and ``pickle`` of a device loader with a live iterator (the feed, its
    ring and calls are left out and made anew): the copies iterate right, the original goes on."""
    ds = torch.utils.data.TensorDataset(torch.arange(60.0).reshape(30, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        loader = feedpipe.DataLoader(
            ds, batch_size=4, num_workers=2, worker_type="thread", device="cpu"
        )
        it = iter(loader)
        first = next(it)
        copies = [copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))]
        rest = list(it)
        want = [b[0] for b in torch.utils.data.DataLoader(ds, batch_size=4)]
        got = [b[0] for b in [first, *rest]]
        assert len(got) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        for c in copies:
            got = [b[0] for b in c]
            assert len(got) == len(want)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
