"""``feedpipe.DataLoader``: torch's DataLoader, plus thread workers, stall counters and resume.

Design. ``DataLoader`` subclasses ``torch.utils.data.DataLoader`` and calls its constructor, so
argument checks, errors, attributes, ``len()`` and ``isinstance`` are torch's own. Iteration:

- ``worker_type="process"`` (default, ``num_workers > 0``) runs torch's own multi-process
  iterator on an inner torch ``DataLoader`` that shares the sampler, generator and every option;
  only the dataset and ``collate_fn`` are wrapped (``_loader_fetch``) so that workers time their
  read and collation and ship those times with each batch. Batches, order, worker seeds, RNG
  draws, pinning and worker-death detection are therefore torch's, by construction.
- ``num_workers=0`` (either worker type) reads in the calling thread with ``InlineSource``: the
  same RNG draws and fetch rules as torch's single-process iterator, without its per-batch
  profiler range, so it is never slower.
- ``worker_type="thread"`` runs ``ThreadWorkers``: same index batches, same worker assignment,
  same RNG draws, but the dataset is called directly in threads (no pickling, no shared-memory
  copy). It pays off for reads that release the GIL.
- Either way, index batches come from ``IndexStream`` (``feedpipe.loader.index_stream``):
  torch's batches and RNG draws, generated vectorised for torch's own samplers; it records the
  indices in flight (for error messages) and can skip the first ``k`` index batches of an
  epoch without loading any data: resume is arithmetic on the sampler, never a replay.
- Stall counters: two clock reads and one ``meter.record_batch`` per batch; with
  ``StallMeter(enabled=False)`` no clock is read at all.

The class is three objects (``feedpipe.loader.plan`` says what each owns): the frozen
``LoaderPlan`` its arguments resolve to, a ``Pass`` per ``iter()`` and the per-batch pipeline
its iterator runs; beside them ``WorkerSources`` (worker handles that outlive a pass) and
``Resume`` (the pending state, the RNG replay and the skip ledger).

Datasets with ``read_batch(indices, out=None)`` are read with one call per batch and no
collation (when ``collate_fn`` is the default); datasets with ``__getitems__`` get one call per
batch, then ``collate_fn``, as in torch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.data as tud

from feedpipe.device.direct import DirectReader
from feedpipe.device.feed import GPUFeed
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import get_worker_info
from feedpipe.loader.iterator import LoaderIter
from feedpipe.loader.loader_pass import Epoch, Pass
from feedpipe.loader.plan import (
    LoaderOptions,
    LoaderPlan,
    auto_worker_type,
    resolve_plan,
    settings_of,
)
from feedpipe.loader.resume import (
    Resume,
    rng_now,
    sampler_state,
    stateful_sampler,
    warn_uncaptured,
)
from feedpipe.loader.rng_state import RngChain, RngStates, order
from feedpipe.loader.skip import SkipLedger
from feedpipe.loader.skip_iter import SkippingLoaderIter
from feedpipe.loader.slots import Slots
from feedpipe.loader.sources import WorkerSources, dataset_epoch
from feedpipe.loader.state_check import STATE_VERSION, check_state
from feedpipe.loader.threads import note_iter
from feedpipe.loader.tuner import tuner_for
from feedpipe.stall import StallMeter, StallStats

__all__ = ["DataLoader", "auto_worker_type", "get_worker_info"]

_perf = time.perf_counter

#: what a copy or pickle leaves out (``DataLoader.__getstate__``): made anew from the arguments
_LIVE = frozenset({"meter", "_plan", "_sources", "_settings"})
_METER_ON = "_meter_enabled"


class DataLoader(tud.DataLoader):  # type: ignore[type-arg]
    """A drop-in ``torch.utils.data.DataLoader`` (same arguments, batches and errors).

    Extra keyword-only arguments:
      worker_type: ``"process"`` (torch's workers), ``"thread"`` (a thread pool that calls the
        dataset directly; for GIL-releasing reads) or ``"auto"`` (:func:`auto_worker_type`:
        threads for a ``read_batch`` dataset with default collation, processes otherwise).
        Inside thread workers torch's ``get_worker_info()`` and ``feedpipe.get_worker_info()``
        return the thread's info; there is no per-thread global RNG (``feedpipe.loader.threads``
        warns, docs/migration).
      cpu_budget: ``num_workers``/``prefetch_factor``/``worker_type="auto"`` are measured
        (docs/autotune.md, ``loader.tuning``) within this share of the cores (default 0.4).
      meter: a ``feedpipe.StallMeter`` to count into (one is created per loader if None);
        ``loader.meter`` and ``loader.stats`` expose it; ``StallMeter(enabled=False)`` turns
        the counters off (the loader then reads no clock at all).
      device: ``"cuda"``/``"cuda:N"``: batches arrive already on that device, through a fixed
        ring of pinned slots (thread workers read straight into them) and a side CUDA stream
        (``feedpipe.gpu``); ``loader.feed_info`` reports the ring. ``"cpu"``, or ``"cuda"``
        without CUDA (one warning): the batches of a loader without ``device``, by its path.
        Without it, ``pin_memory`` keeps torch's meaning.
      prefetch: with ``device``, batches copied to the device ahead of the one returned
        (default 2); they count as delivered (``state_dict``) only when returned.
      direct: with ``device`` on CUDA, read a ``MemmapDataset`` of fixed-size records by DMA
        straight from the page cache into device memory (no host gather;
        ``feedpipe.device.direct``).
        ``None`` (default): when it applies (default collation, local shards, ``read`` not
        ``"pread"``, and the data fits in half the available memory, as its pages stay locked
        while open); workers are then threads (``worker_init_fn`` of process workers turns it
        off), at most one (it only issues copies). ``False``: never. ``True``: a ``ValueError``
        says why when it cannot. Records under 2 KiB take the ring unless ``direct=True``.

    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch exactly (like torchdata's
    StatefulDataLoader): the state is small and JSON-able. Resume re-creates the epoch's index
    order from the saved RNG states (every generator along the sampler chain;
    see ``feedpipe.loader.rng_state``) or the stateful sampler's own state, and skips the delivered
    index batches without reading them. It never changes the global torch RNG. A loader whose order
    differs (samplers, batch size, dataset length) refuses the state. Per-worker randomness
    inside ``__getitem__`` (from the worker seed) is not replayed: derive augmentations from the
    index/epoch for exact resume.
    """

    def __init__(  # noqa: PLR0917 - torch's positional signature
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | str | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_type: str = "process",
        meter: StallMeter | None = None,
        device: str | torch.device | None = None,
        prefetch: int = 2,
        direct: bool | None = None,
        on_error: str = "raise",
        cpu_budget: float | None = None,
    ) -> None:
        # "auto" settings (feedpipe.loader.tuner): torch's checks see the starting values
        args = (num_workers, prefetch_factor, worker_type, cpu_budget)
        tuned = tuner_for(dataset, *args, collate_fn, worker_init_fn)
        self.tuner, num_workers, prefetch_factor, worker_type = tuned
        # before torch's checks: threads are not processes
        self._options = LoaderOptions(worker_type, on_error, device, prefetch, direct)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.meter = meter if meter is not None else StallMeter()
        self._resume = Resume()
        self._epoch = Epoch()  # where the current epoch stands (a fresh one per iter())
        self._epochs_warned = False
        self._replan(self._options)

    # ------------------------------------------------------------- settings (assignable)
    @property
    def worker_type(self) -> str:
        """``"process"`` or ``"thread"``; assigning one (or ``"auto"``) applies from the next
        ``iter()``, as torch's assignable attributes do (checked now, as in the constructor)."""
        return self._options.worker_type

    @worker_type.setter
    def worker_type(self, value: str) -> None:
        if value == "auto":
            value = auto_worker_type(self.dataset, self.collate_fn, self.worker_init_fn)
        self._assign(worker_type=value)

    @property
    def on_error(self) -> str:
        """The failure policy, ``"raise"`` or ``"skip"``; assignable (as ``worker_type``)."""
        return self._options.on_error

    @on_error.setter
    def on_error(self, value: str) -> None:
        self._assign(on_error=value)

    @property
    def device(self) -> str | torch.device | None:
        """Where batches arrive (``device`` argument); assignable (as ``worker_type``)."""
        return self._options.device

    @device.setter
    def device(self, value: str | torch.device | None) -> None:
        self._assign(device=value)

    def _assign(self, **change: Any) -> None:
        """Assign feedpipe arguments: re-resolve the plan now (raising as the constructor
        does, the loader left as it was), used from the next ``iter()``."""
        options = dataclasses.replace(self._options, **change)
        if options != self._options:
            self._replan(options)

    def _replan(self, options: LoaderOptions) -> None:
        """Resolve ``options`` and torch's settings into a fresh plan and worker sources."""
        plan = resolve_plan(self, options.worker_type, options.on_error, self.meter, options.path())
        if plan.stream is not None:
            plan.stream.on_start = weakref.WeakMethod(self._at_sampler_start)
        # the old plan's persistent workers serve a pass in progress to its end: stopped when
        # the next pass starts (or the loader goes)
        old: WorkerSources | None = vars(self).get("_sources")
        self._options, self._plan = options, plan
        self._sources = WorkerSources(plan, retired=old)
        self._settings = settings_of(self)

    # ------------------------------------------------------------------- copy and pickle
    def __getstate__(self) -> dict[str, Any]:
        """What a copy or pickle holds: arguments and resume state; not the meter's locks, the
        plan or live workers (``__setstate__`` makes them anew)."""
        state = {k: v for k, v in vars(self).items() if k not in _LIVE}
        state["_iterator"] = None  # torch's own (persistent workers): not copied either
        state[_METER_ON] = self.meter.enabled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        enabled = state.pop(_METER_ON)
        vars(self).update(state)
        vars(self)["meter"] = StallMeter(enabled=enabled)
        self._replan(self._options)

    # ------------------------------------------------------------------------------ public
    @property
    def plan(self) -> LoaderPlan:
        """What this loader's arguments resolved to (``feedpipe.loader.plan``)."""
        return self._plan

    @property
    def skip_ledger(self) -> SkipLedger:
        """``on_error="skip"``: the samples skipped so far (``feedpipe.loader.skip``)."""
        return self._resume.ledger

    def check_worker_number_rationality(self) -> None:
        """torch's warning about too many worker *processes*; thread workers are not processes."""
        if self.worker_type != "thread":
            super().check_worker_number_rationality()

    @property
    def tuning(self) -> dict[str, Any] | None:
        """The ``"auto"`` settings now, the CPU budget and the decision log (``Tuner.view``)."""
        return None if self.tuner is None else self.tuner.view()

    @property
    def stats(self) -> StallStats:
        """A snapshot of the stall counters (``loader.meter.stats()``): totals and rates.

        An attribute, like ``ckpt.CheckpointManager.stats``; the meter's is a method.
        """
        return self.meter.stats()

    @property
    def feed_info(self) -> dict[str, Any] | None:
        """The GPU feed's device, path (``"direct"`` DMA or pinned ``"ring"``), slot count and
        pinned bytes (None without ``device``)."""
        return self._plan.feed_info()

    @property
    def worker_slots(self) -> dict[str, Any] | None:
        """Process workers collating into reused shared-memory slots: slots per worker, batches
        delivered from slots and batches that fell back to torch's path (None when off).

        On when workers are processes, the dataset is map-style, ``collate_fn`` is torch's
        ``default_collate`` and the batch goes to a CUDA ``device`` or stays unpinned on the
        host; ``FEEDPIPE_WORKER_SLOTS=0`` (or ``false``, ``no``, ``off``) turns it off."""
        slots = self._sources.slots
        count = self._plan.slot_count(self)
        if slots is None and not count:
            return None
        if slots is None:  # on, before the first pass
            slots = Slots(pin=self._plan.feed_on_gpu())
        return {
            "slots_per_worker": count,
            "pinned": slots.pin,
            "batches_in_slots": slots.resolved,
            "batches_fallback": slots.fallback,
        }

    def __iter__(self) -> LoaderIter:  # type: ignore[override]
        # for the meter: starting a later pass's workers is input time (no clock when off)
        started = _perf() if self.meter.enabled else None
        note_iter()  # seed draws follow: thread workers' RNG checks must not blame them
        if self.tuner is not None:  # this pass's settings (a change replans below)
            self.tuner.apply(self)
        if settings_of(self) != self._settings:  # torch's settings assigned since the last plan
            self._replan(self._options)
        plan = self._plan
        self._sources.check_epoch(self)
        self._warn_epochs()
        self._begin_epoch()
        # worker stages run this many at a time (the direct path runs at most one)
        self.meter.set_workers(plan.concurrent_workers(self.num_workers), plan.worker_kind())
        feed = None if plan.feed is None else plan.feed.prefetcher()
        plan.prepare_stream(self)
        source = self._sources.open(self, feed, self._seed_generator)
        own = self.num_workers == 0 or plan.threads
        window = (self.prefetch_factor or 1) * max(1, self.num_workers)
        pass_ = Pass(
            self._epoch,
            source,
            feed=feed,
            stream=plan.stream,
            slots=None if own else self._sources.slots,
            lag=0 if self.in_order else 4 * window + 4,
        )
        len_called = _torch_compat.len_called(self) if own and plan.iterable else None
        kind = SkippingLoaderIter if plan.skip else LoaderIter
        return kind(self, pass_, started, len_called)

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-able state: where the current epoch stands and how to regenerate it.

        Warns (``RuntimeWarning``) when a sampler draws from an RNG that the state cannot hold,
        naming it: a resume would not reproduce its order."""
        epoch = self._epoch
        pending = self._pending_state()
        if pending is not None:
            return pending
        if not self.in_order and self.num_workers > 0:
            raise ValueError(
                "state_dict() needs in_order=True: out-of-order delivery is not resumable"
            )
        chain = RngChain.of(self)
        warn_uncaptured(chain.problems + sorted(self._resume.uncaptured))
        active = epoch.active and epoch.rng is not None
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "in_epoch": active,
            "batches": epoch.batches if active else 0,
            "samples": epoch.samples if active else 0,
            "rng": epoch.rng.text() if epoch.rng is not None and active else rng_now(chain),
            # where the RNG state applies: just before the sampler's first draw, or at iter()
            # (which may first draw the workers' base seed, as torch does)
            "rng_at": "sampler" if epoch.active or self._sources.reuses_workers(self) else "iter",
            "order": order(self),
        }
        if self._plan.skip:
            state["skipped"] = self._resume.ledger.state(active, epoch.skipped)
        sampler = stateful_sampler(self)
        if sampler is not None:
            state["sampler"] = sampler_state(sampler, epoch)
        if self._plan.iterable:
            state["dataset"] = self._dataset_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter(loader)``.

        Explicit generators (``generator=``, a sampler's ``.generator``) are set back to the
        saved epoch's state; the global torch RNG is never changed
        (see ``feedpipe.loader.rng_state``).
        """
        check_state(
            state,
            generators=sorted(RngChain.of(self).generators),
            has_sampler_state=stateful_sampler(self) is not None,
            iterable=self._plan.iterable,
            epoch_batches=self._epoch_batches,
            current_order=order(self),
        )
        if state.get("rng_at") == "iter" and self._sources.reuses_workers(self):
            self._replan(self._options)  # saved before the workers started: start them anew
        # Stateful parts load now (a user's set_epoch() after this sees the loaded epoch); the
        # RNG state and the skip apply at the next iter(), where torch draws from the RNG.
        sampler = stateful_sampler(self)
        if sampler is not None and "sampler" in state:
            sampler.load_state_dict(state["sampler"])
        if self._plan.iterable:
            self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        self._resume.pending = dict(state)

    # --------------------------------------------------------------------------- internals
    @property
    def _feed(self) -> GPUFeed | None:
        return self._plan.feed

    @property
    def _direct(self) -> DirectReader | None:
        return self._plan.direct

    def _pending_state(self) -> dict[str, Any] | None:
        """The state a pass stands at before its sampler drew: a loaded one not applied yet,
        or (``iter()`` without a ``next()`` yet) the one it resumed from; else None."""
        pending = self._resume.pending
        epoch = self._epoch
        if pending is None and epoch.active and epoch.rng is None:  # iter(), no next() yet:
            pending = epoch.resumed  # the resumed state, or the epoch boundary (None)
        return None if pending is None else dict(pending)

    def _dataset_state(self) -> Any:
        """An ``IterableDataset``'s position, for the state (refused where it cannot resume)."""
        if not callable(getattr(self.dataset, "state_dict", None)):
            raise ValueError(
                f"cannot save the position of {type(self.dataset).__name__}: an "
                "IterableDataset is resumable only if it has state_dict()/load_state_dict()"
            )
        if self.num_workers > 0:
            raise ValueError(
                "resuming an IterableDataset needs num_workers=0: each worker holds its own "
                "copy of the dataset's position"
            )
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def _epoch_batches(self) -> int | None:
        """How many batches an epoch of this loader has (None where the sampler has no length)."""
        try:
            return len(_torch_compat.index_sampler(self))
        except (TypeError, NotImplementedError):
            return None

    def _begin_epoch(self) -> None:
        """Start the epoch of a pass: a fresh ``Epoch``, with a pending state (RNG, skip)
        applied (``Resume.begin``), and the index stream told what to skip and drop."""
        resume, stream = self._resume, self._plan.stream
        chain = functools.partial(RngChain.of, self)  # walked only where a pass needs it
        own_gen = self.generator is not None
        epoch = self._epoch = resume.begin(self._epoch, chain, stream is not None, own_gen)
        if stream is None:
            walked = chain()
            epoch.rng = RngStates.capture(walked)
            if resume.lent is not None and walked.global_name:
                epoch.rng.put(walked.global_name, resume.lent)
        epoch.active = True
        if stream is not None:
            stream.skip = resume.skip
            # known-bad samples are dropped only while skipping: "raise" reads (and raises) them
            stream.drop = resume.drop if self._plan.skip else frozenset()

    def _seed_generator(self) -> torch.Generator | None:
        """The generator this pass draws the workers' base seed from (torch: ``generator=``)."""
        return self._resume.seed_generator(self.generator)

    def _at_sampler_start(self) -> Callable[[Iterator[Any]], Iterator[Any]] | None:
        """Runs before the sampler's first draw of a pass (``Resume.at_sampler_start``)."""
        return self._resume.at_sampler_start(RngChain.of(self), self._epoch)

    def _warn_epochs(self) -> None:
        """Warn (once) when the sampler's epoch is not the dataset's: ``dataset.set_epoch``
        forgotten, every epoch would draw the same samples of a ``MixedDataset``."""
        ds_epoch = dataset_epoch(self.dataset)
        if ds_epoch is None or self._epochs_warned:
            return
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            epoch = getattr(sampler, "epoch", None)
            if type(epoch) is int and epoch != ds_epoch:
                self._epochs_warned = True
                warnings.warn(
                    f"the sampler is at epoch {epoch} but the {type(self.dataset).__name__} at "
                    f"epoch {ds_epoch}: call dataset.set_epoch(epoch) beside sampler.set_epoch("
                    "epoch), or every epoch draws the same samples",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
