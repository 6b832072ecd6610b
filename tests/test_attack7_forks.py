"""ForkStamp (feedpipe/io/forks.py) and the DALI pool's once-only close (PoolCloser, _Once) under
forks, pickling and interpreter exit; a mix of memmap members read in a forked child and in a
spawned one (pickled) equals the per-sample reads."""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _dali_fakes import BlockingPool, FakePipeline
from _mix_reference import expected_batch

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.dali.pipeline import PoolCloser
from feedpipe.io.forks import ForkStamp

_ROOT = Path(__file__).resolve().parent.parent


def _fork_report(conn: Any, stamp: ForkStamp) -> None:
    """In a forked child: the parent's stamp, a new one, and a grandchild's view of both."""
    mine = ForkStamp()
    ctx = multiprocessing.get_context("fork")
    inner, outer = ctx.Pipe()
    child = ctx.Process(target=_grandchild, args=(outer, stamp, mine))
    child.start()
    got = inner.recv() if inner.poll(60) else None
    child.join(60)
    conn.send((stamp.here(), mine.here(), got))


def _grandchild(conn: Any, first: ForkStamp, second: ForkStamp) -> None:
    conn.send((first.here(), second.here(), ForkStamp().here()))


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_stamps_across_forks_and_grandchildren() -> None:
    stamp = ForkStamp()
    ctx = multiprocessing.get_context("fork")
    inner, outer = ctx.Pipe()
    child = ctx.Process(target=_fork_report, args=(outer, stamp))
    child.start()
    assert inner.poll(60), "the forked child sent nothing"
    got = inner.recv()
    child.join(60)
    assert got == (False, True, (False, False, True))
    assert stamp.here()  # still the parent's


def test_a_stamp_is_never_pickled_or_copied() -> None:
    stamp = ForkStamp()
    for copier in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="belongs to its process"):
            copier(stamp)


def test_stamps_asked_at_interpreter_exit_say_nothing() -> None:
    """A ``__del__`` asking its stamp while modules are torn down (held in a module global, in
    ``builtins`` and ``sys``, in a cycle, and in a thread's frame) runs without an error on
    stderr."""
    code = """
import gc, threading
from feedpipe.io.forks import ForkStamp
class Held:
    def __init__(self):
        self.stamp = ForkStamp()
        self.me = self
    def __del__(self):
        assert self.stamp.here()
        print("asked", flush=True)
import builtins, sys
KEEP = Held()
builtins.atk7_kept = Held()  # builtins are cleared after every other module
sys.atk7_kept = Held()
Held()
gc.disable()
ready = threading.Event()
def hold():
    h = Held()
    ready.set()
    threading.Event().wait()
threading.Thread(target=hold, daemon=True).start()
ready.wait(30)
"""
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.count("asked") >= 1


def test_pool_closer_asked_twice_and_the_finalizer_closes_once(tmp_path: Path) -> None:
    """The reaper asks twice (two watches of one pipeline), DALI's finalizer calls
    ``pool.close()`` (looked up when it runs, as DALI's ``lambda pool: pool.close()``) in
    between: one close in all, and the plan directory gone."""
    pool = BlockingPool()
    pipe = FakePipeline(pool)
    plans = tmp_path / "plans"
    plans.mkdir()
    closer = PoolCloser()
    closer.watch(pipe, str(plans))
    closer()
    assert pool.entered.wait(30)
    assert not plans.exists()
    closer()  # the reaper again: no second close
    finalizer = threading.Thread(target=lambda pool: pool.close(), args=(pool,))
    finalizer.start()
    finalizer.join(30)
    assert not finalizer.is_alive()  # returned at once, while the first close still runs
    pool.release.set()
    assert pool.calls == 1


def _member(path: Path, base: int, n: int) -> MemmapDataset:
    x = ((base + np.arange(n * 6)) % 251).astype(np.uint8).reshape(n, 6)
    with MemmapWriter(path, shape=(6,), dtype="uint8", shard_bytes=24) as w:
        w.append_batch(x)
    return MemmapDataset(path)


def _read_in_child(conn: Any, mix: MixedDataset, idx: np.ndarray) -> None:
    conn.send(mix.read_batch(idx).numpy())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_mix_read_in_a_child_process(tmp_path: Path, method: str) -> None:
    """The parent reads first (its maps and stamps made), then a forked child (the parent's
    maps are a fork's copy: remapped) or a spawned one (the mix pickled) reads the same batch,
    and the parent again: all equal the per-sample reads."""
    members = {"a": _member(tmp_path / "a", 0, 11), "b": _member(tmp_path / "b", 90, 5)}
    mix = MixedDataset(members, weights={"a": 1, "b": 2}, epoch_samples=30, seed=4)
    mix.set_epoch(2)
    idx = np.random.default_rng(1).permutation(30).astype(np.int64)
    want = expected_batch(mix, idx).numpy()
    assert np.array_equal(mix.read_batch(idx).numpy(), want)
    ctx: Any = multiprocessing.get_context(method)
    inner, outer = ctx.Pipe()
    child = ctx.Process(target=_read_in_child, args=(outer, mix, idx))
    child.start()
    assert inner.poll(120), f"the {method} child sent nothing"
    got = inner.recv()
    child.join(60)
    assert child.exitcode == 0
    assert np.array_equal(got, want)
    assert torch.equal(mix.read_batch(idx), torch.from_numpy(want))
    for ds in members.values():
        ds.close()
