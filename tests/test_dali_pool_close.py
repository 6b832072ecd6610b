"""The DALI pool's close asked by the reaper (feedpipe.dali.pipeline.PoolCloser) and again by the
pipeline's finalizer runs once: a second close beside the first raised inside DALI ("Exception
ignored in: <finalize object>", seen in CI). No DALI needed: the pool is a stand-in whose close
blocks until released, as DALI's does while its workers wind down."""

from __future__ import annotations

from typing import Any

from _dali_fakes import FakePipeline

from feedpipe.dali.pipeline import PoolCloser


def test_the_finalizers_close_during_the_reapers_returns_at_once_and_runs_nothing(
    tmp_path: Any,
) -> None:
    pipe = FakePipeline()
    pool = pipe._py_pool
    closer = PoolCloser()
    closer.watch(pipe, str(tmp_path / "plans"))
    closer()
    assert pool.entered.wait(10)  # the reaper's close is running (blocked in the pool)
    pipe._py_pool.close()  # what DALI's finalizer calls: must neither block nor close again
    assert pool.calls == 1
    pool.release.set()
    pipe._py_pool.close()
    assert pool.calls == 1
