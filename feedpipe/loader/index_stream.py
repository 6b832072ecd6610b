"""Vectorised index batches: torch's batches, without handing out one Python int at a time.

``iter(BatchSampler(RandomSampler(ds), 256, False))`` yields each index through two Python
generators and an ``islice``: on small records that is a third of an epoch. For the samplers
the loader builds itself (and the feedpipe ``DistributedSampler``), :func:`index_batches`
produces the same lists from one permutation (``torch.randperm``, an ``arange`` or the
sampler's own permutation chunk), sliced per batch.

"The same" is exact: the same lists of ints, and the same random draws at the same moments.
torch's ``RandomSampler`` draws a seed from the global RNG (when it has no generator) at the
first ``next()``, calls ``randperm(n)`` for the epoch and then, when its iterator runs dry, a
second ``randperm(n)`` whose result is discarded (``num_samples % n == 0`` samples of it); the
``BatchSampler`` runs it dry while building a partial last batch, or at the ``next()`` after
the last full batch. The vectorised iterator makes those calls at those points, so the RNG
state seen by the next epoch, by a ``state_dict()`` or by worker seeding is torch's.
Anything else (subclasses, ``replacement=True``, ``num_samples``) takes the generic path.

:class:`IndexStream` is how the loader's workers see those batches: recorded (for error
messages) and skippable without reading data (resume is arithmetic on the sampler). For a
dataset that wants the order of its reads ahead (:class:`feedpipe.protocols.AccessPlanDataset`)
it reads the sampler ahead and tells the dataset each batch first (:func:`plan_ahead`); a
resume's skipped batches are never planned, and each pass plans its own order.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from feedpipe.loader import _torch_compat
from feedpipe.loader.skip import drop_known

if TYPE_CHECKING:
    from feedpipe.protocols import AccessPlanDataset

__all__ = ["IndexStream", "index_batches", "plan_ahead"]


def index_batches(batch_sampler: Any, arrays: bool = False) -> Iterator[Any]:
    """``iter(batch_sampler)``, vectorised where the batches can be reproduced exactly.

    ``arrays``: the vectorised samplers yield int64 numpy arrays instead of lists (the same
    indices), for datasets whose ``read_batch`` takes them; converting a batch of 32,768 indices
    to a list and back costs milliseconds."""
    if type(batch_sampler) is BatchSampler:
        sampler, size, drop = (
            batch_sampler.sampler,
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
        if type(sampler) is SequentialSampler:
            return _sequential(sampler, size, drop, arrays)
        if (
            type(sampler) is RandomSampler
            and sampler.replacement is False
            and _torch_compat.random_sampler_num_samples(sampler) is None
        ):
            return _random(sampler, size, drop, arrays)
        from feedpipe.sampler import DistributedSampler

        if type(sampler) is DistributedSampler:
            return _distributed(sampler, size, drop)
    return iter(batch_sampler)


def _sequential(sampler: SequentialSampler, size: int, drop: bool, arrays: bool) -> Iterator[Any]:
    n = len(sampler.data_source)  # type: ignore[arg-type]  # read at the first next(), as torch
    end = n - n % size if drop else n
    for lo in range(0, end, size):
        hi = min(lo + size, n)
        yield np.arange(lo, hi, dtype=np.int64) if arrays else list(range(lo, hi))


def _random(sampler: RandomSampler, size: int, drop: bool, arrays: bool) -> Iterator[Any]:
    n = len(sampler.data_source)
    generator = sampler.generator
    own = generator is None
    if own:  # torch's draw: a seed from the global RNG, at the first next()
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    # torch: ``for _ in range(num_samples // n)`` randperms, then a final one of which it keeps
    # ``num_samples % n`` items; with num_samples == n (the default, required above) that is one
    # epoch permutation plus one discarded randperm when the iterator runs dry
    if n == 0:  # torch computes num_samples // n
        raise ZeroDivisionError("integer division or modulo by zero")
    perm = torch.randperm(n, generator=generator).numpy()
    full, rest = divmod(n, size)
    for lo in range(0, full * size, size):
        yield perm[lo : lo + size] if arrays else perm[lo : lo + size].tolist()
    # torch's iterator runs dry here: while building the partial last batch (drop_last=False),
    # or on the next() after the last full batch. Its draw only moves the generator, so it is
    # made for a generator someone else can see (the sampler's), not for this epoch's own
    # (a randperm of 200k items is ~5 ms: a quarter of a 512 B epoch's reading time)
    if not own:
        torch.randperm(n, generator=generator)
    if rest and not drop:
        yield perm[full * size :] if arrays else perm[full * size :].tolist()


def _distributed(sampler: Any, size: int, drop: bool) -> Iterator[list[int]]:
    """feedpipe's ``DistributedSampler``: its indices in chunks (``chunks()``), sliced per batch.

    The plan is taken at ``iter()``, as in ``DistributedSampler.__iter__``; the sampler's resume
    counter advances (``advance``) by the samples handed out, including the dropped tail that
    ``BatchSampler(drop_last=True)`` pulls before it stops.
    """
    iter(sampler)  # sets the plan and the starting count, as torch's BatchSampler does here
    pending: list[int] = []
    for array in sampler.chunks():
        chunk = array.tolist()
        if pending:
            chunk = pending + chunk
        stop = len(chunk) - len(chunk) % size
        for i in range(0, stop, size):
            sampler.advance(size)
            yield chunk[i : i + size]
        pending = chunk[stop:]
    sampler.advance(len(pending))
    if pending and not drop:
        yield pending


def plan_ahead(it: Iterator[Any], planner: AccessPlanDataset, horizon: int) -> Iterator[Any]:
    """``it``'s batches, each told to ``planner.plan_ahead`` up to ``horizon`` samples before it
    is yielded (at least one batch ahead); holds the planned batches, O(horizon) indices."""
    planner.plan_start()
    ahead: collections.deque[Any] = collections.deque()
    samples = 0  # in the batches planned but not yet yielded
    for batch in it:
        planner.plan_ahead(batch)
        ahead.append(batch)
        samples += len(batch)
        while len(ahead) > 1 and samples - len(ahead[0]) >= horizon:
            head = ahead.popleft()
            samples -= len(head)
            yield head
    while ahead:
        yield ahead.popleft()


def _dropping(it: Iterator[Any], drop: frozenset[int], dropped: dict[int, int]) -> Iterator[Any]:
    """``it``'s batches without the known-bad indices ``drop``; ``dropped[n]``: how many
    batch ``n`` lost."""
    for n, index in enumerate(it):
        index, lost = drop_known(index, drop)
        if lost:
            dropped[n] = lost
        yield index


class IndexStream:
    """The loader's index sampler as seen by the workers: skippable and recorded.

    ``skip`` (one-shot) drops the first index batches of the next ``__iter__`` without reading
    data. ``sent[n]`` is the ``n``-th index batch of the current pass (torch's ``send_idx``).
    """

    def __init__(self, sampler: Iterable[Any]) -> None:
        self.sampler = sampler
        self.skip = 0
        # called before the sampler's first draw, returns None or a wrapper of the pass's
        # batches; weak, so the loader is freed by refcount
        self.on_start: (
            weakref.WeakMethod[Callable[[], Callable[[Iterator[Any]], Iterator[Any]] | None]] | None
        ) = None
        self.sent: dict[int, Any] = {}  # one dict, cleared per pass (iterators hold it)
        self.arrays = False  # yield numpy arrays (see index_batches); read when a pass starts
        # a feedpipe.protocols.AccessPlanDataset told the batches ahead; read when a pass starts
        self.planner: AccessPlanDataset | None = None
        # on_error="skip" (feedpipe.loader.skip): indices dropped before any worker sees them,
        # and how many each batch of the pass lost (the loader's iterator pops them)
        self.drop: frozenset[int] = frozenset()
        self.dropped: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return self._gen()

    def _gen(self) -> Iterator[Any]:
        # Lazy on purpose: torch's multi-process iterator calls iter() twice and advances only
        # the second one, so the one-shot skip is taken when the first index is drawn.
        # the hook may return a wrapper for this pass's batches (the loader's RNG replay)
        hook = self.on_start() if self.on_start is not None else None
        wrap = hook() if hook is not None else None
        del hook  # a suspended generator must not hold the loader (a cycle via torch's iterator)
        it = index_batches(self.sampler, self.arrays)  # torch's batches and draws, vectorised
        if wrap is not None:
            it = wrap(it)
        skip, self.skip = self.skip, 0
        sent = self.sent
        sent.clear()
        if skip:
            for _ in itertools.islice(it, skip):
                pass
        dropped = self.dropped
        dropped.clear()
        if self.drop:  # before the plan: it must hold the batches the workers will read
            it = _dropping(it, self.drop, dropped)
        planner = self.planner
        horizon = planner.plan_horizon() if planner is not None else 0
        if planner is not None and horizon > 0:
            it = plan_ahead(it, planner, horizon)
        del planner
        for n, index in enumerate(it):
            sent[n] = index
            yield index
