"""``WorkerSources``: starts each pass's workers, and keeps what outlives a pass.

A pass reads from one of three sources, by the :class:`~feedpipe.loader.plan.LoaderPlan`'s
worker kind: the in-process :class:`~feedpipe.loader.threads.InlineSource`
(``num_workers=0``), :class:`~feedpipe.loader.threads.ThreadWorkers`, or torch's multi-process
iterator over an inner torch ``DataLoader`` that shares the sampler, generator and options and
wraps only the dataset and ``collate_fn`` (``feedpipe.loader.fetch``), so that batches, order,
worker seeds, pinning and worker-death detection are torch's by construction.

What outlives a pass is held here, not in the loader's namespace: the inner torch loader (its
persistent workers), the process workers' shared :class:`~feedpipe.loader.slots.Slots`, the
dataset epoch those workers started with, and for persistent thread workers their base seed
and dataset copies. The loader is passed to each call, never stored: no reference cycle, so
the loader (and its persistent workers, through a finalizer) goes by refcount.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud

from feedpipe.device.feed import Prefetcher
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import IterProxy, MapProxy, TimedCollate, WorkerInit
from feedpipe.loader.plan import LoaderPlan
from feedpipe.loader.skip import SkipMapProxy, SkipTimedCollate
from feedpipe.loader.slots import Slots, slot_rows
from feedpipe.loader.threads import InlineSource, RNGWatch, ThreadWorkers

__all__ = ["SeedSource", "WorkerSources", "dataset_epoch"]

#: what a pass draws the workers' base seed from (``Resume.seed_generator``)
SeedSource = Callable[[], "torch.Generator | None"]


def dataset_epoch(dataset: Any) -> Any:
    """The epoch a dataset with ``set_epoch`` holds (``MixedDataset``), else None."""
    return (
        getattr(dataset, "epoch", None) if callable(getattr(dataset, "set_epoch", None)) else None
    )


class WorkerSources:
    """The worker handles of one loader that outlive a pass (module docstring)."""

    def __init__(self, plan: LoaderPlan, retired: WorkerSources | None = None) -> None:
        self._plan = plan
        # the sources of the plan this one replaced: a pass begun on them may still be running
        # (a setting assigned mid-epoch applies from the next iter()); stopped at our first pass
        self._retired = retired
        self.slots: Slots | None = None  # process workers' shared slots, once made
        # process workers: the torch loader that runs them (persistent ones live in it)
        self.inner: tud.DataLoader | None = None  # type: ignore[type-arg]
        self._workers_epoch: Any = None  # the dataset's epoch when the worker processes started
        self._thread_seeded = False
        self._thread_base_seed = 0
        self._kept: tuple[list[Any], list[int]] | None = None  # persistent threads' datasets
        self._rng_watch: RNGWatch | None = None
        self._end_workers: weakref.finalize[Any, Any] | None = None  # stops persistent workers

    def open(self, loader: Any, feed: Prefetcher | None, seeds: SeedSource) -> Any:
        """This pass's source, started (``seeds``: the generator of the base seed, if drawn)."""
        self._close_retired()
        if loader.num_workers == 0:
            return self._inline(loader, seeds)
        if self._plan.threads:
            return self._threads(loader, feed, seeds)
        return self._processes(loader, seeds)

    def close(self) -> None:
        """Stop the persistent worker processes now (and those of the sources this replaced)."""
        self._close_retired()
        if self._end_workers is not None:
            self._end_workers()

    def _close_retired(self) -> None:
        retired, self._retired = self._retired, None
        if retired is not None:
            retired.close()

    def reuses_workers(self, loader: Any) -> bool:
        """Whether the next ``iter()`` reuses persistent workers (and so draws no base seed)."""
        if not (loader.persistent_workers and loader.num_workers > 0):
            return False
        return self._thread_seeded if self._plan.threads else self.inner is not None

    def check_epoch(self, loader: Any) -> None:
        """Refuse to reuse persistent worker processes whose dataset copies hold another epoch.

        A dataset with ``set_epoch`` (``MixedDataset``) chooses its samples by epoch; running
        worker processes never see a ``set_epoch`` made in this process, so they would serve the
        old epoch's samples without a word."""
        epoch = dataset_epoch(loader.dataset)
        inner = self.inner
        if (
            inner is not None
            and _torch_compat.workers_running(inner)
            and epoch != self._workers_epoch
        ):
            raise ValueError(
                f"{type(loader.dataset).__name__}.set_epoch({epoch!r}) cannot reach the persistent "
                f"worker processes, whose copies hold epoch {self._workers_epoch!r}: use "
                "worker_type='thread' or persistent_workers=False"
            )

    # ---------------------------------------------------------------------------- the sources
    def _inline(self, loader: Any, seeds: SeedSource) -> InlineSource:
        if loader.timeout != 0:  # torch's single-process iterator refuses a timeout the same way
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        plan = self._plan
        return InlineSource(
            plan.source_dataset(loader),
            iter(plan.index_sampler(loader)),
            loader.collate_fn,
            plan.mode,
            generator=seeds(),
            pin=pin(loader, plan),
            drop_last=loader.drop_last,
            timed=loader.meter.enabled,
            shared_clock=plan.feed is None,  # a feed delivers batches fetched in earlier next()s
            skip=plan.skip,
        )

    def _threads(self, loader: Any, feed: Prefetcher | None, seeds: SeedSource) -> ThreadWorkers:
        plan = self._plan
        sampler_iter = iter(plan.index_sampler(loader))
        persistent = loader.persistent_workers
        if not (persistent and self._thread_seeded):  # torch's RNG draws, exactly
            gen = seeds()
            self._thread_base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=gen).item()
            )
            self._thread_seeded = True
        # persistent_workers: worker_init_fn runs once (again only if it raised) and each worker
        # keeps its dataset copy, as persistent worker processes do
        kept = self._kept_datasets(loader.num_workers) if persistent else None
        if self._rng_watch is None:  # one per loader: its warnings come once per loader
            self._rng_watch = RNGWatch()
        direct = plan.direct is not None
        prefetch = loader.prefetch_factor or 2
        pool = ThreadWorkers(
            plan.source_dataset(loader),
            sampler_iter,
            loader.collate_fn,
            plan.mode,
            # the direct path's worker only issues copies: one thread is enough
            num_workers=loader.num_workers if not direct else 1,
            # the direct path's one worker keeps the feed's window queued
            prefetch_factor=prefetch if not direct else max(prefetch, _feed_window(plan)),
            base_seed=self._thread_base_seed,
            rng_watch=self._rng_watch,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn if kept is None else None,
            datasets=kept,
            pin=pin(loader, plan),
            in_order=loader.in_order,
            drop_last=loader.drop_last,
            timed=loader.meter.enabled,
            skip=plan.skip,
            # in order, batch n is the feed's n-th: workers read it straight into its slot
            out_for=feed.out_for if feed is not None and loader.in_order and not direct else None,
            tuner=_pool_tuner(loader, plan, feed),
        )
        if persistent:
            self._kept = (pool.datasets, pool.init_failed)
            _take_settings(pool, _pool_tuner(loader, plan, feed))
        return pool

    def _kept_datasets(self, workers: int) -> list[Any] | None:
        """Persistent thread workers' datasets from the last pass (None: none, or a
        ``worker_init_fn`` raised); a pool the tuner grew passes its first ``workers``."""
        last = self._kept
        if last is None or last[1] or len(last[0]) < workers:
            return None
        return last[0][:workers]

    def _processes(self, loader: Any, seeds: SeedSource) -> Any:
        if self.inner is None:
            self.inner = self._make_inner(loader)
            # Persistent workers go when the loader goes, by refcount or by the cyclic GC (the
            # finalizer holds the inner loader, so torch's queues are intact when it runs).
            self._end_workers = weakref.finalize(
                loader, _torch_compat.shutdown_iterator, self.inner
            )
        inner = self.inner
        if self.slots is not None and not loader.persistent_workers:
            self.slots.forget()  # the last pass's workers are gone; live views keep their slots
        _torch_compat.set_len_called(inner, _torch_compat.len_called(loader))
        self._workers_epoch = dataset_epoch(loader.dataset)
        inner.generator = seeds()  # torch draws the base seed from it
        if not torch.cuda.is_initialized() or _torch_compat.workers_running(inner):  # type: ignore[no-untyped-call]
            source = iter(inner)  # no fork: nothing to keep out of a child's GC
        else:
            # Forked workers inherit every object of this process, some owning CUDA handles
            # (events, memory). Were the child's cyclic GC to destroy one, it would call CUDA in
            # a forked process and abort (cudaErrorInitializationError). Freezing puts the objects
            # that exist now out of the GC's reach in the children; this process unfreezes once
            # they are started.
            gc.collect()
            gc.freeze()
            try:
                source = iter(inner)
            finally:
                gc.unfreeze()
        _torch_compat.adopt_workers(source)  # deaths surface in next(), never asynchronously
        return source

    def _make_inner(self, loader: Any) -> tud.DataLoader:  # type: ignore[type-arg]
        """The torch DataLoader that runs torch's iterator over the timed dataset/collate."""
        plan = self._plan
        slots = plan.slot_count(loader)
        if slots:
            self.slots = Slots(pin=plan.feed_on_gpu())
        skip = plan.skip
        proxy: Any = (
            IterProxy(loader.dataset)
            if plan.iterable
            else (SkipMapProxy if skip else MapProxy)(loader.dataset, plan.mode)
        )
        workers = loader.num_workers
        common: dict[str, Any] = {
            "num_workers": workers,
            "collate_fn": (SkipTimedCollate if skip else TimedCollate)(
                loader.collate_fn, plan.mode, slots, slot_rows(loader.batch_size, loader.sampler)
            ),
            "pin_memory": loader.pin_memory and plan.feed is None,
            "timeout": loader.timeout,
            "worker_init_fn": WorkerInit(loader.worker_init_fn)
            if workers
            else loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator,
            "prefetch_factor": loader.prefetch_factor,
            "persistent_workers": loader.persistent_workers,
            "pin_memory_device": loader.pin_memory_device,
            "in_order": loader.in_order,
        }
        if plan.iterable:
            return tud.DataLoader(
                proxy, batch_size=loader.batch_size, drop_last=loader.drop_last, **common
            )
        if _torch_compat.auto_collation(loader):
            return tud.DataLoader(proxy, batch_sampler=plan.stream, **common)
        return tud.DataLoader(proxy, batch_size=None, sampler=plan.stream, **common)


def pin(loader: Any, plan: LoaderPlan) -> bool:
    """Whether batches get pinned, with torch's warning when there is nothing to pin for."""
    if not loader.pin_memory or plan.feed is not None:  # the device feed pins its own ring
        return False
    if not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=4,
        )
        return False
    return True


def _pool_tuner(loader: Any, plan: LoaderPlan, feed: Prefetcher | None) -> Any:
    """The tuner that resizes a thread pool online (``num_workers="auto"``): not with a device
    feed (its ring is sized for the pass's workers) nor an iterable dataset (it shards itself
    by the worker count)."""
    if feed is not None or plan.direct is not None or plan.iterable:
        return None
    return getattr(loader, "tuner", None)


def _take_settings(pool: ThreadWorkers, tuner: Any) -> None:
    """A persistent loader's pool starts at ``num_workers``; the tuner's count (a tuned pool of
    an earlier pass) applies at once, without a new plan or a new base seed."""
    if tuner is not None:
        pool.resize(tuner.settings.workers, tuner.settings.prefetch)


def _feed_window(plan: LoaderPlan) -> int:
    """Batches the direct path's worker keeps queued: the feed's window."""
    return plan.feed.prefetch + 2 if plan.feed is not None else 2
