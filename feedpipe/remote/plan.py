"""The order of the reads to come: what a :class:`~feedpipe.ShardCache` evicts by.

The loader knows its index batches before the workers read them. A dataset that reads through a
bounded cache turns each planned batch into the files it will use and adds them here
(:meth:`AccessPlan.add`); when a reader starts on a batch it says so (:meth:`AccessPlan.start`).
The cache's eviction then removes first the files no planned read uses (least recently used
first), then the file whose next planned use is farthest away: Belady's optimal policy, within
the plan's horizon.

Bounds and rules:

* Memory is O(planned reads): the planner decides how far ahead it plans (the loader plans a
  fixed number of samples ahead of the reads, :func:`horizon_samples`); beyond
  ``max_reads`` pending reads the oldest are dropped, so a plan that nobody reads (a dataset
  whose reads happen in other processes) cannot grow.
* Reads are matched to planned batches by content (:func:`batch_key`), not by arrival order:
  thread workers start batches slightly out of order, and a read that was never planned (a user
  calling ``read_batch`` by hand) changes nothing.
* A started read keeps its files at the front (next use "now") until the same thread starts its
  next read, so a file is not evicted between a read's start and its lease.
* The plan belongs to one process; files of other processes' plans rank as unplanned there.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

__all__ = ["AccessPlan", "batch_key", "horizon_samples"]

#: the most samples a planner looks ahead (the loader holds their indices: 8 bytes each)
MAX_HORIZON = 1 << 20
_NOW = -1  # the rank of a file an in-flight read uses


def batch_key(indices: Any) -> Hashable:
    """A key for an index batch (a 1-D int64 numpy array): its length and its bytes' hash."""
    return (len(indices), hash(indices.tobytes()))


def horizon_samples(limit_bytes: int, total_bytes: int, num_samples: int) -> int:
    """How many samples ahead of its reads a dataset behind a ``limit_bytes`` cache plans: the
    samples whose bytes fill the limit twice (enough to rank every cached file), at most
    :data:`MAX_HORIZON` and the dataset."""
    if num_samples <= 0 or total_bytes <= 0:
        return 0
    per_sample = total_bytes / num_samples
    return int(max(1, min(MAX_HORIZON, num_samples, 2 * limit_bytes / per_sample)))


class AccessPlan:
    """Planned reads of one cache, each a set of files, in plan order (see the module docstring).

    Thread-safe. ``max_reads`` bounds the pending reads kept.
    """

    def __init__(self, max_reads: int = 1 << 16) -> None:
        self.max_reads = max_reads
        self._lock = threading.Lock()
        self._seq = 0
        self._reads: dict[int, tuple[Hashable, tuple[str, ...]]] = {}  # pos -> (key, files)
        self._by_key: dict[Hashable, deque[int]] = {}
        self._uses: dict[str, deque[int]] = {}  # file -> its planned positions, ascending
        self._current: dict[int, tuple[str, ...]] = {}  # thread id -> files of its read

    def __len__(self) -> int:
        """Pending (planned, not started) reads."""
        return len(self._reads)

    def __bool__(self) -> bool:
        return bool(self._reads) or bool(self._current)

    def add(self, key: Hashable, files: Iterable[str]) -> None:
        """Plan a read of ``files`` after every read planned so far."""
        names = tuple(dict.fromkeys(files))
        with self._lock:
            pos = self._seq
            self._seq += 1
            self._reads[pos] = (key, names)
            self._by_key.setdefault(key, deque()).append(pos)
            for f in names:
                self._uses.setdefault(f, deque()).append(pos)
            while len(self._reads) > self.max_reads:
                self._drop(next(iter(self._reads)))

    def start(self, key: Hashable) -> bool:
        """A reader (this thread) starts the earliest pending read planned under ``key``.

        Its files stay ranked "now" until this thread starts another read. Returns False when
        no such read is planned (nothing changes then but the thread's previous read ending).
        """
        me = threading.get_ident()
        with self._lock:
            self._current.pop(me, None)
            positions = self._by_key.get(key)
            if not positions:
                return False
            pos = positions[0]
            names = self._reads[pos][1]
            self._drop(pos)
            self._current[me] = names
            return True

    def clear(self) -> None:
        """Forget every planned and started read (a new pass begins)."""
        with self._lock:
            self._reads.clear()
            self._by_key.clear()
            self._uses.clear()
            self._current.clear()

    def next_use(self, file: str) -> int | None:
        """The position of ``file``'s next planned use (-1: a read in flight uses it; None:
        no planned read does). Smaller is sooner."""
        with self._lock:
            return self._rank(file)

    def ranks(self, files: Iterable[str]) -> dict[str, int | None]:
        """:meth:`next_use` of many files under one lock."""
        with self._lock:
            return {f: self._rank(f) for f in files}

    def _rank(self, file: str) -> int | None:
        for names in self._current.values():
            if file in names:
                return _NOW
        uses = self._uses.get(file)
        return uses[0] if uses else None

    def _drop(self, pos: int) -> None:
        """Remove pending read ``pos`` (under the lock)."""
        key, names = self._reads.pop(pos)
        positions = self._by_key[key]
        if positions[0] == pos:
            positions.popleft()
        else:
            positions.remove(pos)
        if not positions:
            del self._by_key[key]
        for f in names:
            uses = self._uses[f]
            if uses[0] == pos:
                uses.popleft()
            else:
                uses.remove(pos)
            if not uses:
                del self._uses[f]
