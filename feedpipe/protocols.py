"""The dataset contract: what ``feedpipe.DataLoader`` and its GPU feed call on a dataset.

Four :class:`typing.Protocol`\\ s, each ``runtime_checkable``. A map-style dataset (``__len__``
and ``__getitem__``, as torch requires) becomes a :class:`BatchDataset` by adding
``read_batch``; an :class:`IndexArrayDataset` also takes numpy index arrays; a
:class:`DMADataset` can also fill a CUDA buffer itself (the device feed's direct path); an
:class:`AccessPlanDataset` is told the order of the reads to come (its own call order is in
its docstring).
``feedpipe.testing.DatasetContractTests`` checks an implementation against this page.

Call order (who calls what, in which thread):

0) ``DataLoader(dataset, ...)``, main thread: the read path is chosen once. ``read_batch`` is
   used when it is callable and ``collate_fn`` is torch's default (``default_collate``, or
   ``default_convert``); otherwise ``__getitems__`` then ``collate_fn``, otherwise
   ``[dataset[i] for i in indices]`` then ``collate_fn``, as torch does. ``len(dataset)`` is
   read by the samplers.
1) ``DataLoader(..., device="cuda")``, main thread, once: the direct path is taken when the
   dataset is a :class:`DMADataset` whose :meth:`~DMADataset.dma_blocker` returns ``None``; the
   automatic choice (``direct=None``) also wants ``record_bytes`` of at least 2 KiB and
   ``record_bytes * len(dataset)`` under half the available memory.
2) ``iter(loader)``, main thread: the index batches of the pass are made. With the loader's own
   workers (``num_workers=0`` or ``worker_type="thread"``), a dataset whose
   ``takes_index_arrays`` is true gets 1-D ``int64`` numpy arrays from torch's
   ``SequentialSampler`` and ``RandomSampler`` (no replacement); every other case gets a list of
   ``int``. Indices are in ``[0, len(dataset))``, unsorted, possibly repeated, possibly empty.
3) Per batch, ``read_batch(indices)`` or ``read_batch(indices, out=out)`` is called from the
   main thread (``num_workers=0``), from worker threads (``worker_type="thread"``: several
   threads call the same object at once, so it must be thread-safe), or from a worker process
   (``worker_type="process"``: on the process's copy of the dataset, pickled or forked; never
   with ``out``). The index array is the caller's (a view of the sampler's permutation): it
   must not be written to.
4) ``out`` is passed in two cases only, always with exactly ``len(indices)`` rows:

   a) the ring path of a device feed, thread workers, ``in_order=True``: ``out`` has the
      structure of the first batch ``read_batch`` returned in this pass (the same nesting of
      dicts, lists and tuples, dtypes and trailing shapes), its tensors contiguous CPU views of
      a ring slot (page-locked when the feed is on CUDA). Only batch-major batches (every tensor
      with first dimension ``len(indices)``) get one; the first batches of a pass, and batches
      that do not fit a slot, get ``out=None``.
   b) the direct path: ``out = dataset.device_out(len(indices), device)`` and then
      ``read_batch(indices, out=out)``, both inside ``torch.cuda.stream(copy_stream)``, in the
      one direct worker thread (or the main thread with ``num_workers=0``).

5) ``read_batch`` returns what ``default_collate([dataset[i] for i in indices])`` returns: the
   same structure, dtypes, shapes and bytes (a dataset may return a list of tensors for a field
   whose records vary in size, where ``default_collate`` would fail). With ``out``, the
   returned tensors are the first ``len(indices)`` rows of ``out``'s tensors (the ring skips its
   host copy when a tensor starts at its slot's address; anything else is copied into the slot,
   correct but slower). Tensors for which ``out`` has no entry (side fields, on the direct path)
   come back on the host and go through the ring. A CUDA ``out`` may be filled asynchronously,
   but every copy must be enqueued on the current stream before ``read_batch`` returns: the feed
   records its event on that stream after the call, and the training stream waits for it.
6) After ``read_batch`` returns, the dataset keeps no reference to ``out`` and never writes to
   it again: the feed reuses the slot for a later batch once its copy to the device is done.
7) Errors: any exception from ``read_batch`` (or ``device_out``) is caught where it was raised,
   recorded with the worker id and the sample indices, and raised in the training loop at that
   batch's turn: the same object with a note (main thread, thread workers) or its type
   re-created (process workers, as torch does). Raise ``IndexError`` for an index out of range,
   ``ValueError`` for an ``out`` that does not fit, :class:`feedpipe.DatasetError` for bad data.
   A partly written ``out`` is discarded: the feed skips that batch and reuses the slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["AccessPlanDataset", "BatchDataset", "DMADataset", "IndexArrayDataset"]


@runtime_checkable
class BatchDataset(Protocol):
    """A map-style dataset that reads a whole index batch in one call (steps 0 and 3-7)."""

    def __len__(self) -> int:
        """The number of samples; valid indices are ``0 .. len - 1``."""
        ...

    def __getitem__(self, index: int, /) -> Any:
        """One sample, as torch's ``Dataset`` returns it."""
        ...

    def read_batch(self, indices: Sequence[int] | np.ndarray, out: Any = None) -> Any:
        """``default_collate([self[i] for i in indices])``, read in one call.

        ``out`` (optional) is a destination with room for the batch (steps 4 and 5); the batch
        is written into it and views of it are returned. Thread-safe (step 3).
        """
        ...


@runtime_checkable
class IndexArrayDataset(BatchDataset, Protocol):
    """A :class:`BatchDataset` whose ``read_batch`` also takes 1-D ``int64`` numpy arrays.

    The loader checks ``isinstance(ds, IndexArrayDataset) and ds.takes_index_arrays is True``
    (step 2); the result must not depend on whether a list or an array was passed.
    """

    @property
    def takes_index_arrays(self) -> bool:
        """True: hand index batches to ``read_batch`` as numpy arrays, not lists."""
        ...


@runtime_checkable
class DMADataset(BatchDataset, Protocol):
    """A :class:`BatchDataset` that can fill a CUDA ``out`` itself (steps 1 and 4b)."""

    @property
    def record_bytes(self) -> int:
        """Bytes per record on the device (the automatic direct-path choice reads it)."""
        ...

    def dma_blocker(self) -> str | None:
        """Why ``read_batch`` cannot fill a CUDA ``out`` (``None``: it can). Cheap; no I/O."""
        ...

    def device_out(self, rows: int, device: torch.device) -> Any:
        """An ``out`` for ``rows`` records on ``device``, allocated on the current stream.

        Its structure is the batch's, holding only the tensors that go to the device (e.g.
        ``{"data": ...}`` when side fields stay on the host).
        """
        ...


@runtime_checkable
class AccessPlanDataset(Protocol):
    """A dataset that reads better when it knows the order of the reads to come.

    A remote dataset behind a bounded cache, for example, evicts the file needed farthest in the
    future (Belady) instead of the least recently used one. Call order, each pass:

    0) only where ``read_batch`` runs in the loader's process (``num_workers=0`` or
       ``worker_type="thread"``, with the ``read_batch`` read path): worker processes read
       their own copies, which the loader cannot reach;
    1) ``plan_horizon()``, main thread, when the pass starts (after a resume's skipped batches):
       ``0`` turns planning off for the pass; otherwise the loader draws index batches from its
       sampler up to that many samples ahead of the batches it hands to the workers (the
       sampler is read ahead; the loader's state still counts delivered batches);
    2) ``plan_start()``, main thread: a new pass; forget earlier plans;
    3) ``plan_ahead(indices)``, main thread, once per index batch of the pass, in the order the
       loader hands them out, each before ``read_batch`` of the same batch is called; then
       ``read_batch(indices)`` reads it (in about that order: thread workers overlap).
    """

    def plan_horizon(self) -> int:
        """How many samples ahead of its reads the dataset wants to see (0: no plan)."""
        ...

    def plan_start(self) -> None:
        """A pass begins: the batches planned before will not be read."""
        ...

    def plan_ahead(self, indices: Sequence[int] | np.ndarray) -> None:
        """The next index batch ``read_batch`` will be asked to read."""
        ...
