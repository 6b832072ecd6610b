"""Resume reproduces the order from every RNG that decides it, and leaves the user's RNG alone.

Issue 16, points 1 and 2. Every check compares a run stopped mid-epoch and resumed in a fresh
loader with the run that was never interrupted: the concatenation must be the same batches, in
the same order (so none repeated, none missing), and the global torch RNG must be exactly where
the user put it.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler

from feedpipe import DataLoader

N, B, K = 40, 4, 3  # a 40-sample epoch of batches of 4; stop after K batches


class Gen(Sampler[int]):
    """A custom sampler with its own ``.generator`` (the torch idiom)."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n, generator=self.generator).tolist()


class Chunks(Sampler[list[int]]):
    """A custom batch sampler wrapping a sampler (whose generator sits one level down)."""

    def __init__(self, sampler: Sampler[int], size: int) -> None:
        self.sampler, self.size = sampler, size

    def __len__(self) -> int:
        return (len(self.sampler) + self.size - 1) // self.size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for i in self.sampler:
            batch.append(i)
            if len(batch) == self.size:
                yield batch
                batch = []
        if batch:
            yield batch


class GlobalAtStart(Sampler[int]):
    """A custom sampler drawing from the global torch RNG at its first next() (reproducible)."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(N).tolist()


class NumpyGlobal(Sampler[int]):
    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        yield from np.random.permutation(N).tolist()


class PythonGlobal(Sampler[int]):
    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        order = list(range(N))
        random.shuffle(order)
        yield from order


class TorchPerBatch(Sampler[int]):
    """Draws from the global torch RNG during the epoch: interleaved with the training loop's."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        left = list(range(N))
        while left:
            yield left.pop(int(torch.randint(len(left), ()).item()))


class NumpyOwn(Sampler[int]):
    """Holds a numpy Generator: its state is not in the loader's state."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        yield from self.rng.permutation(N).tolist()


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(7)


DATA = list(range(N))
PLACEMENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "loader": lambda: {"batch_size": B, "shuffle": True, "generator": _g()},
    "sampler": lambda: {"batch_size": B, "sampler": RandomSampler(DATA, generator=_g())},
    "batch_sampler.sampler": lambda: {
        "batch_sampler": BatchSampler(RandomSampler(DATA, generator=_g()), B, False)
    },
    "custom_sampler": lambda: {"batch_size": B, "sampler": Gen(N, _g())},
    "custom_batch_sampler.sampler": lambda: {
        "batch_sampler": Chunks(RandomSampler(DATA, generator=_g()), B)
    },
    "loader_and_global_sampler": lambda: {
        "batch_size": B,
        "sampler": RandomSampler(DATA),
        "generator": _g(),
    },
    "global": lambda: {"batch_size": B, "shuffle": True},
    "custom_global_at_start": lambda: {"batch_size": B, "sampler": GlobalAtStart()},
}
WORKERS: dict[str, dict[str, Any]] = {
    "inline": {},
    "threads": {"num_workers": 2, "worker_type": "thread"},
    "processes": {"num_workers": 2},
}


def _loader(placement: str, workers: str) -> DataLoader:
    return DataLoader(DATA, **PLACEMENTS[placement](), **WORKERS[workers])


def _steps(batches: Iterator[Any], k: int | None = None) -> list[list[int]]:
    """Up to ``k`` batches (all without ``k``), each followed by a training step's own draws
    from the global RNG (dropout, say)."""
    out = []
    for batch in batches:
        out.append(batch.tolist())
        torch.rand(3)
        if len(out) == k:
            break
    return out


def _stop_and_resume(placement: str, workers: str) -> tuple[list[Any], list[Any]]:
    """(uninterrupted epochs 0-2, stopped-then-resumed epochs 0-2): the stop is after K
    batches of epoch 1, the resume in a fresh loader, with the global RNG the user restored."""
    torch.manual_seed(0)
    full = _loader(placement, workers)
    want = [_steps(iter(full)) for _ in range(3)]
    torch.manual_seed(0)
    a = _loader(placement, workers)
    got = [_steps(iter(a))]
    it = iter(a)
    first = _steps(it, K)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every RNG is held: no warning
        state = json.loads(json.dumps(a.state_dict()))
    user = torch.get_rng_state()  # what ckpt's rng=True saves and restores
    del it, a
    torch.manual_seed(12345)  # a restarted job: the RNG is anywhere until restored
    b = _loader(placement, workers)
    torch.set_rng_state(user)
    b.load_state_dict(state)
    it = iter(b)
    rest = [next(it).tolist()]
    assert torch.equal(torch.get_rng_state(), user)  # the resume drew nothing from it
    torch.rand(3)
    got.append(first + rest + _steps(it))
    got.append(_steps(iter(b)))
    return want, got


@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_resume_is_exact_for_every_generator_placement(placement: str, workers: str) -> None:
    want, got = _stop_and_resume(placement, workers)
    assert sorted(i for b in got[1] for i in b) == list(range(N))  # none repeated or missing
    assert want[0] != want[1]  # the epochs differ: the test can tell them apart
    assert got == want


def test_nested_generator_is_in_the_state() -> None:
    loader = _loader("batch_sampler.sampler", "inline")
    assert sorted(loader.state_dict()["rng"]) == ["batch_sampler.sampler", "loader"]


def test_state_from_other_generators_is_refused() -> None:
    state = _loader("batch_sampler.sampler", "inline").state_dict()
    with pytest.raises(ValueError, match=r"batch_sampler\.sampler"):
        _loader("global", "inline").load_state_dict(state)


@pytest.mark.parametrize(
    "sampler,what",
    [
        (NumpyGlobal(), "NumpyGlobal.*numpy's global RNG"),
        (PythonGlobal(), "PythonGlobal.*Python's global `random`"),
        (TorchPerBatch(), "TorchPerBatch.*global torch RNG after its first batch"),
        (NumpyOwn(), r"NumpyOwn.*Generator in \.rng"),
    ],
)
@pytest.mark.parametrize("workers", ["inline", "threads"])
def test_uncapturable_rng_warns_at_state_dict(sampler: Any, what: str, workers: str) -> None:
    loader = DataLoader(DATA, batch_size=B, sampler=sampler, **WORKERS[workers])
    it = iter(loader)
    next(it), next(it)  # a sampler is watched over its first two batches
    with pytest.warns(RuntimeWarning, match=what):
        loader.state_dict()


def test_deterministic_custom_sampler_does_not_warn() -> None:
    loader = DataLoader(DATA, batch_sampler=Chunks(list(range(N))[::-1], B))  # type: ignore[arg-type]
    it = iter(loader)
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()
