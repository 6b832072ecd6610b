"""The worker-process side shared by ``convert`` and ``convert(fn)``: how a part being written
reports progress, and how the parent drains those reports into its bar.

A conversion writes its parts in this process (one worker, or one part) or in a
``ProcessPoolExecutor`` whose initializer hands each worker the parent's progress queue
(:func:`set_queue`); a part calls :func:`report` as it goes, a no-op in the parent, whose bar
is updated per finished part instead.
"""

from __future__ import annotations

import multiprocessing as mp
import operator
import os
import queue as queue_mod
import sys
from multiprocessing.context import BaseContext
from typing import Any

__all__ = ["drain", "pool_context", "report", "set_queue", "worker_count"]

_QUEUE: Any = None  # this worker's progress queue (None: in the parent)


def set_queue(queue: Any) -> None:
    """Where :func:`report` sends amounts in this process (None: nowhere)."""
    global _QUEUE
    _QUEUE = queue


def report(amount: int) -> None:
    """From a part being written in a worker: ``amount`` more is done (the parent's bar)."""
    if _QUEUE is not None:
        _QUEUE.put(amount)


def worker_count(requested: int | None, what: str = "num_workers") -> int:
    """The worker processes of a conversion: as requested, else (None) up to 4, one per CPU;
    0 means in this process, as 1 does (torch's ``num_workers=0`` idiom).

    Anything but a whole number >= 0 (a NumPy integer too, not a bool) is a ``ValueError``
    naming ``what`` and the value."""
    if requested is None:
        return min(4, os.cpu_count() or 1)
    try:
        count = None if isinstance(requested, bool) else operator.index(requested)
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValueError(
            f"{what} must be a whole number >= 0 (0 or 1: in this process; None: up to 4, one "
            f"per CPU), got {requested!r}"
        )
    return max(count, 1)


def pool_context() -> BaseContext:
    """The multiprocessing context of conversion workers: fork on Linux, else spawn."""
    return mp.get_context("fork" if sys.platform == "linux" else "spawn")


def drain(queue: Any, bar: Any) -> None:
    """Add every amount the workers have reported so far to ``bar``."""
    while True:
        try:
            bar.update(queue.get_nowait())
        except queue_mod.Empty:
            return
