"""The loader's iterator with ``on_error="skip"`` (the rule: ``feedpipe.loader.skip``)."""

from __future__ import annotations

from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.loader.fetch import ALL_BAD, Skipped
from feedpipe.loader.iterator import LoaderIter
from feedpipe.loader.skip import SKIP_LIMIT

__all__ = ["SkippingLoaderIter"]


class SkippingLoaderIter(LoaderIter):
    """The loader's iterator with ``on_error="skip"``: passes over all-bad batches and counts
    the known-bad samples the index stream dropped (they count as consumed, not delivered)."""

    _good = 0  # batches this pass delivered
    _bad = 0  # samples this pass skipped or dropped as known bad

    def __next__(self) -> Any:
        stream = self._loader._stream
        while True:
            n = self._delivered
            try:
                batch = LoaderIter.__next__(self)
            except StopIteration:
                self._refuse_all_bad()
                raise
            dropped = stream.dropped.pop(n, 0) if stream is not None else 0
            if dropped:
                self._epoch.samples += dropped
                self._meter.add_skipped(dropped)
                self._bad += dropped
            if batch is not ALL_BAD:
                self._good += 1
                return batch

    def _refuse_all_bad(self) -> None:
        """An epoch whose every sample failed is an error, not an empty epoch: a wrong path or
        format would otherwise train on nothing, epoch after epoch, without a word."""
        if self._good or not self._bad or self._first:  # _first: resumed mid-epoch
            return
        known = sorted(self._loader._skipped_seen)
        raise DatasetError(
            f"on_error='skip': every sample of the epoch failed ({self._bad} skipped, e.g. "
            f"indices {known[:8]}); the dataset cannot be read at all (its errors were skipped: "
            "run with on_error='raise' to see them)"
        )

    def _skips(self, record: Skipped) -> Any:
        """Record a delivered batch's dropped samples; its inner record (None: all failed)."""
        loader = self._loader
        seen = loader._skipped_seen
        for i in record.skipped:
            if i not in seen:
                seen.add(i)
                if len(seen) > SKIP_LIMIT:
                    raise DatasetError(
                        f"on_error='skip' has skipped more than {SKIP_LIMIT} distinct samples "
                        f"(the latest: {record.skipped[:8]}): repair the data instead"
                    )
        self._bad += len(record.skipped)
        self._epoch.skipped.extend(record.skipped)
        self._epoch.samples += len(record.skipped)
        self._meter.add_skipped(len(record.skipped))
        if record.shipped is None:
            self._count(0)
            return ALL_BAD
        return record.shipped
