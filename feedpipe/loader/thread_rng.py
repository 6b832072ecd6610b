"""The thread workers' watch on the process-global RNGs (see :mod:`feedpipe.loader.threads`).

Threads cannot have their own global RNG: a ``worker_init_fn`` that seeds numpy / ``random`` /
torch, or a dataset that draws from them, changes the training loop's RNG. :class:`RNGWatch`
detects both (by comparing the global states around ``worker_init_fn`` and around each worker's
first batch) and warns once per loader. The checks run on each worker's first batch of the
loader's first pass only (:class:`FirstRound`), whose indices are drawn before the workers start;
a round during which any loader's ``iter()`` ran (:func:`note_iter`) is not judged.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from feedpipe.io.rng_reader import one_reader

__all__ = ["FirstRound", "RNGWatch", "note_iter", "rng_states"]


def rng_states() -> tuple[Any, ...]:
    """The process-global RNG states a thread worker would share with the training loop."""
    return one_reader(_states)


def _states() -> tuple[Any, ...]:
    np_state: Any = np.random.get_state(legacy=True)
    return (
        random.getstate(),
        np_state[1].tobytes(),
        np_state[2],
        torch.initial_seed(),
        torch.get_rng_state(),
    )


def _changed(before: tuple[Any, ...], after: tuple[Any, ...], seeded: bool) -> list[str]:
    """Which global RNGs changed; ``seeded``: only count torch reseeds (the main thread's
    sampler may draw from torch's global RNG while ``worker_init_fn`` runs)."""
    names = []
    if before[0] != after[0]:
        names.append("random")
    if before[1:3] != after[1:3]:
        names.append("numpy.random")
    if before[3] != after[3] or not (seeded or torch.equal(before[4], after[4])):
        names.append("torch")
    return names


class RNGWatch:
    """Warns once per loader when thread workers seed or draw from the process-global RNGs."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.watching = True  # until a first round was checked in full (``FirstRound``)

    def check(self, what: str, before: tuple[Any, ...]) -> None:
        """``before`` is :func:`rng_states` taken before ``what`` ran in a worker thread."""
        names = _changed(before, rng_states(), seeded=what == "worker_init_fn")
        with self._lock:
            if not names or what in self._warned:
                return
            self._warned.add(what)
        detail = {
            "worker_init_fn": "worker_init_fn seeded the global RNG of "
            + " and ".join(names)
            + " from a thread worker: threads share the training process's RNGs, so this "
            "reseeded the main process (once per worker) instead of seeding a worker",
            "dataset": "the dataset drew from the global RNG of "
            + " and ".join(names)
            + " in a thread worker: threads share it with the training loop and with each "
            "other, so these draws are neither per-worker nor reproducible",
        }[what]
        warnings.warn(
            f"feedpipe: {detail}. Derive randomness from feedpipe.get_worker_info().seed "
            "(e.g. numpy.random.default_rng(seed), torch.Generator().manual_seed(seed)), or "
            'use worker_type="process".',
            RuntimeWarning,
            stacklevel=2,
        )


class _Iters:
    """How many ``iter(loader)`` calls (of any feedpipe loader) began: each may draw from the
    global RNGs in the calling thread."""

    n = 0


def note_iter() -> None:
    """A loader's ``iter()`` begins (call before it draws any seed)."""
    _Iters.n += 1


class FirstRound:
    """The first batch of each worker, read before the rest of the pass is dealt out.

    Workers run their RNG checks only while ``open`` and no ``iter()`` began since the round
    did; the main thread closes it (under the lock, so no check is half done) in its first
    ``next()`` once those batches are read, before it returns to the user's code.
    """

    def __init__(self, batches: int) -> None:
        self.batches = batches  # workers that got a first batch
        self.open = True
        self._iters = _Iters.n
        self._lock = threading.Lock()
        self._done = threading.Semaphore(0)

    @classmethod
    def drawn(
        cls, watch: RNGWatch | None, sampler_iter: Iterator[Any], workers: int
    ) -> tuple[FirstRound | None, list[Any]]:
        """The watched first round of a pass and its index batches, drawn now (last first, to
        be popped), or ``(None, [])`` when ``watch`` is absent or done watching."""
        if watch is None or not watch.watching:
            return None, []
        predrawn = list(itertools.islice(sampler_iter, workers))[::-1]
        return cls(len(predrawn)), predrawn

    def check(self, watch: RNGWatch, what: str, before: tuple[Any, ...]) -> None:
        """Worker side: check the global RNGs against ``before`` if the round is still clean."""
        with self._lock:
            if self.open and _Iters.n == self._iters:
                watch.check(what, before)

    def close(self) -> None:
        """No more checks (the main thread goes back to the user's code)."""
        with self._lock:
            self.open = False

    def finish(self) -> None:
        """Worker side: this worker's first batch is done (read, failed or never read)."""
        self._done.release()

    def wait(self, timeout: float) -> bool:
        """Main side: wait for every first batch (at most ``timeout``), then close; True if all
        were checked."""
        deadline = time.monotonic() + timeout
        done = 0
        try:
            while done < self.batches and self._done.acquire(
                timeout=max(0.0, deadline - time.monotonic())
            ):
                done += 1
        finally:  # also on KeyboardInterrupt: the caller's code runs next
            with self._lock:
                self.open = False
        return done == self.batches and _Iters.n == self._iters
