"""CUDA calls that keep the GIL (feedpipe.device.cudacalls) and the reused timing events.

Each call must have exactly torch's effect on torch's own events and streams; a not-ready query
must leave no CUDA error behind for torch's next check; the feed's event pool must stay bounded
over many batches while every batch stays correct. The CPU tests check the switch.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from feedpipe.device.cudacalls import CudaCalls, load_cudart
from feedpipe.device.feed import GPUFeed, GPUFeedWarning
from feedpipe.stall import StallMeter


def _child(code: str, keep_gil: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with FEEDPIPE_CUDA_KEEP_GIL set to ``keep_gil``
    (``None``: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "FEEDPIPE_CUDA_KEEP_GIL"}
    if keep_gil is not None:
        env["FEEDPIPE_CUDA_KEEP_GIL"] = keep_gil
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


_LIB = "from feedpipe.device.cudacalls import cuda_calls\nprint('LIB', cuda_calls().lib)\n"


def test_keep_gil_switch_is_strict() -> None:
    code = (
        "import torch\n"
        "from feedpipe.device.cudacalls import cuda_calls\n"
        "try:\n"
        "    cuda_calls()\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _child(code, "maybe")
    assert "ERR FEEDPIPE_CUDA_KEEP_GIL='maybe'" in out.stdout, out.stderr


@pytest.mark.parametrize("value", ["0", None])
def test_keep_gil_off_or_unset_uses_torch_calls(value: str | None) -> None:
    out = _child(_LIB, value)
    assert "LIB None" in out.stdout, out.stderr


@pytest.mark.gpu
def test_keep_gil_on_finds_torchs_libcudart() -> None:
    out = _child("import torch\ntorch.cuda.init()\n" + _LIB, "1")
    assert "LIB <PyDLL" in out.stdout, out.stderr


def _held() -> CudaCalls:
    """The GIL-held calls (opt-in in the library: FEEDPIPE_CUDA_KEEP_GIL=1), made directly."""
    torch.cuda.init()
    return CudaCalls(load_cudart())


def _sleep_ms(ms: float) -> None:
    torch.cuda._sleep(int(ms * 1e-3 * 1.5e9))  # about ms at 1.5 GHz; only "long enough" matters


@pytest.mark.gpu
def test_calls_match_torch_on_torch_objects() -> None:
    calls = _held()
    assert calls.lib is not None, "torch's libcudart was not found in this process"
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls.record(a, side)  # not created yet: torch's record creates it
    calls.record(b, side)
    torch.cuda.synchronize()
    assert a.cuda_event and b.cuda_event
    with torch.cuda.stream(side):
        calls.record(a, side)
        _sleep_ms(50)
        calls.record(b, side)
    assert calls.query(b) is False  # the sleep is still running
    assert int(calls.lib.cudaPeekAtLastError()) == 0  # not-ready left no error for torch
    main = torch.cuda.current_stream(dev)
    calls.wait(main, b)  # the main stream now runs after the sleep
    c = torch.cuda.Event(enable_timing=True)
    c.record(main)
    c.synchronize()
    assert calls.query(b) is True and b.query()
    ms = calls.elapsed_ms(a, b)
    assert ms == pytest.approx(a.elapsed_time(b), rel=1e-6) and ms > 10


@pytest.mark.gpu
def test_failed_call_names_it_and_clears_the_error() -> None:
    calls = _held()
    assert calls.lib is not None
    a = torch.cuda.Event(enable_timing=True)  # never recorded: no timing yet
    b = torch.cuda.Event(enable_timing=True)
    s = torch.cuda.current_stream()
    calls.record(a, s)
    b.record(s)
    torch.cuda.synchronize()
    fresh = torch.cuda.Event(enable_timing=False)
    fresh.record(s)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="cudaEventElapsedTime failed: CUDA error"):
        calls.elapsed_ms(a, fresh)  # an event without timing cannot be timed
    assert int(calls.lib.cudaPeekAtLastError()) == 0
    torch.ones(4, device="cuda").sum().item()  # torch's next check sees nothing


@pytest.mark.gpu
def test_calls_keep_the_gil() -> None:
    """A busy thread counts while the main thread records: with the GIL held it cannot run."""
    calls = _held()
    assert calls.lib is not None
    ev, s = torch.cuda.Event(enable_timing=True), torch.cuda.current_stream()
    calls.record(ev, s)
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    time.sleep(0.05)
    held = CudaCalls(calls.lib)
    released = CudaCalls(None)
    counts = {}
    for name, c in (("held", held), ("released", released)):
        before = ticks[0]
        for _ in range(200):  # each released call waits out a 5 ms switch interval
            c.record(ev, s)
        counts[name] = ticks[0] - before
    stop.set()
    t.join(5)
    assert counts["held"] < counts["released"], counts


@pytest.mark.gpu
def test_feed_reuses_its_timing_events_and_batches_stay_right() -> None:
    meter = StallMeter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        feed = GPUFeed("cuda", prefetch=2, meter=meter)
    cpu = [torch.full((64, 1024), float(i)) for i in range(400)]
    for epoch in range(2):
        for i, b in enumerate(feed.iterate(cpu)):
            assert b.device.type == "cuda"
            assert float(b[0, 0]) == i and float(b[-1, -1]) == i, (epoch, i)
    torch.cuda.synchronize()
    pool = feed.events
    assert pool is not None
    assert len(pool) <= 2 * (feed.prefetch + 4), len(pool)  # not one pair per batch
    assert meter.stats().stages["h2d"].calls == 800


@pytest.mark.gpu
def test_libcudart_is_torchs() -> None:
    calls = _held()
    assert calls.lib is not None
    version = ctypes.c_int()
    assert calls.lib.cudaRuntimeGetVersion(ctypes.byref(version)) == 0
    major = int((torch.version.cuda or "0").split(".")[0])
    assert version.value // 1000 == major
