"""What ``iter(feedpipe.DataLoader)`` returns: :class:`LoaderIter`, which runs one
:class:`~feedpipe.loader.loader_pass.Pass` through the per-batch pipeline of
``feedpipe.loader.pipeline`` (fetch, failure policy, timing, device hand-off, finalise) and
turns a dead or failing worker into a ``WorkerError`` raised inside ``next()`` (never
asynchronously).

The iterator owns its pass and the steps; it reads of the loader only public attributes
(``meter``, ``persistent_workers``, ``dataset``, ``len()``), and the loader holds no reference
to it: dropping the iterator ends a pass's workers at once (``__del__``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import ALL_BAD, Failed, Skipped
from feedpipe.loader.loader_pass import Pass
from feedpipe.loader.pipeline import (
    Explain,
    FailurePolicy,
    Fetch,
    Finalise,
    Handoff,
    Timing,
    dead_workers,
    dying,
)

__all__ = ["LoaderIter", "dead_workers", "dying"]


class LoaderIter:
    """What ``iter(loader)`` returns: one pass through the per-batch pipeline."""

    def __init__(
        self,
        loader: Any,  # the feedpipe.DataLoader (a layer above: not imported here)
        pass_: Pass,
        started: float | None = None,
        len_called: Any = None,
    ) -> None:
        self._loader = loader
        self._pass = pass_
        self._feed = pass_.feed
        self._fetch = Fetch(pass_, Explain(pass_, loader.timeout))
        if pass_.feed is not None:
            pull = weakref.WeakMethod(self._fetch.for_feed)  # no cycle: dies with the iterator
            pass_.feed.pull = lambda: pull()()  # type: ignore[misc]  # noqa: PLW0108
        self._policy = self._make_policy(loader)
        meter = self._meter = loader.meter
        meter.set_settings(loader.persistent_workers, loader.prefetch_factor)  # for the hint
        self._timing = Timing(meter, shared=bool(getattr(pass_.source, "shared_clock", False)))
        # steps that do nothing this pass are skipped (None): no device clock, no shared slots
        handoff = Handoff(meter, pass_.feed)
        self._handoff = handoff if handoff.active else None
        finalise = Finalise(pass_.slots)
        self._finalise = finalise.host if pass_.slots is not None else None
        self._in_pass = True  # until StopIteration or drop: the meter's clock is not "outside"
        meter.pass_begin(started)
        # torch's iterator warns when an IterableDataset yields more than its len(); ours too
        self._len_called = len_called
        tuner = getattr(loader, "tuner", None)  # num_workers="auto": its workers' CPU
        pids = _torch_compat.worker_pids(pass_.source) if tuner is not None else []
        self._tick = tuner.watch(pids) if tuner is not None and pids else None

    def _make_policy(self, loader: Any) -> FailurePolicy:
        """Step 2 of the pipeline: what a failed or partly skipped batch becomes."""
        return FailurePolicy(self._pass)

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        timing, handoff = self._timing, self._handoff
        # device idle for input spans all of next(): from here (the stream's work so far ends)
        # to the hand-off at the end (feedpipe.stall.device)
        mark = handoff.begin() if handoff is not None else None
        t0 = timing.begin()
        try:
            on_device, shipped = self._fetch()
        except StopIteration:
            if handoff is not None:
                handoff.cancel(mark)
            self._pass.end()
            timing.unfinished(t0)  # the step before this wait still counts
            self._end_pass()
            raise
        except Exception:
            if handoff is not None:
                handoff.cancel(mark)
            timing.unfinished(t0)
            raise
        t1 = timing.now()
        if type(shipped) is Failed:
            self._cancel(mark)
            timing.unfinished(t0)
            error: BaseException | None = self._policy.failure(shipped)
            shipped = None
            assert error is not None
            try:
                raise error
            finally:  # break the frame <-> traceback cycle so the workers shut down promptly
                error = None
        if type(shipped) is Skipped:  # on_error="skip" (feedpipe.loader.skip_iter)
            shipped = self._policy.skipped(shipped)
            if shipped is ALL_BAD:  # no batch: the caller waits on (a new wait, no count)
                self._cancel(mark)
                timing.no_batch()
                return shipped
        batch, samples = timing.record(shipped, t0, t1)
        self._pass.count(samples)
        if self._tick is not None:
            self._tick()
        if self._len_called is not None:
            self._check_len()
        if self._feed is not None:
            if handoff is not None:  # the last thing next() does: the batch is the caller's
                handoff.end(mark, on_device)
            return on_device
        finalise = self._finalise
        return batch if finalise is None else finalise(batch)

    def _cancel(self, mark: Any) -> None:
        """No batch for the device: give the hand-off's first event back (if any)."""
        if self._handoff is not None:
            self._handoff.cancel(mark)

    def _check_len(self) -> None:
        """torch's warning: an IterableDataset yielded more than its reported ``len()``."""
        if self._pass.delivered > self._len_called:
            warnings.warn(
                f"Length of IterableDataset {self._loader.dataset} was reported to be "
                f"{self._len_called} (when accessing len(dataloader)), but "
                f"{self._pass.delivered} samples have been fetched. ",
                stacklevel=3,
            )

    def _end_pass(self) -> None:
        """Tell the meter this pass is over (once): time until the next pass is outside."""
        if self._in_pass:
            self._in_pass = False
            self._meter.pass_end()

    def __del__(self) -> None:
        if getattr(self, "_in_pass", False):  # dropped mid-pass (break)
            try:
                self._end_pass()
            except Exception:  # interpreter shutdown: the counters no longer matter
                pass
        if getattr(self, "_feed", None) is not None:  # abandoned: turn its workers away
            self._feed.close()  # type: ignore[union-attr]
        loader = getattr(self, "_loader", None)
        if loader is not None and not loader.persistent_workers:  # this pass's processes
            try:
                _torch_compat.end_workers(self._pass.source)  # bounded, also with a worker stuck
            except Exception:  # interpreter shutdown: the exit hook ends them
                pass
