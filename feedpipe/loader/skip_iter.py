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

    def __next__(self) -> Any:
        stream = self._loader._stream
        while True:
            n = self._delivered
            batch = LoaderIter.__next__(self)
            dropped = stream.dropped.pop(n, 0) if stream is not None else 0
            if dropped:
                self._epoch.samples += dropped
                self._meter.add_skipped(dropped)
            if batch is not ALL_BAD:
                return batch

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
        self._epoch.skipped.extend(record.skipped)
        self._epoch.samples += len(record.skipped)
        self._meter.add_skipped(len(record.skipped))
        if record.shipped is None:
            self._count(0)
            return ALL_BAD
        return record.shipped
