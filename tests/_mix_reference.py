"""The per-sample reference of a ``MixedDataset`` epoch, as docs/guides/mixing.md states it, and
the loader the mixed-read tests resume through."""

from __future__ import annotations

import hashlib

import numpy as np

from feedpipe import DataLoader, DistributedSampler, MixedDataset
from feedpipe._permutation import FeistelPermutation, derive_key
from feedpipe.datasets.mixed import mix_counts

__all__ = ["mix_loader", "reference", "start_epoch"]


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
