"""The per-sample reference of a ``MixedDataset`` epoch, as docs/guides/mixing.md states it, and
of a batch (:func:`expected_batch`); a member the mix sees through its samples and
``read_batch`` only (:class:`SamplesOnly`); the loader the mixed-read tests resume through, and
the resume itself (:func:`resume_epoch`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from feedpipe import DataLoader, DistributedSampler, MixedDataset
from feedpipe._permutation import FeistelPermutation, derive_key
from feedpipe.datasets.mixed import mix_counts

__all__ = [
    "SamplesOnly",
    "expected_batch",
    "mix_loader",
    "reference",
    "resume_epoch",
    "start_epoch",
]


def _name_key(name: str) -> int:
    raw = name.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def reference(
    sizes: dict[str, int], weights: dict[str, float], seed: int, epoch: int, total: int
) -> list[tuple[str, int]]:
    """(member, sample) of every position of the epoch, one by one, as the docs state them."""
    names = list(sizes)
    counts = mix_counts([weights[n] for n in names], total)
    out: list[tuple[str, int]] = []
    for name, count in zip(names, counts, strict=True):
        n = sizes[name]
        perm = FeistelPermutation(n, derive_key(seed, epoch, _name_key(name)))
        for j in range(count):
            if j < count - count % n:  # a whole pass: every sample in order
                out.append((name, j % n))
            else:  # the partial pass: a permuted subset
                out.append((name, int(perm(np.array([j % n], np.int64))[0])))
    return out


def mix_loader(ds: MixedDataset, workers: int = 0) -> DataLoader:
    """Batches of 8 in the sampler's order (seed 11), on ``workers`` thread workers."""
    sampler = DistributedSampler(ds, 1, 0, seed=11, pad=False, batch_size=8)
    return DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers, worker_type="thread")


def start_epoch(loader: DataLoader, ds: MixedDataset, epoch: int) -> None:
    """Set ``epoch`` on the loader's sampler and on the mix."""
    sampler = loader.sampler
    assert isinstance(sampler, DistributedSampler)
    sampler.set_epoch(epoch)
    ds.set_epoch(epoch)


def expected_batch(mix: MixedDataset, idx: np.ndarray) -> torch.Tensor:
    """Positions ``idx`` of ``mix``'s epoch as the per-sample reads make them (``mix.locate``,
    then each member's ``ds[i]``), stacked: what every one-gather read must equal."""
    member, sample = mix.locate(idx)
    rows = [
        torch.as_tensor(np.asarray(mix.datasets[mix.names[k]][s]))
        for k, s in zip(member.tolist(), sample.tolist(), strict=True)
    ]
    return torch.stack(rows)


class SamplesOnly:
    """A member the mix knows by its samples and ``read_batch`` only (no ``record_space``, no
    columns, no declaration): the mix reads it and merges, the old path. Subclasses add what
    the mix may ask of one (``pad_value``, ``takes_index_arrays``)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]

    def read_batch(self, idx: Any, out: Any = None) -> Any:
        return self.ds.read_batch(idx)


def resume_epoch(
    loader: DataLoader,
    ds: MixedDataset,
    epoch: int,
    *,
    stop: int,
    make: Callable[[], MixedDataset],
    workers: int,
) -> tuple[list[Any], MixedDataset]:
    """Epoch ``epoch`` of ``loader`` (:func:`mix_loader` over ``ds``) read for ``stop``
    batches, both states saved, and the rest read by a new mix ``make()`` on a loader of
    ``workers`` thread workers that loaded them: ``(every batch in order, the new mix)``."""
    start_epoch(loader, ds, epoch)
    it = iter(loader)
    first = [next(it) for _ in range(stop)]
    state = {"loader": loader.state_dict(), "mix": ds.state_dict()}
    del it
    again = make()
    resumed = mix_loader(again, workers=workers)
    resumed.load_state_dict(state["loader"])
    again.load_state_dict(state["mix"])
    start_epoch(resumed, again, state["mix"]["epoch"])
    return first + list(resumed), again
