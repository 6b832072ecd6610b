"""``LoaderPlan``: a ``DataLoader``'s configuration, resolved once, at construction.

The loader is three objects (docs/architecture.md, "the path of a batch"):

1. :class:`LoaderPlan` (this module), frozen: the worker kind (``"process"``/``"thread"``, and
   whether the direct DMA path turns process workers into one thread), the collation path
   (:class:`~feedpipe.loader.fetch.Mode`), the device path (the ``GPUFeed`` and its direct
   reader), the sampler chain as the workers see it (the ``IndexStream``, None for an
   ``IterableDataset``), the dataset's protocols (``IndexArrayDataset``, ``AccessPlanDataset``:
   checked once, as torch locks ``loader.dataset``) and the failure policy (``on_error``). A
   plan is never changed: when a setting it was resolved from is assigned (``worker_type``,
   ``on_error``, ``device``, or one of torch's :data:`TORCH_SETTINGS`), the loader resolves a
   fresh plan, at once for feedpipe's (checked as the constructor checks them) or at the next
   ``iter()`` for torch's. Read at each
   ``iter()``, not frozen here: torch's own attributes (``collate_fn``, ``pin_memory``,
   ``prefetch_factor``), the RNGs along the sampler chain (a sampler's ``.generator`` may be
   replaced: ``feedpipe.loader.rng_state.RngChain`` reads them at each use) and the shared-slot
   switch (an environment variable).
2. a :class:`~feedpipe.loader.loader_pass.Pass` per ``iter()`` (``feedpipe.loader.loader_pass``):
   the epoch it counts into, its worker handles and the index batches in flight.
3. the per-batch pipeline (``feedpipe.loader.pipeline``) that ``LoaderIter.__next__`` runs:
   fetch, failure policy, timing, device hand-off, finalise.

The handles that outlive a pass (torch's inner loader, persistent threads' datasets) belong to
``feedpipe.loader.sources.WorkerSources``; the resume bookkeeping (pending state, RNG replay,
known-bad samples) to ``feedpipe.loader.resume.Resume``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data import default_collate, default_convert

from feedpipe.device import direct as direct_path
from feedpipe.device.direct import DirectReader
from feedpipe.device.feed import GPUFeed, host_ring, stays_on_host, warn_no_cuda
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import Mode, choose_mode
from feedpipe.loader.index_stream import IndexStream
from feedpipe.loader.skip import ON_ERROR
from feedpipe.loader.slots import enabled as slots_enabled
from feedpipe.protocols import AccessPlanDataset, BatchDataset, IndexArrayDataset
from feedpipe.stall import StallMeter

__all__ = [
    "TORCH_SETTINGS",
    "WORKER_TYPES",
    "DevicePath",
    "LoaderOptions",
    "LoaderPlan",
    "auto_worker_type",
    "resolve_plan",
    "settings_of",
]

WORKER_TYPES = ("process", "thread")

#: torch's arguments that a user may assign after construction (torch's ``__setattr__`` locks
#: only the dataset, sampler, batch sampler, batch size, drop_last and persistent_workers) and
#: that a plan or its worker sources read: a change makes the next ``iter()`` re-resolve them.
#: ``generator`` is not one: every pass reads it anew (``RngChain``, the workers' base seed).
TORCH_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "pin_memory_device",
    "in_order",
)


_settings = operator.attrgetter(*TORCH_SETTINGS)


def settings_of(loader: Any) -> tuple[Any, ...]:
    """The values of :data:`TORCH_SETTINGS` that ``loader`` holds now (read at every pass)."""
    values: tuple[Any, ...] = _settings(loader)
    return values


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


@dataclass(frozen=True)
class LoaderPlan:
    """What a loader's arguments resolved to (module docstring); read by every pass."""

    worker_type: str  # "process" or "thread", as asked ("auto" resolved)
    on_error: str  # the failure policy: "raise" or "skip"
    mode: Mode  # the collation path
    iterable: bool  # an IterableDataset: no index stream, no skip
    feed: GPUFeed | None  # the device path (None: host batches)
    direct: DirectReader | None  # the device path's direct DMA reader, when it applies
    stream: IndexStream | None  # the sampler chain as the workers see it
    # the dataset's runtime-protocol checks (~12 us each), made once: torch locks
    # ``loader.dataset`` after construction (and a copy or unpickle resolves a fresh plan)
    index_arrays: bool = False  # an IndexArrayDataset (its ``takes_index_arrays`` read per pass)
    plans_access: bool = False  # an AccessPlanDataset

    @property
    def threads(self) -> bool:
        """Whether workers are threads (asked for, or the direct path's)."""
        return self.worker_type == "thread" or self.direct is not None

    @property
    def skip(self) -> bool:
        """``on_error="skip"``: failing samples are dropped (``feedpipe.loader.skip``)."""
        return self.on_error == "skip"

    def concurrent_workers(self, num_workers: int) -> int:
        """How many workers run the worker stages at once (the direct path runs at most one)."""
        return num_workers if self.direct is None else min(num_workers, 1)

    def worker_kind(self) -> str:
        """``"thread"`` or ``"process"``, for the stall meter."""
        return "thread" if self.threads else "process"

    def index_sampler(self, loader: Any) -> Any:
        """What a pass draws index batches from: the stream, or torch's (iterable datasets)."""
        return self.stream if self.stream is not None else _torch_compat.index_sampler(loader)

    def source_dataset(self, loader: Any) -> Any:
        """What in-process and thread workers read: the direct reader, or the dataset."""
        return self.direct if self.direct is not None else loader.dataset

    def feed_on_gpu(self) -> bool:
        """Whether batches go to a CUDA device (a CPU ``device`` falls back to host batches)."""
        return self.feed is not None and self.feed.on_gpu

    def feed_info(self) -> dict[str, Any] | None:
        """``DataLoader.feed_info``: the feed's ring or direct path (None without ``device``)."""
        if self.feed is None:
            return None
        return {**self.feed.info, "path": "ring" if self.direct is None else "direct"}

    def slot_count(self, loader: Any) -> int:
        """Shared slots per process worker (0: torch's shared-memory path)."""
        if not slots_enabled() or self.iterable:
            return 0
        if self.worker_type != "process" or not loader.num_workers or self.direct is not None:
            return 0
        if self.mode not in (Mode.GETITEMS, Mode.PER_SAMPLE):
            return 0
        if loader.collate_fn is not default_collate:
            return 0
        if self.feed is not None:
            if not self.feed.on_gpu:
                return 0
        elif loader.pin_memory and torch.accelerator.is_available():
            return 0  # torch's pin thread pins each batch; slots would bypass it
        # a worker has at most prefetch_factor batches queued; two more cover the ones the
        # main process still holds (delivered, or in the device copy) before it frees them
        return int(loader.prefetch_factor or 2) + 2

    def prepare_stream(self, loader: Any) -> None:
        """Tell the stream, at ``iter()``, how this pass's readers take index batches: numpy
        arrays for a dataset that takes them, and the order ahead for an access-planning one."""
        if self.stream is None:
            return
        own = loader.num_workers == 0 or self.threads  # our own sources read in this process
        reads = own and self.mode is Mode.READ_BATCH
        ds = loader.dataset
        self.stream.arrays = reads and self.index_arrays and ds.takes_index_arrays is True
        self.stream.planner = ds if reads and self.plans_access else None


@dataclass(frozen=True)
class DevicePath:
    """The device arguments of ``DataLoader``: ``device``, ``prefetch`` and ``direct``."""

    device: str | torch.device | None = None
    prefetch: int = 2
    direct: bool | None = None


@dataclass(frozen=True)
class LoaderOptions:
    """feedpipe's own arguments of ``DataLoader``, as last given or assigned (a plan resolves
    from them; ``worker_type`` is never ``"auto"`` here)."""

    worker_type: str = "process"
    on_error: str = "raise"
    device: str | torch.device | None = None
    prefetch: int = 2
    direct: bool | None = None

    def path(self) -> DevicePath:
        """The device arguments, as ``resolve_plan`` takes them."""
        return DevicePath(self.device, self.prefetch, self.direct)


def resolve_plan(
    loader: Any, worker_type: str, on_error: str, meter: StallMeter, path: DevicePath
) -> LoaderPlan:
    """Check feedpipe's arguments of ``loader`` (torch's were checked by its constructor) and
    resolve them into a :class:`LoaderPlan`."""
    if worker_type not in WORKER_TYPES:
        raise ValueError(
            f"worker_type must be one of {(*WORKER_TYPES, 'auto')}, got {worker_type!r}"
        )
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    iterable = isinstance(loader.dataset, tud.IterableDataset)
    if on_error == "skip" and iterable:
        raise ValueError(
            "on_error='skip' needs a map-style dataset: an IterableDataset's stream has no "
            "sample index to skip deterministically (catch errors inside its __iter__)"
        )
    feed = _make_feed(loader, worker_type, meter, path.device, path.prefetch)
    stream = None if iterable else IndexStream(_torch_compat.index_sampler(loader))
    # read_batch stands in for default_collate only: with batch_size set, a user's explicit
    # collate_fn=default_convert gets torch's list of samples, not a stacked batch
    auto = _torch_compat.auto_collation(loader)
    default = loader.collate_fn is (default_collate if auto else default_convert)
    mode = choose_mode(loader.dataset, auto, default)
    reader = None
    if feed is not None:
        reader = _choose_direct(loader, worker_type, mode, feed, meter=meter, direct=path.direct)
    elif path.direct:  # a host device reads as without one, but refuses what a GPU would
        if path.device is None:
            raise ValueError("direct=True needs device='cuda' (or 'cuda:N')")
        _check_direct_on_host(loader, worker_type, mode)
    ds = loader.dataset
    arrays, planning = isinstance(ds, IndexArrayDataset), isinstance(ds, AccessPlanDataset)
    return LoaderPlan(worker_type, on_error, mode, iterable, feed, reader, stream, arrays, planning)


def _make_feed(
    loader: Any,
    worker_type: str,
    meter: StallMeter,
    device: str | torch.device | None,
    prefetch: int,
) -> GPUFeed | None:
    """The device path: a ``GPUFeed`` for ``device`` (None without one, or where batches stay
    in host memory: they are then the batches of a loader without ``device``)."""
    if device is None:
        return None
    # checked where batches stay on the host too: a bad value fails on the laptop, as on the GPU
    if isinstance(prefetch, bool) or not isinstance(prefetch, Integral) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (batches ahead), got {prefetch!r}")
    # FEEDPIPE_HOST_RING=1 runs the ring in host memory: the feed then gives the one warning
    if stays_on_host(device) and not host_ring():
        warn_no_cuda(device)
        return None
    workers = loader.num_workers
    threads = worker_type == "thread" and workers > 0
    feed = GPUFeed(
        device,
        prefetch=prefetch,
        fillers=(loader.prefetch_factor or 2) * workers if threads else 0,
        batch_size=loader.batch_size,
        meter=meter,
    )
    if feed.on_gpu and meter.enabled:  # device idle for input (CUDA events)
        meter.watch_device(feed.device)
    return feed


def _loader_blocker(loader: Any, worker_type: str, mode: Mode) -> str | None:
    """Why the loader's settings keep it off the direct path, whatever the device."""
    if mode is not Mode.READ_BATCH:
        return "batches are not read by the dataset's read_batch with default collation"
    if worker_type == "process" and loader.num_workers and loader.worker_init_fn:
        return "process workers with a worker_init_fn (the direct path uses threads)"
    return None


def _check_direct_on_host(loader: Any, worker_type: str, mode: Mode) -> None:
    """``direct=True`` where batches stay on the host: refused for every reason that does not
    depend on the device, so a script fails on a laptop as it would on the GPU."""
    reason = _loader_blocker(loader, worker_type, mode) or direct_path.dataset_blocker(
        loader.dataset
    )
    if reason is not None:
        raise ValueError(f"direct=True, but the direct DMA path cannot be used: {reason}")


def _choose_direct(
    loader: Any,
    worker_type: str,
    mode: Mode,
    feed: GPUFeed,
    *,
    meter: StallMeter,
    direct: bool | None,
) -> DirectReader | None:
    """The direct DMA path's reader when it applies (``direct`` in ``DataLoader``'s doc)."""
    reason: str | None
    if direct is False:
        reason = "direct=False"
    else:
        reason = _loader_blocker(loader, worker_type, mode) or direct_path.blocker(
            loader.dataset, feed.device, auto=direct is None
        )
    if not feed.on_gpu:
        return None  # the CPU fallback warned already
    if direct and reason is not None:
        raise ValueError(f"direct=True, but the direct DMA path cannot be used: {reason}")
    direct_path.describe(loader.dataset, feed.device, reason)
    if reason is not None:
        return None
    note = feed.note_copy if meter.enabled else None
    return direct_path.DirectReader(
        loader.dataset, feed.device, feed.copy_stream, note, feed.events
    )
