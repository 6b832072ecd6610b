"""``DataLoader(on_error="skip")``: drop the samples whose read or transform raises.

The rule, the same for every worker type (``num_workers=0``, threads, processes):

1. A batch is read as usual (one ``read_batch`` / ``__getitems__`` call, or per sample).
2. If that raises, the worker reads the batch's samples one at a time (``read_batch([i])``,
   ``__getitems__([i])`` or ``dataset[i]``) and drops those that raise; the rest form a smaller
   batch (``read_batch(good)`` once more, or ``collate_fn`` over the samples already read).
   If no sample raises alone, the batch is the samples just read (``collate_fn`` over them;
   ``read_batch`` datasets read the batch again), and its error, if any, is raised: a
   ``collate_fn`` failure is not a sample failure, and a sample that failed only in the batch
   read (a transient error) is not read a third time.
3. The dropped indices travel with the batch (:class:`Skipped`); a batch whose samples all
   failed travels as ``Skipped(None, indices)`` and is counted as delivered without
   producing a batch, so batch numbering, ``in_order`` and the GPU feed are unchanged.
4. The main process records the indices when the batch is delivered (the loader's state) and
   counts them (``StallStats.skipped``). At the start of each epoch the indices skipped so far
   become *known bad*: the index stream drops them before any worker sees them, so a sample
   that failed once is never read again, and a resumed run (which loads the same set from the
   state) reads exactly what the uninterrupted run read, even when a sample fails only
   sometimes. The set is frozen for the epoch, so prefetching cannot change what is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from feedpipe.loader.fetch import (
    Failed,
    Fetched,
    MapProxy,
    Mode,
    ShippedTuple,
    Skipped,
    TimedCollate,
    nbytes_of,
    pin_batch,
    read_indices,
    worker_id,
)

__all__ = [
    "ON_ERROR",
    "SKIP_LIMIT",
    "SkipLedger",
    "SkipMapProxy",
    "SkipTimedCollate",
    "drop_known",
    "pin_out",
    "skipping",
]

#: the accepted values of ``DataLoader(on_error=...)``
ON_ERROR = ("raise", "skip")
#: at most this many distinct skipped sample indices are kept (the loader's state stays small);
#: one more raises a ``DatasetError``: data that bad wants repairing, not skipping
SKIP_LIMIT = 10_000

Fetch = Callable[..., ShippedTuple]


def _empty(indices: Any) -> bool:
    """An index batch emptied by the known-bad filter (a scalar index is never empty)."""
    return isinstance(indices, (list, np.ndarray)) and len(indices) == 0


def _take(indices: Any, positions: list[int]) -> Any:
    if isinstance(indices, np.ndarray):
        return indices[positions]
    return [indices[k] for k in positions]


def read_each(dataset: Any, indices: Any, mode: Mode) -> tuple[list[int], list[int], list[Any]]:
    """Read the samples of ``indices`` one at a time: (good positions, bad indices, samples).

    ``samples`` are the good samples (for ``collate_fn``); empty for ``read_batch`` datasets,
    whose good samples are read again as one batch."""
    if mode is Mode.NO_BATCH:  # one sample, and it failed
        return [], [int(indices)], []
    good: list[int] = []
    bad: list[int] = []
    samples: list[Any] = []
    for k in range(len(indices)):
        one = indices[k : k + 1]
        try:
            if mode is Mode.READ_BATCH:
                dataset.read_batch(one)
            elif mode is Mode.GETITEMS:
                samples.append(dataset.__getitems__(one)[0])
            else:
                samples.append(dataset[one[0]])
        except Exception:
            bad.append(int(one[0]))
            continue
        good.append(k)
    return good, bad, samples


def skipping(fetch: Fetch) -> Callable[..., ShippedTuple | Skipped]:
    """``fetch`` (``fetch_batch`` or ``fetch_untimed``) with the skip rule (module docstring)."""

    def fetch_skipping(
        dataset: Any, indices: Any, collate_fn: Callable[[Any], Any], mode: Mode, out: Any = None
    ) -> ShippedTuple | Skipped:
        if _empty(indices):
            return Skipped(None, [])
        try:
            return fetch(dataset, indices, collate_fn, mode, out)
        except Exception:
            pass
        t0 = time.perf_counter()
        good, bad, samples = read_each(dataset, indices, mode)
        if not bad and mode is Mode.READ_BATCH:  # no sample fails alone: read again, raising
            return fetch(dataset, indices, collate_fn, mode, out)  # what the batch raises
        if not good:
            return Skipped(None, bad)
        if mode is Mode.READ_BATCH:  # not into ``out``: that slot is sized for the full batch
            return Skipped(fetch(dataset, _take(indices, good), collate_fn, mode), bad)
        t1 = time.perf_counter()
        batch = collate_fn(samples)  # raises a collate_fn error: not a sample error
        t2 = time.perf_counter()
        record = (batch, len(good), nbytes_of(batch), t1 - t0, t2 - t1)
        return Skipped(record, bad) if bad else record

    return fetch_skipping


def pin_out(out: Any) -> Any:
    """Pin a fetched record's batch (a plain shipped tuple or a :class:`Skipped`)."""
    if type(out) is Skipped:
        return out if out.shipped is None else Skipped(pin_out(out.shipped), out.skipped)
    return (pin_batch(out[0]), *out[1:])


# ----------------------------------------------------------------------- process workers
class _SkipFetched(Fetched):
    __slots__ = ("skipped",)

    def __init__(self, data: Any, fetch_s: float, samples: int, indices: Any, skipped: list[int]):
        super().__init__(data, fetch_s, samples, indices)
        self.skipped = skipped


class SkipMapProxy(MapProxy):
    """``MapProxy`` with the skip rule: the read samples plus the dropped indices."""

    def read_timed(self, indices: Any, samples: int) -> Fetched:
        if _empty(indices):
            return _SkipFetched(None, 0.0, 0, indices, [])
        first = super().read_timed(indices, samples)
        if first.failed is None or not isinstance(first.failed.exc, Exception):
            return first
        t0 = time.perf_counter()
        try:
            good, bad, items = read_each(self.dataset, indices, self.mode)
            if not bad and self.mode is Mode.READ_BATCH:  # no sample fails alone: read again,
                return super().read_timed(indices, samples)  # raising what the batch raises
            if not good:
                return _SkipFetched(None, 0.0, 0, indices, bad)
            sub = _take(indices, good)
            if self.mode is Mode.READ_BATCH:
                items = read_indices(self.dataset, sub, self.mode)
        except (Exception, SystemExit) as exc:
            return Fetched(None, 0.0, samples, indices, Failed(exc, worker_id(), indices))
        return _SkipFetched(items, time.perf_counter() - t0, len(good), sub, bad)


class SkipTimedCollate(TimedCollate):
    """``TimedCollate`` that wraps a batch read by :class:`SkipMapProxy` with its dropped
    indices (``Skipped``); a ``collate_fn`` error still ships as ``Failed``."""

    def __call__(self, data: Any) -> Any:
        if type(data) is not _SkipFetched:
            return super().__call__(data)
        if data.data is None:
            return Skipped(None, data.skipped)
        out = super().__call__(data)
        return out if type(out) is Failed else Skipped(out, data.skipped)


# ----------------------------------------------------------------------- main process
def drop_known(index: Any, known: frozenset[int]) -> tuple[Any, int]:
    """``index`` (a batch, or one index with ``batch_size=None``) without the known-bad
    indices, and how many were dropped."""
    if isinstance(index, np.ndarray):
        keep = ~np.isin(index, np.fromiter(known, dtype=np.int64, count=len(known)))
        return (index, 0) if keep.all() else (index[keep], int((~keep).sum()))
    if isinstance(index, Sequence):
        kept = [i for i in index if i not in known]
        return (index, 0) if len(kept) == len(index) else (kept, len(index) - len(kept))
    return ([], 1) if index in known else (index, 0)


class SkipLedger:
    """The samples ``on_error="skip"`` dropped, across epochs (the rule's step 4).

    ``known``: skipped before the current epoch, dropped unread by the index stream (frozen per
    epoch); ``seen``: every index skipped, bounded by the caller's limit."""

    def __init__(self) -> None:
        self.known: set[int] = set()
        self.seen: set[int] = set()

    def add(self, indices: list[int], limit: int) -> bool:
        """Note skipped ``indices``; whether a new one took the distinct count over ``limit``."""
        seen = self.seen
        for i in indices:
            if i not in seen:
                seen.add(i)
                if len(seen) > limit:
                    return True
        return False

    def begin_epoch(self, last: list[int], state: dict[str, Any] | None) -> frozenset[int]:
        """A new epoch: the last one's skips become known bad, or a loaded ``state``'s part
        replaces them; the known-bad set the index stream drops this epoch."""
        self.known.update(last)
        if state is not None and "skipped" in state:
            known, now = state["skipped"]["known"], state["skipped"]["epoch"]
            self.known = set(known) if state["in_epoch"] else set(known).union(now)
            self.seen = self.known.union(now)
        return frozenset(self.known)

    def state(self, active: bool, epoch: list[int]) -> dict[str, list[int]]:
        """The loader state's part: ``known`` (sorted indices skipped before this epoch) and
        ``epoch`` (skipped so far this epoch, in delivery order; ``epoch``: that list)."""
        if active:
            return {"known": sorted(self.known), "epoch": list(epoch)}
        return {"known": sorted(self.known.union(epoch)), "epoch": []}

    def seen_sample(self, n: int) -> list[int]:
        """The ``n`` smallest indices skipped so far (for messages)."""
        return sorted(self.seen)[:n]
