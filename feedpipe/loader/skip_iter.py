"""The loader's iterator with ``on_error="skip"`` (the rule: ``feedpipe.loader.skip``).

:class:`SkipPolicy` is step 2 of the per-batch pipeline (``feedpipe.loader.pipeline``) for this
policy: it records a delivered batch's dropped samples in the loader's
:class:`~feedpipe.loader.skip.SkipLedger` and the pass's epoch, and counts the known-bad samples
the index stream took out. :class:`SkippingLoaderIter` reads on past batches whose every sample
failed, and refuses an epoch in which every sample failed.
"""

from __future__ import annotations

from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.loader.fetch import ALL_BAD, Skipped
from feedpipe.loader.iterator import LoaderIter
from feedpipe.loader.loader_pass import Pass
from feedpipe.loader.pipeline import FailurePolicy
from feedpipe.loader.skip import SKIP_LIMIT, SkipLedger
from feedpipe.stall import StallMeter

__all__ = ["SkipPolicy", "SkippingLoaderIter"]


class SkipPolicy(FailurePolicy):
    """Step 2 with ``on_error="skip"``: dropped samples are recorded and counted."""

    def __init__(self, pass_: Pass, ledger: SkipLedger, meter: StallMeter) -> None:
        super().__init__(pass_)
        self._ledger, self._meter = ledger, meter
        self.good = 0  # batches this pass delivered
        self.bad = 0  # samples this pass skipped or dropped as known bad

    def skipped(self, record: Skipped) -> Any:
        """Record a delivered batch's dropped samples; its inner record (ALL_BAD: all failed)."""
        if self._ledger.add(record.skipped, SKIP_LIMIT):
            raise DatasetError(
                f"on_error='skip' has skipped more than {SKIP_LIMIT} distinct samples "
                f"(the latest: {record.skipped[:8]}): repair the data instead"
            )
        self.bad += len(record.skipped)
        self._pass.skip(record.skipped)
        self._meter.add_skipped(len(record.skipped))
        if record.shipped is None:
            self._pass.count(0)
            return ALL_BAD
        return record.shipped

    def dropped(self, batch: int) -> None:
        """Count the known-bad samples the stream took out of the pass's ``batch``-th batch."""
        dropped = self._pass.take_dropped(batch)
        if dropped:
            self._meter.add_skipped(dropped)
            self.bad += dropped

    def refuse_all_bad(self) -> None:
        """An epoch whose every sample failed is an error, not an empty epoch: a wrong path or
        format would otherwise train on nothing, epoch after epoch, without a word."""
        if self.good or not self.bad or self._pass.first:  # first: resumed mid-epoch
            return
        raise DatasetError(
            f"on_error='skip': every sample of the epoch failed ({self.bad} skipped, e.g. "
            f"indices {self._ledger.seen_sample(8)}); the dataset cannot be read at all (its "
            "errors were skipped: run with on_error='raise' to see them)"
        )


class SkippingLoaderIter(LoaderIter):
    """The loader's iterator with ``on_error="skip"``: passes over all-bad batches and counts
    the known-bad samples the index stream dropped (they count as consumed, not delivered)."""

    _policy: SkipPolicy

    def _make_policy(self, loader: Any) -> SkipPolicy:
        return SkipPolicy(self._pass, loader.skip_ledger, loader.meter)

    def __next__(self) -> Any:
        policy = self._policy
        while True:
            n = self._pass.delivered
            try:
                batch = LoaderIter.__next__(self)
            except StopIteration:
                policy.refuse_all_bad()
                raise
            policy.dropped(n)
            if batch is not ALL_BAD:
                policy.good += 1
                return batch
