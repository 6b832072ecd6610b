"""NVTX ranges (feedpipe.io.trace): stable names, in the thread doing the work, off by default.

A recorder injected through ``trace.set_recorder`` lists every push/pop with its thread, so the
tests run in CI with or without the ``nvtx`` package; one test drives the real package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import feedpipe
from feedpipe.device.feed import GPUFeedWarning
from feedpipe.io import trace

ROOT = Path(__file__).resolve().parents[1]


class Recorded:
    """A recorder: per thread, the ranges opened (in order) and the open stack."""

    def __init__(self) -> None:
        self.opened: dict[str, list[str]] = defaultdict(list)
        self.stacks: dict[str, list[str]] = defaultdict(list)
        self.lock = threading.Lock()

    def push(self, name: str) -> None:
        thread = threading.current_thread().name
        with self.lock:
            self.opened[thread].append(name)
            self.stacks[thread].append(name)

    def pop(self) -> None:
        thread = threading.current_thread().name
        with self.lock:
            assert self.stacks[thread], f"pop without push in {thread}"
            self.stacks[thread].pop()

    def names(self) -> set[str]:
        return {n for names in self.opened.values() for n in names}

    def threads_of(self, name: str) -> set[str]:
        return {t for t, names in self.opened.items() if name in names}

    def balanced(self) -> bool:
        return not any(self.stacks.values())


@pytest.fixture
def rec() -> Any:
    recorder = Recorded()
    trace.set_recorder(recorder)
    try:
        yield recorder
    finally:
        trace.reset()


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i)


def test_names_are_the_documented_stable_set() -> None:
    assert trace.NAMES == (
        "feedpipe/wait",
        "feedpipe/fetch",
        "feedpipe/collate",
        "feedpipe/pin",
        "feedpipe/h2d",
        "feedpipe/decode",
        "ckpt/stage",
        "ckpt/write",
        "ckpt/fsync",
        "ckpt/commit",
        "ckpt/upload",
    )


def test_loader_thread_workers_open_ranges_in_the_working_thread(rec: Recorded) -> None:
    loader = feedpipe.DataLoader(_Data(), batch_size=4, num_workers=2, worker_type="thread")
    got = [b.clone() for b in loader]
    assert len(got) == 6 and loader.meter.batches == 6  # the counters stay exact
    main = threading.current_thread().name
    assert rec.threads_of("feedpipe/wait") == {main}
    assert rec.opened[main].count("feedpipe/wait") == 7  # and the one that ended the pass
    for stage in ("feedpipe/fetch", "feedpipe/collate"):
        workers = rec.threads_of(stage)
        assert workers and main not in workers, (stage, workers)
        assert sum(rec.opened[t].count(stage) for t in workers) == 6
    assert rec.balanced()
    assert rec.names() <= set(trace.NAMES)


def test_loader_in_process_and_meter_region(rec: Recorded) -> None:
    loader = feedpipe.DataLoader(_Data(), batch_size=6)
    for _ in loader:
        with loader.meter.region("forward"):
            pass
    main = threading.current_thread().name
    opened = rec.opened[main]
    assert opened[:3] == ["feedpipe/wait", "feedpipe/fetch", "feedpipe/collate"]
    assert opened.count("feedpipe/wait") == 5  # 4 batches and the wait that ended the pass
    assert opened.count("feedpipe/region/forward") == 4
    assert rec.balanced() and loader.meter.batches == 4


def test_device_feed_ranges_pin_and_h2d(rec: Recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEEDPIPE_HOST_RING", "1")  # the feed's ring, in host memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        loader = feedpipe.DataLoader(_Data(), batch_size=4, device="cpu")
        assert sum(1 for _ in loader) == 6
    main = threading.current_thread().name
    assert rec.opened[main].count("feedpipe/h2d") == 6
    assert rec.opened[main].count("feedpipe/pin") == 6
    assert rec.balanced()


def test_ckpt_phases_in_their_threads(rec: Recorded, tmp_path: Path) -> None:
    import ckpt

    with ckpt.CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {"w": torch.arange(1000.0)})
        mgr.wait()
    main = threading.current_thread().name
    assert rec.threads_of("ckpt/stage") == {main}
    for name in ("ckpt/write", "ckpt/fsync", "ckpt/commit"):
        threads = rec.threads_of(name)
        assert threads and main not in threads, (name, threads)
    assert rec.balanced()


def test_nothing_recorded_when_off() -> None:
    trace.set_recorder(None)
    try:
        assert not trace.active()
        assert [b.shape for b in feedpipe.DataLoader(_Data(), batch_size=12)] == [(12, 4)] * 2
        with trace.span("ckpt/write"):
            pass
    finally:
        trace.reset()


def _path(*first: Path) -> str:
    """PYTHONPATH for a child: ``first``, this checkout, then the caller's own entries."""
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([*map(str, first), str(ROOT), *([rest] if rest else [])])


def _decide(env: dict[str, str]) -> str:
    """In a fresh interpreter: the recorder the environment picks, and whether nvtx got imported."""
    code = (
        "import sys; from feedpipe.io import trace; r = trace.recorder(); "
        "print(type(r).__name__, 'nvtx' in sys.modules)"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("FEEDPIPE_NVTX",) and "NVTX" not in k}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": _path(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _has_nvtx() -> bool:
    try:
        import nvtx  # noqa: F401
    except ImportError:
        return False
    return True


def test_default_is_off_without_a_profiler_and_does_not_import_nvtx() -> None:
    assert _decide({}) == "NoneType False"
    assert _decide({"FEEDPIPE_NVTX": "0", "NVTX_INJECTION64_PATH": "/x.so"}) == "NoneType False"


@pytest.mark.skipif(not _has_nvtx(), reason="the nvtx package is not installed")
def test_real_nvtx_package() -> None:
    # forced on: ranges go through nvtx (no-ops without a tool, but the real calls)
    assert _decide({"FEEDPIPE_NVTX": "1"}) == "NvtxRecorder True"
    # an injection variable whose library does not load: nvtx says no tool listens, so off
    assert _decide({"NVTX_INJECTION64_PATH": "/nonexistent/libinject.so"}) == "NoneType True"
    code = (
        "import torch, feedpipe, ckpt, tempfile\n"
        "from feedpipe.io import trace\n"
        "assert type(trace.recorder()).__name__ == 'NvtxRecorder'\n"
        "ds = [torch.full((2,), i) for i in range(8)]\n"
        "loader = feedpipe.DataLoader(ds, batch_size=2, num_workers=1, worker_type='thread')\n"
        "assert sum(1 for _ in loader) == 4 and loader.meter.batches == 4\n"
        "with tempfile.TemporaryDirectory() as d, ckpt.CheckpointManager(d) as m:\n"
        "    m.save(1, {'w': torch.ones(3)}); m.wait()\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": _path(), "FEEDPIPE_NVTX": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_forced_on_without_nvtx_names_the_package(tmp_path: Path) -> None:
    """FEEDPIPE_NVTX=1 where nvtx cannot be imported: an ImportError that says what to install."""
    (tmp_path / "nvtx.py").write_text("raise ImportError('no nvtx here')\n")
    code = "from feedpipe.io import trace\ntrace.recorder()\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": _path(tmp_path), "FEEDPIPE_NVTX": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert "FEEDPIPE_NVTX=1 needs the nvtx package: pip install nvtx" in out.stderr


class _Fails(_Data):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 7:
            raise ValueError("bad record 7")
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_ranges_stay_balanced_when_a_batch_fails(rec: Recorded, workers: int) -> None:
    """A failing batch raises in next(); every range opened for it is still closed."""
    kw: dict[str, Any] = {"num_workers": workers, "worker_type": "thread"} if workers else {}
    loader = feedpipe.DataLoader(_Fails(), batch_size=4, **kw)
    it = iter(loader)
    got, errors = 0, 0
    while True:
        try:
            next(it)
            got += 1
        except ValueError as exc:
            assert "bad record 7" in str(exc)
            errors += 1
        except StopIteration:
            break
    assert (got, errors) == (5, 1)
    assert rec.balanced(), dict(rec.stacks)
    assert loader.meter.batches == 5


def test_watch_device_is_cuda_only() -> None:
    from feedpipe.stall import NullMeter, StallMeter

    assert StallMeter(trace=False).watch_device("cpu") is None
    assert isinstance(StallMeter(enabled=False), NullMeter)
    assert StallMeter(enabled=False).watch_device("cuda") is None
