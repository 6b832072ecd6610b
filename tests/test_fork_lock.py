"""A dataset forked while another thread holds its open-files lock (a first read in progress)
still reads in the child: the child's copy of a held lock would never be released there, since
the thread holding it does not exist in the child."""

from __future__ import annotations

import multiprocessing as mp
import threading
import warnings
from pathlib import Path

import numpy as np

import feedpipe
from feedpipe.io.forks import ForkLock


def _child_read(ds: feedpipe.MemmapDataset, out: mp.SimpleQueue) -> None:  # type: ignore[type-arg]
    out.put(int(ds.read_batch(np.arange(4)).sum()))


def _fork_while_held(held: ForkLock, target: object, args: tuple[object, ...]) -> int | None:
    """Fork (running ``target(*args, queue)``) while another thread holds ``held.lock``."""
    got, release = threading.Event(), threading.Event()

    def hold() -> None:
        with held.lock:
            got.set()
            release.wait(60)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert got.wait(30)
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    with warnings.catch_warnings():  # "multi-threaded, use of fork() may lead to deadlocks"
        warnings.simplefilter("ignore", DeprecationWarning)
        p = ctx.Process(target=target, args=(*args, out))
        p.start()
    release.set()
    p.join(30)
    t.join(30)
    if p.is_alive():
        p.kill()
        p.join(10)
        return None
    assert p.exitcode == 0
    return int(out.get())


def test_fork_lock_is_free_in_the_child() -> None:
    lock = ForkLock()

    def take(out: mp.SimpleQueue) -> None:  # type: ignore[type-arg]
        with lock.lock:
            out.put(1)

    assert _fork_while_held(lock, take, ()) == 1


def test_dataset_forked_during_a_first_read_reads_in_the_child(tmp_path: Path) -> None:
    data = np.arange(64 * 16, dtype=np.int32).reshape(64, 16)
    with feedpipe.MemmapWriter(tmp_path / "ds", shape=(16,), dtype="int32") as w:
        w.append_batch(data)
    ds = feedpipe.MemmapDataset(tmp_path / "ds")
    held = ds._files._mutex  # the lock a first read holds is what is attacked
    total = _fork_while_held(held, _child_read, (ds,))
    assert total == int(data[:4].sum()), "the child hung on the lock held at the fork"
