"""``num_workers=0``: batches read in the calling thread (:class:`InlineSource`), and the one
rule for a batch of an iterable dataset that it shares with the thread workers
(:func:`next_iterable`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from feedpipe.loader.fetch import (
    Failed,
    Mode,
    ShippedTuple,
    fetch_mid,
    fetch_traced,
    fetcher,
    nbytes_of,
)
from feedpipe.loader.skip import pin_out, skipping

__all__ = ["InlineSource", "next_iterable"]


def next_iterable(
    iterator: Iterator[Any], indices: Any, collate_fn: Callable[[Any], Any], drop_last: bool
) -> ShippedTuple | None:
    """One batch from an iterable dataset, with torch's end-of-stream rules (None: exhausted)."""
    t0 = time.perf_counter()
    if indices is None:  # batch_size=None
        try:
            data = next(iterator)
        except StopIteration:
            return None
        samples = 1
    else:
        data = list(itertools.islice(iterator, len(indices)))
        if not data or (drop_last and len(data) < len(indices)):
            return None
        samples = len(data)
    t1 = time.perf_counter()
    batch = collate_fn(data)
    return (batch, samples, nbytes_of(batch), t1 - t0, time.perf_counter() - t1)


class InlineSource:
    """``num_workers=0``: torch's single-process iterator, minus its per-batch overhead.

    Same RNG draws (index sampler, then torch's base seed, then ``iter(dataset)`` for iterable
    datasets), same fetch rules, same exceptions (the original object, with a note naming the
    sample indices); batches are read by ``fetch_batch`` in the calling thread.
    """

    def __init__(
        self,
        dataset: Any,
        sampler_iter: Iterator[Any],
        collate_fn: Callable[[Any], Any],
        mode: Mode,
        *,
        generator: torch.Generator | None,
        pin: bool,
        drop_last: bool,
        timed: bool = True,
        shared_clock: bool = False,
        skip: bool = False,
    ) -> None:
        self._sampler_iter = sampler_iter
        self._fetch: Any = fetcher(timed)
        # the iterator's clock reads around next() bound the fetch: one read in between does
        # (map-style datasets, no pinning, no NVTX ranges, no skipping; see fetch_mid)
        self.shared_clock = (
            shared_clock and timed and mode is not Mode.ITERABLE and not pin and not skip
            and self._fetch is not fetch_traced
        )  # fmt: skip
        if self.shared_clock:
            self._fetch = fetch_mid
        if skip:  # on_error="skip"
            self._fetch = skipping(self._fetch)
        torch.empty((), dtype=torch.int64).random_(generator=generator)  # torch's base seed draw
        self._dataset, self._collate_fn, self._mode = dataset, collate_fn, mode
        self._pin, self._drop_last = pin, drop_last
        self._iterator = iter(dataset) if mode is Mode.ITERABLE else None
        self._ended = False
        self._position = 0

    def __iter__(self) -> InlineSource:
        return self

    def __next__(self) -> ShippedTuple | Failed:
        indices = next(self._sampler_iter)
        try:
            if self._iterator is not None:
                if self._ended:
                    raise StopIteration
                out = next_iterable(self._iterator, indices, self._collate_fn, self._drop_last)
                if out is None:
                    self._ended = True
                    raise StopIteration
                self._position += out[1]
            else:
                out = self._fetch(self._dataset, indices, self._collate_fn, self._mode)
            if self._pin:
                out = pin_out(out)
            return out
        except StopIteration:
            raise
        except Exception as exc:
            where = indices if self._iterator is None else f"stream position {self._position}"
            return Failed(exc, None, where)
