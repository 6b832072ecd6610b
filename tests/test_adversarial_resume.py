"""Adversarial review of exact resume (issue 16, points 1-2): states taken at awkward moments,
loaded into loaders that differ, and samplers the main tests do not cover.

Every exactness check compares against a run never interrupted, bit for bit, and checks that
the global torch RNG ends where the uninterrupted run left it. A state that cannot resume
exactly must be refused at ``load_state_dict``, never silently skip or repeat samples.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchDistributedSampler
from torch.utils.data import (
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import feedpipe
from feedpipe import DataLoader

N = 40
DATA = list(range(N))
WORKERS: dict[str, dict[str, Any]] = {
    "inline": {},
    "threads": {"num_workers": 2, "worker_type": "thread"},
    "processes": {"num_workers": 2},
}


def _shared(g: torch.Generator) -> dict[str, Any]:
    """One generator for the loader and its sampler."""
    return {"sampler": RandomSampler(DATA, generator=g), "generator": g}


SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "global": lambda: {"shuffle": True},
    "generator": lambda: {"shuffle": True, "generator": torch.Generator().manual_seed(7)},
    "weighted": lambda: {"sampler": WeightedRandomSampler([1.0] * N, N)},
    "subset": lambda: {"sampler": SubsetRandomSampler(list(range(3, N)))},
    "replacement": lambda: {"sampler": RandomSampler(DATA, replacement=True, num_samples=70)},
    "shared_generator": lambda: _shared(torch.Generator().manual_seed(7)),
}


def _batches(it: Iterator[Any]) -> list[list[int]]:
    out = []
    for batch in it:
        out.append(batch.tolist())
        torch.rand(2)  # the training step's own draws (dropout)
    return out


def _resume(make: Callable[[], DataLoader], stop: int, after_stop: bool = False) -> None:
    """Stop after ``stop`` batches of epoch 0 (``after_stop``: after its StopIteration), save,
    resume in a fresh loader with the user's restored RNG; two epochs must match bit for bit."""
    torch.manual_seed(0)
    full = make()
    want = [_batches(iter(full)) for _ in range(2)]
    want_rng = torch.get_rng_state()
    torch.manual_seed(0)
    a = make()
    it = iter(a)
    first = [next(it).tolist() for _ in range(stop)]
    for _ in range(stop):
        torch.rand(2)
    if after_stop:
        first += _batches(it)
    state = json.loads(json.dumps(a.state_dict()))
    user = torch.get_rng_state()
    del it, a
    torch.manual_seed(999)
    b = make()
    torch.set_rng_state(user)
    b.load_state_dict(state)
    got = [first] if after_stop else [first + _batches(iter(b))]
    got.append(_batches(iter(b)))
    assert got == want
    assert torch.equal(torch.get_rng_state(), want_rng)


@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_state_right_after_iter_before_next(sampler: str, workers: str) -> None:
    """Broke: with num_workers=0 the sampler draws at the first next(), and a state taken
    between iter() and next() held no RNG state (load_state_dict refused it)."""
    _resume(lambda: DataLoader(DATA, batch_size=4, **SAMPLERS[sampler](), **WORKERS[workers]), 0)


@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_state_mid_epoch_last_batch_and_after_stop(sampler: str, workers: str) -> None:
    make = lambda: DataLoader(DATA, batch_size=4, **SAMPLERS[sampler](), **WORKERS[workers])  # noqa: E731
    _resume(make, 1)
    _resume(make, 10)  # after the last batch, before StopIteration
    _resume(make, 10, after_stop=True)


@pytest.mark.parametrize("workers", ["inline", "processes"])
def test_state_after_a_resumed_iter_before_next(workers: str) -> None:
    """A resumed loader saved again at once (iter() and no next() yet) keeps the position."""
    torch.manual_seed(0)
    want = _batches(iter(DataLoader(DATA, batch_size=4, shuffle=True, **WORKERS[workers])))
    torch.manual_seed(0)
    a = DataLoader(DATA, batch_size=4, shuffle=True, **WORKERS[workers])
    it = iter(a)
    first = [next(it).tolist() for _ in range(3)]
    for _ in range(3):
        torch.rand(2)
    state, user = a.state_dict(), torch.get_rng_state()
    del it, a
    b = DataLoader(DATA, batch_size=4, shuffle=True, **WORKERS[workers])
    torch.set_rng_state(user)
    b.load_state_dict(state)
    it = iter(b)
    again = json.loads(json.dumps(b.state_dict()))
    del it, b
    c = DataLoader(DATA, batch_size=4, shuffle=True, **WORKERS[workers])
    torch.set_rng_state(user)
    c.load_state_dict(again)
    assert first + _batches(iter(c)) == want


def _saved(**kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    a = DataLoader(DATA, **kwargs)
    it = iter(a)
    for _ in range(3):
        next(it)
    return json.loads(json.dumps(a.state_dict()))


@pytest.mark.parametrize(
    ("saved", "loaded", "what"),
    [
        ({"batch_size": 4, "shuffle": True}, {"batch_size": 8, "shuffle": True}, "batch_size"),
        ({"batch_size": 4, "shuffle": True}, {"batch_size": 3, "shuffle": True}, "batch_size"),
        ({"batch_size": 4, "shuffle": True}, {"batch_size": 4}, "samplers"),
        ({"batch_size": 4}, {"batch_size": 4, "shuffle": True}, "samplers"),
    ],
)
def test_a_loader_that_would_skip_other_samples_is_refused(
    saved: dict[str, Any], loaded: dict[str, Any], what: str
) -> None:
    """Broke: a changed batch size skipped 3 batches of 8 for 3 of 4 (12 samples lost), and a
    changed shuffle repeated 9 samples, silently."""
    state = _saved(**saved)
    with pytest.raises(ValueError, match=what):
        DataLoader(DATA, **loaded).load_state_dict(state)


def test_a_grown_dataset_is_refused() -> None:
    state = _saved(batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match="dataset_length 40"):
        DataLoader(list(range(48)), batch_size=4, shuffle=True).load_state_dict(state)


def test_torch_distributed_sampler_at_another_world_size_is_refused() -> None:
    """Broke: torch's DistributedSampler is not elastic; 2 ranks' state loaded by 3 ranks lost
    6 of 40 samples silently. feedpipe's DistributedSampler is the elastic one."""
    sampler = TorchDistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=3)
    state = _saved(batch_size=2, sampler=sampler)
    other = TorchDistributedSampler(DATA, num_replicas=3, rank=0, shuffle=True, seed=3)
    with pytest.raises(ValueError, match="num_replicas=2"):
        DataLoader(DATA, batch_size=2, sampler=other).load_state_dict(state)
    same = TorchDistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
    DataLoader(DATA, batch_size=2, sampler=same).load_state_dict(state)  # same world size: fine


@pytest.mark.parametrize("workers", ["inline", "processes"])
def test_other_workers_and_a_stateful_sampler_at_another_batch_size_stay_exact(
    workers: str,
) -> None:
    """Held: the order does not depend on the workers; feedpipe's sampler counts samples."""
    state = _saved(batch_size=4, shuffle=True)
    torch.manual_seed(0)
    want = _batches(iter(DataLoader(DATA, batch_size=4, shuffle=True)))
    b = DataLoader(DATA, batch_size=4, shuffle=True, **WORKERS[workers])
    b.load_state_dict(state)
    assert _batches(iter(b)) == want[3:]

    def fp() -> feedpipe.DistributedSampler:
        return feedpipe.DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True)

    state = _saved(batch_size=4, sampler=fp())
    want_ids = [i for b in _batches(iter(DataLoader(DATA, batch_size=4, sampler=fp()))) for i in b]
    c = DataLoader(DATA, batch_size=3, sampler=fp(), **WORKERS[workers])
    c.load_state_dict(state)
    assert [i for b in _batches(iter(c)) for i in b] == want_ids[12:]


def test_load_twice_and_reload_into_the_same_loader_after_break() -> None:
    torch.manual_seed(0)
    want = [_batches(iter(DataLoader(DATA, batch_size=4, shuffle=True))) for _ in range(2)]
    torch.manual_seed(0)
    a = DataLoader(DATA, batch_size=4, shuffle=True)
    for batch in a:  # abandoned by break
        first = [batch.tolist()]
        torch.rand(2)
        break
    state, user = a.state_dict(), torch.get_rng_state()
    a.load_state_dict(state)
    a.load_state_dict(state)
    assert a.state_dict() == state  # a save right after a restore keeps the position
    torch.set_rng_state(user)
    assert [first + _batches(iter(a)), _batches(iter(a))] == want


def test_stateful_sampler_state_after_stopiteration_without_set_epoch() -> None:
    """Broke: a state saved after a full epoch without set_epoch() said the epoch was consumed,
    so the resumed pass yielded nothing where torch repeats the epoch."""

    def make() -> DataLoader:
        sampler = feedpipe.DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True)
        return DataLoader(DATA, batch_size=4, sampler=sampler)

    full = make()
    want = [_batches(iter(full)) for _ in range(2)]
    a = make()
    first = _batches(iter(a))
    b = make()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [first, _batches(iter(b))] == want


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("batches", 10**9),  # broke: an empty epoch, silently
        ("batches", True),
        ("batches", "3"),
        ("batches", 2.5),
        ("samples", -5),
        ("in_epoch", "no"),
        ("rng_at", "bogus"),
    ],
)
def test_corrupt_counts_are_refused_at_load(key: str, value: Any) -> None:
    """Broke: a hand-edited or corrupt count was accepted, and the resumed epoch skipped
    everything (10**9) or counted samples past the epoch's end."""
    state = _saved(batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match=key):
        DataLoader(DATA, batch_size=4, shuffle=True).load_state_dict({**state, key: value})


class OwnGenerator(Sampler[int]):
    """A custom sampler whose torch.Generator is not called ``.generator``."""

    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(5)

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(N, generator=self.rng).tolist()


@pytest.mark.parametrize("workers", ["inline", "processes"])
def test_a_generator_under_another_attribute_name_is_in_the_state(workers: str) -> None:
    """Broke: ``self.rng = torch.Generator()`` was neither held nor warned about; the resumed
    epoch drew another permutation, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _resume(
            lambda: DataLoader(DATA, batch_size=4, sampler=OwnGenerator(), **WORKERS[workers]), 3
        )
