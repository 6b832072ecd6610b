"""The per-batch fetch shared by every worker type, and the records a worker sends back.

``fetch_batch`` is the one function that turns an index batch into a batch: it reads with
``read_batch`` (one call, no collation), ``__getitems__`` (one call, then collate) or per-sample
``__getitem__`` (torch's path), and times the read and the collation. Process workers reach it
through ``MapProxy`` / ``TimedCollate`` (torch's fetcher calls ``__getitems__`` then
``collate_fn``), thread workers call it directly. A failure becomes a ``Failed`` record naming
the worker and the sample indices, re-raised in the main process with the original type.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset, IterableDataset

from feedpipe.errors import WorkerError
from feedpipe.io import trace
from feedpipe.io.reaper import die_with_parent
from feedpipe.loader import _torch_compat
from feedpipe.loader.slots import collate_into

_perf = time.perf_counter

__all__ = [
    "ALL_BAD",
    "Failed",
    "Fetched",
    "IterProxy",
    "MapProxy",
    "Mode",
    "Shipped",
    "Skipped",
    "TimedCollate",
    "WorkerInit",
    "fetch_batch",
    "fetch_mid",
    "fetch_traced",
    "fetch_untimed",
    "fetcher",
    "get_worker_info",
    "nbytes_of",
    "pin_batch",
    "short",
]


class Mode(enum.Enum):
    """How a worker reads one index batch."""

    READ_BATCH = "read_batch"  # dataset.read_batch(indices, out=None): already collated
    GETITEMS = "getitems"  # dataset.__getitems__(indices), then collate_fn
    PER_SAMPLE = "per_sample"  # [dataset[i] for i in indices], then collate_fn
    NO_BATCH = "no_batch"  # batch_size=None: dataset[index], then collate_fn (default_convert)
    ITERABLE = "iterable"  # next(iterator) per sample (iterable datasets)


# An Enum attribute lookup is a dict lookup per access; the per-batch paths compare against
# these module constants instead.
_READ_BATCH, _GETITEMS, _PER_SAMPLE, _NO_BATCH = (
    Mode.READ_BATCH,
    Mode.GETITEMS,
    Mode.PER_SAMPLE,
    Mode.NO_BATCH,
)


def choose_mode(dataset: Any, auto_collation: bool, default_collation: bool) -> Mode:
    """The read path torch would take, upgraded to ``read_batch`` when collation is the default."""
    if isinstance(dataset, IterableDataset):
        return Mode.ITERABLE
    if not auto_collation:
        return Mode.NO_BATCH
    if default_collation and callable(getattr(dataset, "read_batch", None)):
        return Mode.READ_BATCH
    if getattr(dataset, "__getitems__", None):
        return Mode.GETITEMS
    return Mode.PER_SAMPLE


class Shipped(NamedTuple):
    """A batch plus its stage times, as a worker hands it to the main process.

    A NamedTuple so torch's pin-memory thread pins ``batch`` and passes the numbers through.
    Thread workers and the in-process path ship the same five fields as a plain tuple
    (``ShippedTuple``, cheaper to build); a stage time below zero means "did not run".
    """

    batch: Any
    samples: int
    nbytes: int
    fetch_s: float
    collate_s: float


class Skipped(NamedTuple):
    """``on_error="skip"`` (``feedpipe.loader.skip``): ``shipped`` is the batch of the samples
    that read (a ``Shipped`` record), or None when none did; ``skipped`` the dropped indices.

    A NamedTuple, so torch's pin-memory thread pins the inner batch and passes the rest."""

    shipped: Any
    skipped: list[int]


#: what the loader's iterator makes of a batch whose samples all failed (it reads on)
ALL_BAD: Any = Skipped(None, [])


class Failed:
    """A worker's exception with the worker id and the sample indices it was reading.

    In the main process or a thread the original exception object is re-raised (with a note
    naming worker and samples); from a process, torch's ``ExceptionWrapper`` re-creates its
    type with the worker's traceback in the message, as torch does.
    """

    def __init__(self, exc: BaseException, worker: int | None, indices: Any) -> None:
        self.worker, self.indices = worker, indices
        self.exc: BaseException | None = exc
        self.wrapper = _torch_compat.ExceptionWrapper(  # type: ignore[no-untyped-call]  # torch's
            (type(exc), exc, exc.__traceback__), ""
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["exc"] = None  # arbitrary exceptions may not pickle; the wrapper carries the text
        return state

    def exception(self, batch: int | None) -> BaseException:
        """The exception to raise in the main process, naming worker, batch and samples."""
        worker = self.worker
        where = "in the main process" if worker is None else f"in DataLoader worker {worker}"
        num = "a batch" if batch is None else f"batch {batch}"
        what = "" if self.indices is None else f" (sample indices {short(self.indices)})"
        context = f"{where} while loading {num}{what}"
        exc = self.exc
        if exc is None:  # from a process: re-create the type, like torch
            self.wrapper.where = context
            try:
                self.wrapper.reraise()  # type: ignore[no-untyped-call]  # torch's, untyped
            except BaseException as made:
                exc = made.with_traceback(None)  # no frames: no reference cycle
            assert exc is not None
            if isinstance(exc, Exception):
                return exc
        if not isinstance(exc, Exception):  # SystemExit: a worker's, never the training loop's
            error = WorkerError(f"{type(exc).__name__}({exc}) raised {context}")
            error.__cause__ = None if self.exc is None else exc
            return error
        if hasattr(exc, "add_note"):
            exc.add_note(f"feedpipe: raised {context}")
            return exc
        error = WorkerError(f"{type(exc).__name__} raised {context}: {exc}")
        error.__cause__ = exc
        return error


def short(indices: Any, limit: int = 16) -> str:
    if isinstance(indices, np.ndarray):
        indices = indices.tolist()
    if isinstance(indices, (list, tuple)) and len(indices) > limit:
        return f"[{', '.join(map(str, indices[:limit]))}, ... ({len(indices)} in all)]"
    return str(list(indices) if isinstance(indices, tuple) else indices)


#: ``(batch, samples, nbytes, fetch_s, collate_s)``, the fields of :class:`Shipped`.
ShippedTuple = tuple[Any, int, int, float, float]

_Tensor = torch.Tensor


def nbytes_of(batch: Any) -> int:
    """Bytes held by the tensors / arrays of a (nested) batch."""
    kind = type(batch)
    if kind is _Tensor:  # the common cases first, without isinstance chains
        return batch.nbytes  # type: ignore[no-any-return]
    if kind is list or kind is tuple:
        total = 0
        for item in batch:
            total += item.nbytes if type(item) is _Tensor else nbytes_of(item)
        return total
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.nbytes)
    if isinstance(batch, Mapping):
        return sum(nbytes_of(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(nbytes_of(v) for v in batch)
    return 0


def pin_batch(batch: Any) -> Any:
    """Page-lock a batch (torch's recursive pin), the hook a device feed extends."""
    return _torch_compat.pin_memory(batch)  # type: ignore[no-untyped-call]  # torch's, untyped


def read_indices(dataset: Any, indices: Any, mode: Mode, out: Any = None) -> Any:
    """Read one index batch the way ``mode`` says (no collation)."""
    if mode is _READ_BATCH:
        return dataset.read_batch(indices) if out is None else dataset.read_batch(indices, out=out)
    if mode is _GETITEMS:
        return dataset.__getitems__(indices)
    if mode is _PER_SAMPLE:
        return [dataset[i] for i in indices]
    return dataset[indices]


def fetch_batch(
    dataset: Any,
    indices: Any,
    collate_fn: Callable[[Any], Any],
    mode: Mode,
    out: Any = None,
) -> ShippedTuple:
    """Read and collate one index batch, timing both stages (collate -1.0: ``read_batch``).

    ``out`` is an optional preallocated destination passed to ``read_batch`` (a device feed
    gathers straight into its pinned ring slots this way); other modes ignore it.
    """
    perf = _perf
    t0 = perf()
    if mode is _READ_BATCH:
        batch = dataset.read_batch(indices) if out is None else dataset.read_batch(indices, out=out)
        return (batch, len(indices), nbytes_of(batch), perf() - t0, -1.0)
    data = read_indices(dataset, indices, mode, out)
    t1 = perf()
    batch = collate_fn(data)
    t2 = perf()
    samples = len(indices) if mode is not _NO_BATCH else 1
    return (batch, samples, nbytes_of(batch), t1 - t0, t2 - t1)


def fetch_untimed(
    dataset: Any,
    indices: Any,
    collate_fn: Callable[[Any], Any],
    mode: Mode,
    out: Any = None,
) -> ShippedTuple:
    """:func:`fetch_batch` with the counters off: no clocks, no byte count."""
    if mode is _READ_BATCH:
        batch = dataset.read_batch(indices) if out is None else dataset.read_batch(indices, out=out)
        return (batch, len(indices), 0, -1.0, -1.0)
    batch = collate_fn(read_indices(dataset, indices, mode, out))
    return (batch, len(indices) if mode is not _NO_BATCH else 1, 0, -1.0, -1.0)


def fetch_traced(
    dataset: Any,
    indices: Any,
    collate_fn: Callable[[Any], Any],
    mode: Mode,
    out: Any = None,
) -> ShippedTuple:
    """:func:`fetch_batch` inside NVTX ranges ``feedpipe/fetch`` and ``feedpipe/collate``, opened
    in the calling worker thread (:mod:`feedpipe.io.trace`)."""
    rec = trace.recorder()
    if rec is None:
        return fetch_batch(dataset, indices, collate_fn, mode, out)
    perf = _perf
    t0 = perf()
    rec.push("feedpipe/fetch")
    try:
        if mode is _READ_BATCH:
            batch = (
                dataset.read_batch(indices) if out is None else dataset.read_batch(indices, out=out)
            )
            return (batch, len(indices), nbytes_of(batch), perf() - t0, -1.0)
        data = read_indices(dataset, indices, mode, out)
    finally:
        rec.pop()
    t1 = perf()
    rec.push("feedpipe/collate")
    try:
        batch = collate_fn(data)
    finally:
        rec.pop()
    t2 = perf()
    samples = len(indices) if mode is not _NO_BATCH else 1
    return (batch, samples, nbytes_of(batch), t1 - t0, t2 - t1)


def fetch_mid(
    dataset: Any,
    indices: Any,
    collate_fn: Callable[[Any], Any],
    mode: Mode,
    out: Any = None,
) -> ShippedTuple:
    """In-process fetch that shares the loop's clocks: one clock read, between read and collate.

    Returns ``(batch, samples, nbytes, mid, -1.0)`` where ``mid`` is the ``perf_counter``
    reading after the read (``-1.0`` for ``read_batch``, which has no collate stage). The
    iterator, which reads the clock around ``next()``, turns it into the stage times:
    fetch = mid - begin, collate = end - mid (so fetch includes drawing the indices). Two clock
    reads per batch fewer than :func:`fetch_batch`.
    """
    if mode is _READ_BATCH:
        batch = dataset.read_batch(indices) if out is None else dataset.read_batch(indices, out=out)
        return (batch, len(indices), nbytes_of(batch), -1.0, -1.0)
    data = read_indices(dataset, indices, mode, out)
    mid = _perf()
    batch = collate_fn(data)
    nbytes = batch.nbytes if type(batch) is _Tensor else nbytes_of(batch)  # one call fewer
    return (batch, len(indices) if mode is not _NO_BATCH else 1, nbytes, mid, -1.0)


def fetcher(timed: bool) -> Callable[..., ShippedTuple]:
    """The fetch function for a pass: traced while NVTX ranges are on (decided when the pass
    starts, so the per-batch path tests nothing), else timed or untimed."""
    if trace.recorder() is not None:
        return fetch_traced
    return fetch_batch if timed else fetch_untimed


def get_worker_info() -> Any:
    """torch's ``get_worker_info()``, which also works inside feedpipe's thread workers."""
    info = _torch_compat.thread_worker_info()
    return info if info is not None else tud.get_worker_info()


def worker_id() -> int | None:
    """The current torch or feedpipe worker id, or None in the main process."""
    info = get_worker_info()
    return None if info is None else info.id


# ----------------------------------------------------------------------- process-worker plumbing
class Fetched:
    """What ``MapProxy`` hands torch's fetcher: the read samples plus their read time."""

    __slots__ = ("data", "failed", "fetch_s", "indices", "samples")

    def __init__(
        self, data: Any, fetch_s: float, samples: int, indices: Any, failed: Failed | None = None
    ) -> None:
        self.data, self.fetch_s, self.samples = data, fetch_s, samples
        self.indices, self.failed = indices, failed


class MapProxy(Dataset):  # type: ignore[type-arg]
    """Stands in for a map-style dataset inside torch's worker loop.

    Torch's fetcher calls ``__getitems__`` (auto-collation) or ``__getitem__`` (batch_size=None)
    and passes the result to ``collate_fn``; here that result is a ``Fetched`` carrying the
    read time, and ``TimedCollate`` finishes the job. ``get_worker_info().dataset`` still
    returns the user's dataset (see ``WorkerInit``).
    """

    def __init__(self, dataset: Any, mode: Mode) -> None:
        self.dataset, self.mode = dataset, mode

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return repr(self.dataset)

    def read_timed(self, indices: Any, samples: int) -> Fetched:
        """Read ``indices`` (``samples`` of them), timed; a failure as a ``Failed`` record."""
        t0 = time.perf_counter()
        try:
            with trace.span("feedpipe/fetch"):  # in the worker process (nsys follows children)
                data = read_indices(self.dataset, indices, self.mode)
        except (Exception, SystemExit) as exc:
            return Fetched(None, 0.0, samples, indices, Failed(exc, worker_id(), indices))
        return Fetched(data, time.perf_counter() - t0, samples, indices)

    def __getitems__(self, indices: Sequence[int]) -> Fetched:
        return self.read_timed(indices, len(indices))

    def __getitem__(self, index: Any) -> Fetched:
        return self.read_timed(index, 1)


class IterProxy(IterableDataset):  # type: ignore[type-arg]
    """Stands in for an iterable dataset: times each ``next`` and turns errors into records."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return repr(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.dataset)
        position = 0
        clock = _clock()
        while True:
            t0 = time.perf_counter()
            try:
                sample = next(it)
            except StopIteration:
                return
            except (Exception, SystemExit) as exc:
                yield Failed(exc, worker_id(), f"stream position {position}")
                return
            clock.fetch_s += time.perf_counter() - t0
            position += 1
            yield sample


class _Clock(threading.local):
    fetch_s = 0.0


_CLOCK = _Clock()


def _clock() -> _Clock:
    return _CLOCK


class TimedCollate:
    """Wraps the user's ``collate_fn`` in torch's fetch path; returns ``Shipped`` or ``Failed``."""

    def __init__(
        self, collate_fn: Callable[[Any], Any], mode: Mode, slots: int = 0, rows: int | None = None
    ) -> None:
        self.collate_fn, self.mode = collate_fn, mode
        self.slots, self.rows = slots, rows  # slots > 0: collate into shared slots (loader.slots)

    def __call__(self, data: Any) -> Shipped | Failed:
        if isinstance(data, Fetched):
            if data.failed is not None:
                return data.failed
            fetch_s, samples, indices, data = data.fetch_s, data.samples, data.indices, data.data
        else:  # iterable dataset: a list of samples (or one sample when batch_size=None)
            clock = _clock()
            fetch_s, clock.fetch_s = clock.fetch_s, 0.0
            items = data if isinstance(data, list) else [data]
            failed = next((x for x in items if isinstance(x, Failed)), None)
            if failed is not None:
                return failed
            samples, indices = (len(data) if isinstance(data, list) else 1), None
        if self.mode is _READ_BATCH:  # read_batch returns the batch: no collate stage
            return Shipped(data, samples, nbytes_of(data), fetch_s, -1.0)
        t0 = time.perf_counter()
        if self.slots:
            ref = collate_into(data, self.slots, self.rows)
            if ref is not None:
                collate_s = time.perf_counter() - t0
                return Shipped(ref, samples, ref.nbytes, fetch_s, collate_s)
        try:
            with trace.span("feedpipe/collate"):
                batch = self.collate_fn(data)
        except (Exception, SystemExit) as exc:
            return Failed(exc, worker_id(), indices)
        collate_s = time.perf_counter() - t0
        return Shipped(batch, samples, nbytes_of(batch), fetch_s, collate_s)


class WorkerInit:
    """Runs first in each torch worker: shows the user's dataset in ``get_worker_info()``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.owner: int | None = None  # set when pickled to a worker: the process starting it

    def __getstate__(self) -> dict[str, Any]:
        # a forkserver worker's parent is the forkserver, which outlives a killed owner (each
        # worker holds its alive pipe): the worker also watches the process that pickled this
        return {**self.__dict__, "owner": os.getpid()}

    def __call__(self, worker: int) -> None:
        die_with_parent(self.owner)  # an owner killed by the OOM killer takes its hung workers
        _torch_compat.unwrap_worker_dataset((MapProxy, IterProxy))
        if self.user_fn is not None:
            try:
                self.user_fn(worker)
            except SystemExit as exc:  # torch would let it end the worker without a word
                raise WorkerError(
                    f"worker_init_fn raised SystemExit({exc}) in DataLoader worker {worker}"
                ) from None
