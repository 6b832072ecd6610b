"""Stand-ins for DALI's Python worker pool and the pipeline that holds it, for the tests of
``feedpipe.dali.pipeline.PoolCloser`` that need no DALI: the pool's close blocks until released,
as DALI's does while its workers wind down."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["BlockingPool", "FakePipeline"]


class BlockingPool:
    """``close()`` counts its calls, sets :attr:`entered`, then waits (30 s at most, else an
    ``AssertionError``) until :attr:`release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def close(self) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30)


class FakePipeline:
    """A pipeline's stand-in: DALI keeps its pool as ``_py_pool`` (a new
    :class:`BlockingPool` where none is given)."""

    def __init__(self, pool: BlockingPool | None = None) -> None:
        self._py_pool: Any = BlockingPool() if pool is None else pool
