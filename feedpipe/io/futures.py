"""Waiting on a batch of parallel I/O jobs: every result, or the first error and nothing left
running (the jobs may share a file descriptor that the caller closes next)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import TypeVar

__all__ = ["results_or_first_error"]

T = TypeVar("T")


def results_or_first_error(futures: Sequence[Future[T]]) -> list[T]:
    """The results of ``futures`` in order. After the first failure the jobs not yet started are
    cancelled and the running ones are waited for, then the first error in order is raised."""
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    wait(futures)
    for f in futures:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            raise error
    return [f.result() for f in futures]
