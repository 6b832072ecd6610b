"""atk9: attacks on the GIL-held CUDA calls and the reused timing events on a real GPU.

Every batch is checked on the device under slow copies (a sleep kernel on the copy stream before
each copy) and a slow consumer, so an ordering broken by a recycled event shows as a wrong
checksum. Each safety check has a twin with the guarded step removed that must see wrong
batches (the check has teeth). Run (one H100/H200, well under a minute):

    python -m pytest -q -p no:cacheprovider tests/test_attack9_gpu.py
"""

from __future__ import annotations

import copy
import itertools
import math
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe.device import feed as feed_mod
from feedpipe.device.cudacalls import CudaCalls, cuda_calls, load_cudart
from feedpipe.device.feed import GPUFeed, GPUFeedWarning, PinnedBatch
from feedpipe.stall import StallMeter

pytestmark = pytest.mark.gpu

ROWS, COLS = 2048, 256
COPY_SLEEP, CONSUMER_SLEEP = 4_000_000, 1_000_000  # GPU cycles (a few ms)


def _sleep(cycles: int) -> None:
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # unannotated in torch


def _feed(**kw: Any) -> GPUFeed:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return GPUFeed("cuda", **kw)


def _host(i: int, pin: bool = False) -> torch.Tensor:
    t = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 7 * i
    return t.pin_memory() if pin else t


def _weights(device: Any) -> torch.Tensor:
    return torch.arange(1, ROWS * COLS + 1, dtype=torch.float64, device=device)


def _want(i: int) -> float:
    return float((_host(i).double().flatten() * _weights("cpu")).sum())


def _slow_copies(feed: GPUFeed) -> None:
    copy_fn = feed._copier.copy

    def slow_copy(views: list[torch.Tensor]) -> Any:
        with torch.cuda.stream(feed.copy_stream):
            _sleep(COPY_SLEEP)
        return copy_fn(views)

    feed._copier.copy = slow_copy  # type: ignore[method-assign]


def _consume(batches: Iterable[torch.Tensor], limit: int | None = None) -> list[float]:
    """Checksums computed on the current stream after a slow kernel (the training step)."""
    sums = []
    for n, b in enumerate(batches):
        if limit is not None and n == limit:
            break
        _sleep(CONSUMER_SLEEP)
        sums.append((b.double().flatten() * _weights(b.device)).sum())
        del b
    torch.cuda.synchronize()
    return [float(s) for s in sums]


def _bad(sums: list[float], first: int = 0) -> list[int]:
    """Batches whose checksum is off (float64 sums in another order round differently; a
    wrong or stale batch is off by more than 1e-6 of it)."""
    return [
        first + i for i, s in enumerate(sums) if not math.isclose(s, _want(first + i), rel_tol=1e-9)
    ]


# ------------------------------------------------------------- the user's own current stream
def _on_user_stream(feed: GPUFeed, n: int) -> list[int]:
    user = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    _slow_copies(feed)
    with torch.cuda.stream(user):  # the training loop runs on its own stream
        assert torch.cuda.current_stream() == user
        return _bad(_consume(feed.iterate(_host(i) for i in range(n))))


def test_hand_over_orders_the_users_current_stream() -> None:
    assert _on_user_stream(_feed(prefetch=2), 16) == []


def test_hand_over_check_has_teeth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting on the default stream instead of the current one: the user's stream reads early."""

    def default_only(self: Any, outs: list[torch.Tensor], event: Any) -> None:
        torch.cuda.default_stream().wait_event(event)
        for t in outs:
            t.record_stream(torch.cuda.current_stream())

    monkeypatch.setattr(feed_mod._CudaCopier, "hand_over", default_only)
    assert _on_user_stream(_feed(prefetch=2), 16) != []


# ------------------------------------------------------------------ recycled timing events
def test_abandoned_epochs_then_full_ones_with_recycled_events() -> None:
    """``break`` after 3 batches with copies in flight, twice, then full epochs: every batch
    right, and the events recycled (the pool stays small)."""
    meter = StallMeter()
    feed = _feed(prefetch=3, meter=meter)
    _slow_copies(feed)
    for epoch in range(4):
        n = 3 if epoch < 2 else 12
        sums = _consume(feed.iterate(_host(i) for i in range(12)), limit=n)
        assert len(sums) == n and _bad(sums) == [], epoch
    assert feed.events is not None and len(feed.events) <= 2 * (feed.prefetch + 4)
    assert meter.stats().stages["h2d"].calls >= 30


def test_two_feeds_interleaved_share_only_the_calls() -> None:
    a, b = _feed(prefetch=2), _feed(prefetch=1)
    _slow_copies(a)
    ca, cb = a._copier, b._copier
    assert isinstance(ca, feed_mod._CudaCopier) and isinstance(cb, feed_mod._CudaCopier)
    assert a.events is not b.events and ca.calls is cb.calls is cuda_calls()
    xs, ys = a.iterate(_host(i) for i in range(10)), b.iterate(_host(i) for i in range(10))
    pairs = zip(xs, ys, strict=True)
    sa, sb = [], []
    for x, y in pairs:
        _sleep(CONSUMER_SLEEP)
        sa.append((x.double().flatten() * _weights(x.device)).sum())
        sb.append((y.double().flatten() * _weights(y.device)).sum())
    torch.cuda.synchronize()
    assert _bad([float(s) for s in sa]) == [] and _bad([float(s) for s in sb]) == []


def _pinned_epoch(feed: GPUFeed, n: int) -> list[int]:
    """Batches that are page-locked already (a process worker's shared slot): the moment the
    feed lets one go, its "worker" overwrites it with -1, as a reused slot would be."""
    keep = [_host(i, pin=True) for i in range(n)]  # allocated first: no allocation between

    def source() -> Iterator[PinnedBatch]:
        for buf in keep:
            view = buf[:]
            weakref.finalize(view, buf.fill_, -1.0)
            yield PinnedBatch(view)
            del view

    _slow_copies(feed)
    return _bad(_consume(feed.iterate(source())))


def test_pinned_sources_held_until_their_copy_completed() -> None:
    assert _pinned_epoch(_feed(prefetch=2), 16) == []


def test_pinned_sources_check_has_teeth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPUFeed, "_release", lambda self, block: self._held.clear())
    assert _pinned_epoch(_feed(prefetch=2), 16) != []


# ----------------------------------------------------------------------------- direct path
def _memmap(root: Path) -> Any:
    path = root / "direct"
    data = np.arange(301 * 40, dtype=np.float32).reshape(301, 40)
    with feedpipe.MemmapWriter(path, shape=(40,), dtype="float32", shard_bytes=50 * 160) as w:
        w.append_batch(data)
    return feedpipe.MemmapDataset(path)


def _loader(ds: Any, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return feedpipe.DataLoader(ds, batch_size=32, device="cuda", **kw)


def test_direct_path_reuses_the_feeds_events(tmp_path: Path) -> None:
    """Direct copies timed from worker threads: their events come from the feed's pool and go
    back to it; over 60 batches the pool stays bounded (it grew by 2 per batch)."""
    ds = _memmap(tmp_path)
    meter = StallMeter()
    loader = _loader(ds, num_workers=2, worker_type="thread", meter=meter, direct=True)
    assert loader._direct is not None and loader._direct.events is loader._feed.events
    want = torch.from_numpy(np.arange(301 * 40, dtype=np.float32).reshape(301, 40))
    for _ in range(6):
        got = torch.cat([b.cpu() for b in loader])
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert len(loader._feed.events) <= 40  # a few batches in flight; it was 2 per batch
    assert meter.stats().stages["h2d"].calls >= 60
    ds.close()


# --------------------------------------------------------------------------------- the meter
def test_meter_read_and_reset_from_another_thread_while_the_loop_runs(tmp_path: Path) -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(64 * 300, dtype=torch.float32).view(300, 64))
    meter = StallMeter()
    loader = _loader(ds, num_workers=2, worker_type="thread", meter=meter)
    stop, errors = threading.Event(), []

    def monitor() -> None:
        try:
            while not stop.wait(0.0005):  # paced: the loop must still get the GIL
                meter.stats()
                meter.reset()
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=monitor, daemon=True)
    t.start()
    try:
        for _ in range(3):
            for (b,) in loader:
                assert b.is_cuda
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive() and errors == []
    meter.reset()
    n = sum(1 for _ in loader)
    clock = meter.device_clock
    assert clock is not None
    clock.poll(wait=True)
    assert meter.stats().device_batches == n == 10


# ---------------------------------------------------------------------- copies, pickles, forks
def test_device_loader_deepcopies_and_pickles_after_an_epoch() -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(40 * 8, dtype=torch.float32).view(40, 8))
    loader = _loader(ds, num_workers=1, worker_type="thread", meter=StallMeter())
    want = [b.cpu() for (b,) in loader]  # the plan now holds the feed, its calls and events
    for c in (copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))):
        got = [b.cpu() for (b,) in c]
        assert len(got) == len(want) and all(
            torch.equal(g, w) for g, w in zip(got, want, strict=True)
        )


def _child_query(calls: Any, event: Any, out: Any) -> None:
    try:
        out.send(("ok", calls.query(event)))
    except RuntimeError as e:
        out.send(("error", str(e)))


def test_forked_child_with_an_inherited_cuda_calls_fails_cleanly() -> None:
    """A forked child cannot use the parent's CUDA context: a call through the inherited
    ``CudaCalls`` must fail with an error naming it (as torch's would), not crash or hang."""
    calls = CudaCalls(load_cudart())  # the GIL-held calls (opt-in: FEEDPIPE_CUDA_KEEP_GIL=1)
    ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    calls.record(ev, torch.cuda.current_stream())
    calls.record(ev, torch.cuda.current_stream())
    torch.cuda.synchronize()
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fork with threads / CUDA initialised
        p = ctx.Process(target=_child_query, args=(calls, ev, send))
        p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung in a CUDA call")
    assert p.exitcode == 0, f"the forked child died: exit code {p.exitcode}"
    assert recv.poll(10), "the forked child sent nothing"
    kind, value = recv.recv()
    if kind == "error":  # the driver's error, or torch's refusal to use CUDA after a fork
        # (the cuda:1 check asks torch for the current device first: found by review)
        assert (
            "cudaEventQuery failed: CUDA error" in value
            or "Cannot re-initialize CUDA in forked subprocess" in value
        ), value
    assert calls.query(ev) is True  # the parent is unaffected


# ------------------------------------------------------------- a feed on a second device
_CTX_PROBE = """
import ctypes, warnings
import torch
import feedpipe
from feedpipe.stall import StallMeter

cuda = ctypes.CDLL("libcuda.so.1")


def active(i):
    dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
    return on.value


torch.cuda.init()
ds = torch.utils.data.TensorDataset(torch.arange(64 * 200, dtype=torch.float32).view(200, 64))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loader = feedpipe.DataLoader(
        ds, batch_size=16, num_workers=2, worker_type="thread", device="cuda:1",
        meter=StallMeter(),
    )
for _ in range(2):
    total = sum(float(b.sum()) for (b,) in loader)
torch.cuda.synchronize(1)
assert torch.cuda.current_device() == 0
print("CTX", active(0), active(1), total)
"""


def _contexts(keep_gil: str) -> tuple[int, int]:
    env = {**os.environ, "FEEDPIPE_CUDA_KEEP_GIL": keep_gil}
    out = subprocess.run(
        [sys.executable, "-c", _CTX_PROBE],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("CTX ")]
    assert line, out.stderr[-2000:]
    _, c0, c1, _ = line[0].split()
    return int(c0), int(c1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_feed_on_cuda_1_makes_no_context_on_cuda_0() -> None:
    """The training thread's current device stays 0 while the loader feeds ``cuda:1`` (a DDP
    rank that never called ``set_device``). torch guards the device around its event calls
    (record, elapsed time) so that no context is made on device 0; the calls through libcudart
    have no guard, and a runtime call with no current context makes the current device's
    primary context (hundreds of MiB on GPU 0, per process). Baseline: torch's calls
    (``FEEDPIPE_CUDA_KEEP_GIL=0``) in the same run."""
    torch_ctx0, _ = _contexts("0")
    if torch_ctx0:
        pytest.skip("torch's own calls make a context on device 0 here: nothing to compare")
    ctx0, ctx1 = _contexts("1")
    assert ctx1 == 1 and ctx0 == 0, "the GIL-held calls made a CUDA context on device 0"


def test_two_live_iterators_of_one_device_loader_interleaved() -> None:
    """A second ``iter(loader)`` while the first is still iterated (torch allows it without
    workers): both share the feed's ring, tickets and events; each gets its batches right."""
    ds = torch.utils.data.TensorDataset(torch.arange(400 * 8, dtype=torch.float32).view(400, 8))
    loader = _loader(ds, meter=StallMeter())
    _slow_copies(loader._feed)
    want = [b for (b,) in torch.utils.data.DataLoader(ds, batch_size=32)]
    it1 = iter(loader)
    a = [next(it1)[0].cpu()]
    it2 = iter(loader)
    b = []
    for _ in range(len(want) - 1):
        b.append(next(it2)[0].cpu())
        a.append(next(it1)[0].cpu())
    b.append(next(it2)[0].cpu())
    for got in (a, b):
        assert len(got) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _prefetcher_epoch(feed: GPUFeed, n: int, failed: int) -> list[int]:
    """The loader's path: thread workers gather batch ``seq`` into its pinned slot
    (``out_for``, cached views), batch ``failed`` fails in its worker (skipped, no ticket)."""
    pending: deque[tuple[int, Any]] = deque()
    seqs = iter(range(n))
    pool = ThreadPoolExecutor(2)

    def read(seq: int) -> Any:
        out = pre.out_for(seq, ROWS)
        if out is None:
            return _host(seq)
        out.copy_(_host(seq))
        return out

    def pull() -> tuple[Any, Any, bool]:
        for seq in itertools.islice(seqs, 4 - len(pending)):
            pending.append((seq, pool.submit(read, seq)))
        if not pending:
            raise StopIteration
        seq, fut = pending.popleft()
        return fut.result(timeout=60), seq, seq != failed

    pre = feed.prefetcher(pull)
    sums, seen = [], []
    try:
        for batch, seq in pre:
            seen.append(seq)
            if batch is None:
                assert seq == failed
                continue
            _sleep(CONSUMER_SLEEP)
            sums.append((seq, (batch.double().flatten() * _weights(batch.device)).sum()))
            del batch
        torch.cuda.synchronize()
    finally:
        pool.shutdown()
    assert seen == list(range(n))
    return [s for s, v in sums if not math.isclose(float(v), _want(s), rel_tol=1e-9)]


def test_prefetcher_with_fillers_and_a_failed_batch() -> None:
    meter = StallMeter()
    feed = _feed(prefetch=2, fillers=4, batch_size=ROWS, meter=meter)
    _slow_copies(feed)
    for _ in range(2):
        assert _prefetcher_epoch(feed, 16, failed=5) == []
    assert feed.events is not None and len(feed.events) <= 2 * (feed.prefetch + 2 + 4 + 2)
    assert meter.stats().stages["h2d"].calls == 2 * 15


def test_elapsed_time_of_a_running_pair_names_the_call_and_leaves_no_error() -> None:
    """Reading a pair before its end completed (cudaErrorNotReady from cudaEventElapsedTime) is
    an error, as with torch's ``elapsed_time``; it names the call and leaves no CUDA error for
    torch's next check, in the main thread and in a worker thread."""
    calls = CudaCalls(load_cudart())  # the GIL-held calls (opt-in: FEEDPIPE_CUDA_KEEP_GIL=1)
    lib = calls.lib
    assert lib is not None
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    new_event = torch.cuda.Event
    a = new_event(enable_timing=True)  # type: ignore[no-untyped-call]
    b = new_event(enable_timing=True)  # type: ignore[no-untyped-call]
    calls.record(a, side)
    calls.record(b, side)
    side.synchronize()
    errors: list[str] = []

    def read() -> None:
        with torch.cuda.stream(side):
            calls.record(a, side)
            _sleep(50_000_000)  # tens of ms: b cannot have completed when it is read
            calls.record(b, side)
        try:
            calls.elapsed_ms(a, b)
        except RuntimeError as e:
            errors.append(str(e))
        errors.append(f"last error {int(lib.cudaPeekAtLastError())}")

    read()
    t = threading.Thread(target=read)
    t.start()
    t.join(60)
    assert not t.is_alive()
    side.synchronize()
    assert len(errors) == 4, errors
    for e in errors[0::2]:
        assert "cudaEventElapsedTime failed: CUDA error 600" in e, e
    assert errors[1::2] == ["last error 0", "last error 0"]
    assert calls.elapsed_ms(a, b) > 0
