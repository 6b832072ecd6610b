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
- Either way, index batches come from ``IndexStream`` (``_index_batches``): torch's batches
  and RNG draws, generated vectorised for torch's own samplers; it records the indices in
  flight (for error messages) and can skip the first ``k`` index batches of an epoch without
  loading any data: resume is arithmetic on the sampler, never a replay.
- Stall counters: two clock reads and one ``meter.record_batch`` per batch; with
  ``StallMeter(enabled=False)`` no clock is read at all.

Datasets with ``read_batch(indices, out=None)`` are read with one call per batch and no
collation (when ``collate_fn`` is the default); datasets with ``__getitems__`` get one call per
batch, then ``collate_fn``, as in torch.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data import default_collate, default_convert

from feedpipe.device import direct as _direct
from feedpipe.device.direct import DirectReader
from feedpipe.device.feed import GPUFeed, Prefetcher
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import (
    IterProxy,
    MapProxy,
    Mode,
    TimedCollate,
    WorkerInit,
    choose_mode,
    get_worker_info,
)
from feedpipe.loader.index_stream import IndexStream
from feedpipe.loader.iterator import LoaderIter
from feedpipe.loader.rng_state import RngChain, Watch, encode, global_state, order, private, replay
from feedpipe.loader.skip import ON_ERROR, SkipMapProxy, SkipTimedCollate
from feedpipe.loader.skip_iter import SkippingLoaderIter
from feedpipe.loader.slots import Slots, slot_rows
from feedpipe.loader.slots import enabled as slots_enabled
from feedpipe.loader.state_check import STATE_VERSION, check_state
from feedpipe.loader.threads import (
    InlineSource,
    RNGWatch,
    ThreadWorkers,
    note_iter,
)
from feedpipe.protocols import AccessPlanDataset, BatchDataset, IndexArrayDataset
from feedpipe.stall import StallMeter, StallStats

__all__ = ["DataLoader", "auto_worker_type", "get_worker_info"]

_perf = time.perf_counter
_WORKER_TYPES = ("process", "thread")


class _Epoch:
    """Where the current epoch stands: updated per batch (a plain object, cheap to write)."""

    __slots__ = ("active", "batches", "resumed", "rng", "samples", "skipped")

    def __init__(self) -> None:
        self.active = False
        self.batches = 0  # batches delivered this epoch (including before a resume)
        self.samples = 0  # samples delivered this epoch (including before a resume)
        self.rng: dict[str, str] | None = None  # RNG states at the start of the epoch
        self.resumed: dict[str, Any] | None = None  # the state this pass resumes from
        self.skipped: list[int] = []  # on_error="skip": indices dropped this epoch, delivered


def auto_worker_type(dataset: Any, collate_fn: Any, worker_init_fn: Any) -> str:
    """What ``worker_type="auto"`` picks: ``"thread"`` when a batch is one ``read_batch`` call
    with torch's default collation and no ``worker_init_fn`` (feedpipe's own datasets gather
    in numpy or ``preadv``, which release the GIL), ``"process"`` otherwise (a per-sample Python
    ``__getitem__`` holds the GIL; torch's processes, with feedpipe's shared slots).

    Decided from the dataset's contract, not from timing its first batches: the choice is the
    same on every run and every rank, and no batch is read twice (docs/concepts/workers.md)."""
    if isinstance(dataset, tud.IterableDataset) or worker_init_fn is not None:
        return "process"
    if collate_fn not in (None, default_collate) or not isinstance(dataset, BatchDataset):
        return "process"
    return "thread"


class DataLoader(tud.DataLoader):  # type: ignore[type-arg]
    """A drop-in ``torch.utils.data.DataLoader`` (same arguments, batches and errors).

    Extra keyword-only arguments:
      worker_type: ``"process"`` (torch's workers), ``"thread"`` (a thread pool that calls the
        dataset directly; for GIL-releasing reads) or ``"auto"`` (:func:`auto_worker_type`:
        threads for a ``read_batch`` dataset with default collation, processes otherwise).
        Inside thread workers torch's ``get_worker_info()`` and ``feedpipe.get_worker_info()``
        return the thread's info; there is no per-thread global RNG (``feedpipe.loader.threads``
        warns, docs/migration).
      meter: a ``feedpipe.StallMeter`` to count into (one is created per loader if None);
        ``loader.meter`` and ``loader.stats`` expose it; ``StallMeter(enabled=False)`` turns
        the counters off (the loader then reads no clock at all).
      device: ``"cuda"``/``"cuda:N"``: batches arrive already on that device, through a fixed
        ring of pinned slots (thread workers read straight into them) and a side CUDA stream
        (``feedpipe.gpu``); ``loader.feed_info`` reports the ring. ``"cpu"`` or no CUDA falls
        back to host batches with one warning. Without it, ``pin_memory`` keeps torch's meaning.
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
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_type: str = "process",
        meter: StallMeter | None = None,
        device: str | torch.device | None = None,
        prefetch: int = 2,
        direct: bool | None = None,
        on_error: str = "raise",
    ) -> None:
        if worker_type == "auto":
            worker_type = auto_worker_type(dataset, collate_fn, worker_init_fn)
        self.worker_type = worker_type  # before torch's checks: threads are not processes
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
        if worker_type not in _WORKER_TYPES:
            raise ValueError(
                f"worker_type must be one of {(*_WORKER_TYPES, 'auto')}, got {worker_type!r}"
            )
        self.worker_type = worker_type
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if on_error == "skip" and isinstance(dataset, tud.IterableDataset):
            raise ValueError(
                "on_error='skip' needs a map-style dataset: an IterableDataset's stream has no "
                "sample index to skip deterministically (catch errors inside its __iter__)"
            )
        self.on_error = on_error
        self._known_bad: set[int] = set()  # skipped in earlier epochs: never read again
        self._skipped_seen: set[int] = set()  # every index skipped (bounded: SKIP_LIMIT)
        self.meter = meter if meter is not None else StallMeter()
        self._feed: GPUFeed | None = None
        if device is not None:
            threads = worker_type == "thread" and num_workers > 0
            self._feed = GPUFeed(
                device,
                prefetch=prefetch,
                fillers=(prefetch_factor or 2) * num_workers if threads else 0,
                batch_size=batch_size,
                meter=self.meter,
            )
            if self._feed.on_gpu and self.meter.enabled:  # device idle for input (CUDA events)
                self.meter.watch_device(self._feed.device)
        self._iterable = isinstance(self.dataset, tud.IterableDataset)
        self._stream = None if self._iterable else IndexStream(_torch_compat.index_sampler(self))
        if self._stream is not None:
            self._stream.on_start = weakref.WeakMethod(self._at_sampler_start)
        # a pending resume's RNG replay (feedpipe.loader.rng_state): states to set at the sampler's
        # first draw, a state to lend the global RNG then, a private base-seed generator
        self._restore_rng: dict[str, str] | None = None
        self._lend: str | torch.Generator | None = None
        self._seed_gen: torch.Generator | None = None
        self._uncaptured: set[str] = set()  # RNG draws the state cannot hold (state_dict warns)
        # read_batch stands in for default_collate only: with batch_size set, a user's explicit
        # collate_fn=default_convert gets torch's list of samples, not a stacked batch
        default = self.collate_fn is (
            default_collate if _torch_compat.auto_collation(self) else default_convert
        )
        self._mode = choose_mode(self.dataset, _torch_compat.auto_collation(self), default)
        self._slots: Slots | None = None  # process workers' shared slots (feedpipe.loader.slots)
        self._inner: tud.DataLoader | None = None  # type: ignore[type-arg]
        self._workers_epoch: Any = None  # the dataset's epoch when the worker processes started
        self._thread_seeded = False
        self._direct: DirectReader | None = None
        if self._feed is not None:
            self._direct = self._choose_direct(direct)
        elif direct:
            raise ValueError("direct=True needs device='cuda' (or 'cuda:N')")
        # resume bookkeeping for the current epoch
        self._epoch = _Epoch()
        self._pending: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------ public
    def check_worker_number_rationality(self) -> None:
        """torch's warning about too many worker *processes*; thread workers are not processes."""
        if getattr(self, "worker_type", "process") != "thread":
            super().check_worker_number_rationality()

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
        if self._feed is None:
            return None
        return {**self._feed.info, "path": "ring" if self._direct is None else "direct"}

    @property
    def worker_slots(self) -> dict[str, Any] | None:
        """Process workers collating into reused shared-memory slots: slots per worker, batches
        delivered from slots and batches that fell back to torch's path (None when off).

        On when workers are processes, the dataset is map-style, ``collate_fn`` is torch's
        ``default_collate`` and the batch goes to a CUDA ``device`` or stays unpinned on the
        host; ``FEEDPIPE_WORKER_SLOTS=0`` (or ``false``, ``no``, ``off``) turns it off."""
        slots = self._slots
        count = self._slot_count()
        if slots is None and not count:
            return None
        if slots is None:  # on, before the first pass
            slots = Slots(pin=self._feed is not None and self._feed.on_gpu)
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
        self._check_worker_epoch()
        self._warn_epochs()
        self._begin_epoch()
        # worker stages run this many at a time (the direct path runs at most one)
        self.meter.set_workers(
            self.num_workers if self._direct is None else min(self.num_workers, 1),
            "thread" if self._threads else "process",
        )
        feed = None if self._feed is None else self._feed.prefetcher()
        if self._stream is not None:  # our own sources, into a dataset that takes arrays
            own = self.num_workers == 0 or self._threads
            self._stream.arrays = (
                own and self._mode is Mode.READ_BATCH and _takes_arrays(self.dataset)
            )
            # the future order, for a dataset that reads in this process (e.g. Belady eviction)
            planned = own and self._mode is Mode.READ_BATCH
            ds = self.dataset
            self._stream.planner = ds if planned and isinstance(ds, AccessPlanDataset) else None
        if self.num_workers == 0:
            source: Any = self._inline_source()
        elif self._threads:
            source = self._thread_source(feed)
        else:
            source = self._process_source()
        kind = SkippingLoaderIter if self.on_error == "skip" else LoaderIter
        return kind(self, source, feed, started)

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-able state: where the current epoch stands and how to regenerate it.

        Warns (``RuntimeWarning``) when a sampler draws from an RNG that the state cannot hold,
        naming it: a resume would not reproduce its order."""
        epoch = self._epoch
        # iter() without a next() yet: the sampler has not drawn, so the pass stands where its
        # start left it: the resumed state, or the epoch boundary (with the base seed drawn)
        fresh = epoch.active and epoch.rng is None
        pending = self._pending if self._pending is not None else epoch.resumed if fresh else None
        if pending is not None:
            return dict(pending)
        if not self.in_order and self.num_workers > 0:
            raise ValueError(
                "state_dict() needs in_order=True: out-of-order delivery is not resumable"
            )
        chain = RngChain.of(self)
        problems = chain.problems + sorted(self._uncaptured)
        if problems:
            warnings.warn(
                "DataLoader.state_dict() cannot hold every RNG that decides the order: "
                f"{'; '.join(problems)}. A resume from this state will not reproduce the order "
                "(with thread workers, a dataset drawing from a global RNG while the sampler "
                "draws is reported here too). "
                "Give the sampler a torch.Generator as `.generator` (and draw only from it), or "
                "state_dict()/load_state_dict() methods.",
                RuntimeWarning,
                stacklevel=2,
            )
        active = epoch.active and not fresh
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "in_epoch": active,
            "batches": epoch.batches if active else 0,
            "samples": epoch.samples if active else 0,
            "rng": epoch.rng if active else self._rng_now(chain),
            # where the RNG state applies: just before the sampler's first draw, or at iter()
            # (which may first draw the workers' base seed, as torch does)
            "rng_at": "sampler" if epoch.active or self._reuses_workers() else "iter",
            "order": order(self),
        }
        if self.on_error == "skip":
            state["skipped"] = self._skip_state(active)
        sampler = self._stateful_sampler()
        if sampler is not None:
            sub = dict(sampler.state_dict())
            if epoch.active:
                sub["consumed"] = epoch.samples
            elif "consumed_base" in sub:  # feedpipe's DistributedSampler at an epoch boundary:
                # the next iter() starts a fresh pass (of the same epoch unless set_epoch()
                # changes it), as torch's sampler does, whatever the last pass consumed
                sub.update(consumed=0, consumed_base=0, segment_start=0)
                sub["num_replicas"] = getattr(sampler, "num_replicas", sub["num_replicas"])
            state["sampler"] = sub
        if self._iterable:
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
            state["dataset"] = self.dataset.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter(loader)``.

        Explicit generators (``generator=``, a sampler's ``.generator``) are set back to the
        saved epoch's state; the global torch RNG is never changed
        (see ``feedpipe.loader.rng_state``).
        """
        check_state(
            state,
            generators=sorted(self._generators()),
            has_sampler_state=self._stateful_sampler() is not None,
            iterable=self._iterable,
            epoch_batches=self._epoch_batches,
            current_order=order(self),
        )
        # Stateful parts load now (a user's set_epoch() after this sees the loaded epoch); the
        # RNG state and the skip apply at the next iter(), where torch draws from the RNG.
        sampler = self._stateful_sampler()
        if sampler is not None and "sampler" in state:
            sampler.load_state_dict(state["sampler"])
        if self._iterable:
            self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        self._pending = dict(state)

    # --------------------------------------------------------------------------- internals
    def _epoch_batches(self) -> int | None:
        """How many batches an epoch of this loader has (None where the sampler has no length)."""
        try:
            return len(_torch_compat.index_sampler(self))
        except (TypeError, NotImplementedError):
            return None

    def _skip_state(self, active: bool) -> dict[str, list[int]]:
        """``on_error="skip"``'s part of the state: ``known`` (sorted indices skipped before this
        epoch, dropped unread) and ``epoch`` (skipped so far this epoch, in delivery order);
        at most ``SKIP_LIMIT`` distinct indices in all."""
        epoch = self._epoch
        if active:
            return {"known": sorted(self._known_bad), "epoch": list(epoch.skipped)}
        return {"known": sorted(self._known_bad.union(epoch.skipped)), "epoch": []}

    def _stateful_sampler(self) -> Any:
        for s in (self.sampler, getattr(self.batch_sampler, "sampler", None), self.batch_sampler):
            if callable(getattr(s, "state_dict", None)) and callable(
                getattr(s, "load_state_dict", None)
            ):
                return s
        return None

    def _generators(self) -> dict[str, torch.Generator | None]:
        """Every RNG an epoch's index order draws from, by name (``feedpipe.loader.rng_state``)."""
        return RngChain.of(self).generators

    def _rng_now(self, chain: RngChain | None = None) -> dict[str, str]:
        gens = (chain or RngChain.of(self)).generators
        return {name: encode(g) for name, g in gens.items()}

    def _set_rng(self, states: dict[str, str]) -> None:
        """Set the loader's own generators; the global RNG is the user's and is never set."""
        for name, gen in self._generators().items():
            if gen is not None and name in states:
                gen.set_state(private(states[name]).get_state())

    def _begin_epoch(self) -> None:
        """Apply a pending state (RNG, skip) at ``iter()``.

        A saved RNG state applies at one of two points (``rng_at``): just before the sampler's
        first draw (mid-epoch, or between epochs when persistent workers draw no new base seed),
        or at ``iter()``, before torch draws the workers' base seed. Either way the resumed
        epoch's index order, and the state of the loader's own generators after it, are those
        of the uninterrupted run. The global RNG's saved state is only lent to the sampler's
        first draw (mid-epoch always; at an epoch boundary when the user's global RNG is not in
        that state already, else the epoch draws from it as the uninterrupted run did).
        """
        skip = 0
        pending, self._pending = self._pending, None
        self._known_bad.update(self._epoch.skipped)  # last epoch's skips: known bad from now
        if pending is not None and "skipped" in pending:
            known, now = pending["skipped"]["known"], pending["skipped"]["epoch"]
            self._known_bad = set(known) if pending["in_epoch"] else set(known).union(now)
            self._skipped_seen = self._known_bad.union(now)
        epoch = self._epoch = _Epoch()  # a fresh object: an abandoned iterator cannot count here
        epoch.resumed = pending
        self._restore_rng, self._lend, self._seed_gen = None, None, None
        lent: str | None = None
        chain = RngChain.of(self)
        if pending is not None:
            rng = pending["rng"]
            at_sampler = pending.get("rng_at") == "sampler" and self._stream is not None
            if at_sampler:
                self._restore_rng = rng
            else:
                self._set_rng(rng)
            saved = rng.get(chain.global_name) if chain.global_name else None
            # lend mid-epoch (the draws were made before the save), or at a boundary when the
            # user's RNG is not where the saved one was (else draw from it, as saved)
            lend = saved is not None and (pending["in_epoch"] or global_state() != saved)
            if saved is None:
                pass
            elif at_sampler:  # the base seed (if any now) was not drawn there: draw it privately
                self._lend = lent = saved if lend else None
                self._seed_gen = private(saved, reseed=True)
            elif lend:  # the base seed and the sampler's draws follow from the saved state
                self._lend = self._seed_gen = private(saved)
                lent = saved
            if self.generator is not None:
                self._seed_gen = None
            if pending["in_epoch"]:
                epoch.batches, epoch.samples = int(pending["batches"]), int(pending["samples"])
                if "skipped" in pending:
                    epoch.skipped = list(pending["skipped"]["epoch"])
                if "sampler" not in pending:
                    skip = epoch.batches  # the sampler restarts from scratch: skip, don't read
        if self._stream is None:
            epoch.rng = self._rng_now(chain)
            if lent is not None and chain.global_name:
                epoch.rng[chain.global_name] = lent
        epoch.active = True
        if self._stream is not None:
            self._stream.skip = skip
            self._stream.drop = frozenset(self._known_bad)

    def _base_seed_generator(self) -> torch.Generator | None:
        """The generator this pass draws the workers' base seed from (torch: ``generator=``)."""
        gen, self._seed_gen = self._seed_gen, None
        return gen if gen is not None else self.generator

    def _reuses_workers(self) -> bool:
        """Whether the next ``iter()`` reuses persistent workers (and so draws no base seed)."""
        if not (self.persistent_workers and self.num_workers > 0):
            return False
        return self._thread_seeded if self._threads else self._inner is not None

    @property
    def _threads(self) -> bool:
        """Whether workers are threads (asked for, or the direct path's)."""
        return self.worker_type == "thread" or self._direct is not None

    def _choose_direct(self, direct: bool | None) -> DirectReader | None:
        """The direct DMA path's reader when it applies (see ``direct`` in the class doc)."""
        feed = self._feed
        assert feed is not None
        reason: str | None
        if direct is False:
            reason = "direct=False"
        elif self._mode is not Mode.READ_BATCH:
            reason = "batches are not read by the dataset's read_batch with default collation"
        elif self.worker_type == "process" and self.num_workers and self.worker_init_fn:
            reason = "process workers with a worker_init_fn (the direct path uses threads)"
        else:
            reason = _direct.blocker(self.dataset, feed.device, auto=direct is None)
        if not feed.on_gpu:
            return None  # the CPU fallback warned already
        if direct and reason is not None:
            raise ValueError(f"direct=True, but the direct DMA path cannot be used: {reason}")
        _direct.describe(self.dataset, feed.device, reason)
        if reason is not None:
            return None
        note = feed.note_copy if self.meter.enabled else None
        return _direct.DirectReader(self.dataset, feed.device, feed.copy_stream, note)

    def _at_sampler_start(self) -> Callable[[Any], Any] | None:
        """Runs before the sampler's first draw of a pass: restore, then record, the RNG.

        Returns how to wrap the pass's index iterator: lend the global RNG the saved state for
        the first draw, watch samplers of unknown classes (``feedpipe.loader.rng_state.replay``)."""
        chain = RngChain.of(self)
        if self._restore_rng is not None:
            self._set_rng(self._restore_rng)
            self._restore_rng = None
        lend, self._lend = self._lend, None
        lent = encode(lend) if isinstance(lend, torch.Generator) else lend
        self._epoch.rng = self._rng_now(chain)
        if lent is not None and chain.global_name:
            self._epoch.rng[chain.global_name] = lent
        watch = Watch(chain.custom, self._uncaptured) if chain.custom else None
        if lent is None and watch is None:
            return None
        return lambda it: replay(it, lent, watch)

    def _process_source(self) -> Any:
        if self._inner is None:
            self._inner = self._make_inner()
            # Persistent workers go when this loader goes, by refcount or by the cyclic GC (the
            # finalizer holds the inner loader, so torch's queues are intact when it runs).
            weakref.finalize(self, _torch_compat.shutdown_iterator, self._inner)
        if self._slots is not None and not self.persistent_workers:
            self._slots.forget()  # the last pass's workers are gone; live views keep their slots
        _torch_compat.set_len_called(self._inner, _torch_compat.len_called(self))
        self._workers_epoch = _dataset_epoch(self.dataset)
        self._inner.generator = self._base_seed_generator()  # torch draws the base seed from it
        if not torch.cuda.is_initialized() or _torch_compat.workers_running(self._inner):
            source = iter(self._inner)  # no fork: nothing to keep out of a child's GC
        else:
            # Forked workers inherit every object of this process, some owning CUDA handles
            # (events, memory). Were the child's cyclic GC to destroy one, it would call CUDA in
            # a forked process and abort (cudaErrorInitializationError). Freezing puts the objects
            # that exist now out of the GC's reach in the children; this process unfreezes once
            # they are started.
            gc.collect()
            gc.freeze()
            try:
                source = iter(self._inner)
            finally:
                gc.unfreeze()
        _torch_compat.adopt_workers(source)  # deaths surface in next(), never asynchronously
        return source

    def _check_worker_epoch(self) -> None:
        """Refuse to reuse persistent worker processes whose dataset copies hold another epoch.

        A dataset with ``set_epoch`` (``MixedDataset``) chooses its samples by epoch; running
        worker processes never see a ``set_epoch`` made in this process, so they would serve the
        old epoch's samples without a word."""
        epoch = _dataset_epoch(self.dataset)
        inner = self._inner
        if (
            inner is not None
            and _torch_compat.workers_running(inner)
            and epoch != self._workers_epoch
        ):
            raise ValueError(
                f"{type(self.dataset).__name__}.set_epoch({epoch!r}) cannot reach the persistent "
                f"worker processes, whose copies hold epoch {self._workers_epoch!r}: use "
                "worker_type='thread' or persistent_workers=False"
            )

    def _warn_epochs(self) -> None:
        """Warn (once) when the sampler's epoch is not the dataset's: ``dataset.set_epoch``
        forgotten, every epoch would draw the same samples of a ``MixedDataset``."""
        ds_epoch = _dataset_epoch(self.dataset)
        if ds_epoch is None or getattr(self, "_epochs_warned", False):
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

    def _slot_count(self) -> int:
        """Slots per process worker (0: torch's shared-memory path); see :attr:`worker_slots`."""
        if not slots_enabled() or self._iterable:
            return 0
        if self.worker_type != "process" or not self.num_workers or self._direct is not None:
            return 0
        if self._mode not in (Mode.GETITEMS, Mode.PER_SAMPLE):
            return 0
        if self.collate_fn is not default_collate:
            return 0
        if self._feed is not None:
            if not self._feed.on_gpu:
                return 0
        elif self.pin_memory and torch.accelerator.is_available():
            return 0  # torch's pin thread pins each batch; slots would bypass it
        # a worker has at most prefetch_factor batches queued; two more cover the ones the
        # main process still holds (delivered, or in the device copy) before it frees them
        return (self.prefetch_factor or 2) + 2

    def _make_inner(self) -> tud.DataLoader:  # type: ignore[type-arg]
        """The torch DataLoader that runs torch's iterator over the timed dataset/collate."""
        slots = self._slot_count()
        if slots:
            self._slots = Slots(pin=self._feed is not None and self._feed.on_gpu)
        skip = self.on_error == "skip"
        proxy: Any = (
            IterProxy(self.dataset)
            if self._iterable
            else (SkipMapProxy if skip else MapProxy)(self.dataset, self._mode)
        )
        common: dict[str, Any] = {
            "num_workers": self.num_workers,
            "collate_fn": (SkipTimedCollate if skip else TimedCollate)(
                self.collate_fn, self._mode, slots, slot_rows(self.batch_size, self.sampler)
            ),
            "pin_memory": self.pin_memory and self._feed is None,
            "timeout": self.timeout,
            "worker_init_fn": WorkerInit(self.worker_init_fn)
            if self.num_workers
            else self.worker_init_fn,
            "multiprocessing_context": self.multiprocessing_context,
            "generator": self.generator,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers,
            "pin_memory_device": self.pin_memory_device,
            "in_order": self.in_order,
        }
        if self._iterable:
            return tud.DataLoader(
                proxy, batch_size=self.batch_size, drop_last=self.drop_last, **common
            )
        if _torch_compat.auto_collation(self):
            return tud.DataLoader(proxy, batch_sampler=self._stream, **common)
        return tud.DataLoader(proxy, batch_size=None, sampler=self._stream, **common)

    def _pin(self) -> bool:
        """Whether batches get pinned, with torch's warning when there is nothing to pin for."""
        if not self.pin_memory or self._feed is not None:  # the device feed pins its own ring
            return False
        if not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
            return False
        return True

    def _inline_source(self) -> InlineSource:
        if self.timeout != 0:  # torch's single-process iterator refuses a timeout the same way
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        index_sampler = (
            self._stream if self._stream is not None else _torch_compat.index_sampler(self)
        )
        return InlineSource(
            self._direct if self._direct is not None else self.dataset,
            iter(index_sampler),
            self.collate_fn,
            self._mode,
            generator=self._base_seed_generator(),
            pin=self._pin(),
            drop_last=self.drop_last,
            timed=self.meter.enabled,
            shared_clock=self._feed is None,  # a feed delivers batches fetched in earlier next()s
            skip=self.on_error == "skip",
        )

    def _thread_rng_watch(self) -> RNGWatch:
        """One watch per loader: its warnings about the global RNG come once per loader."""
        watch: RNGWatch | None = getattr(self, "_rng_watch", None)
        if watch is None:
            watch = self._rng_watch = RNGWatch()
        return watch

    def _thread_source(self, feed: Prefetcher | None = None) -> ThreadWorkers:
        index_sampler = (
            self._stream if self._stream is not None else _torch_compat.index_sampler(self)
        )
        sampler_iter = iter(index_sampler)
        if not (self.persistent_workers and self._thread_seeded):  # torch's RNG draws, exactly
            base_seed = int(
                torch.empty((), dtype=torch.int64)
                .random_(generator=self._base_seed_generator())
                .item()
            )
            self._thread_base_seed = base_seed
            self._thread_seeded = True
        pin = self._pin()
        # persistent_workers: worker_init_fn runs once (again only if it raised) and each worker
        # keeps its dataset copy, as persistent worker processes do
        last = getattr(self, "_thread_pool_parts", None)
        kept = last[0] if last is not None and self.persistent_workers and not last[1] else None
        pool = ThreadWorkers(
            self._direct if self._direct is not None else self.dataset,
            sampler_iter,
            self.collate_fn,
            self._mode,
            # the direct path's worker only issues copies: one thread is enough
            num_workers=self.num_workers if self._direct is None else 1,
            # the direct path's one worker keeps the feed's window queued (it only issues copies)
            prefetch_factor=(self.prefetch_factor or 2)
            if self._direct is None
            else max(self.prefetch_factor or 2, self._feed.prefetch + 2 if self._feed else 2),
            base_seed=self._thread_base_seed,
            rng_watch=self._thread_rng_watch(),
            timeout=self.timeout,
            worker_init_fn=self.worker_init_fn if kept is None else None,
            datasets=kept,
            pin=pin,
            in_order=self.in_order,
            drop_last=self.drop_last,
            timed=self.meter.enabled,
            skip=self.on_error == "skip",
            # in order, batch n is the feed's n-th: workers read it straight into its slot
            out_for=feed.out_for
            if feed is not None and self.in_order and self._direct is None
            else None,
        )
        if self.persistent_workers:
            self._thread_pool_parts = (pool.datasets, pool.init_failed)
        return pool


def _dataset_epoch(dataset: Any) -> Any:
    """The epoch a dataset with ``set_epoch`` holds (``MixedDataset``), else None."""
    return (
        getattr(dataset, "epoch", None) if callable(getattr(dataset, "set_epoch", None)) else None
    )


def _takes_arrays(dataset: Any) -> bool:
    """Whether ``dataset.read_batch`` takes numpy index arrays (feedpipe.protocols, step 2)."""
    return isinstance(dataset, IndexArrayDataset) and dataset.takes_index_arrays is True
