"""Attacks on the vectorised ``RandomSampler`` batches (``index_stream._random``), which now
skips torch's discarded end-of-epoch ``randperm`` when the epoch's generator is its own (seeded
from the global RNG, seen by nobody else).

Everything a user can observe must stay torch's: each batch, the global RNG state and the
sampler's / loader's generator state, batch by batch with no workers and epoch by epoch with
workers (thread or process, persistent or not), for every sampler spelling (``shuffle=True``,
``sampler=``, ``batch_sampler=``, ``replacement=True``, ``num_samples``), and a ``state_dict()``
saved mid-epoch or at an epoch's end resumes to torch's batches and generator state, also into
a loader with another worker count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import BatchSampler, RandomSampler

import feedpipe


class _Ints(tud.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


N = 23

SPELLINGS: dict[str, Callable[[torch.Generator | None], dict[str, Any]]] = {
    "shuffle": lambda g: {"batch_size": 5, "shuffle": True, "generator": g},
    "shuffle_drop": lambda g: {"batch_size": 5, "shuffle": True, "generator": g, "drop_last": True},
    "sampler": lambda g: {"batch_size": 4, "sampler": RandomSampler(_Ints(N), generator=g)},
    "batch_sampler": lambda g: {
        "batch_sampler": BatchSampler(RandomSampler(_Ints(N), generator=g), 6, False)
    },
    "replacement": lambda g: {
        "batch_size": 4,
        "sampler": RandomSampler(_Ints(N), replacement=True, num_samples=30, generator=g),
    },
    "num_samples": lambda g: {
        "batch_size": 4,
        "sampler": RandomSampler(_Ints(N), num_samples=2 * N + 3, generator=g),
    },
    "one_batch": lambda g: {"batch_size": N, "shuffle": True, "generator": g},
}


def _observed(gen: torch.Generator | None) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    return states if gen is None else [*states, gen.get_state()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _run(
    make: Callable[[], Any], gen: torch.Generator | None, epochs: int, per_batch: bool
) -> list[Any]:
    """Batches and RNG states of ``epochs`` epochs, from seed 7 (and the generator at seed 11)."""
    torch.manual_seed(7)
    if gen is not None:
        gen.manual_seed(11)
    loader = make()
    seen: list[Any] = []
    for _ in range(epochs):
        it = iter(loader)
        while (batch := next(it, None)) is not None:
            seen.append(batch.tolist())
            if per_batch:
                seen.append(_observed(gen))
        seen.append(_observed(gen))  # after the StopIteration: the discarded draw is made
    return seen


def _equal(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            assert _same(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_no_workers_batch_by_batch_rng_is_torchs(spelling: str, seeded: bool) -> None:
    gen = torch.Generator() if seeded else None
    kw = SPELLINGS[spelling]
    want = _run(lambda: tud.DataLoader(_Ints(N), **kw(gen)), gen, 3, True)
    got = _run(lambda: feedpipe.DataLoader(_Ints(N), **kw(gen)), gen, 3, True)
    _equal(got, want)


WORKERS: dict[str, dict[str, Any]] = {
    "threads": {"num_workers": 2, "worker_type": "thread"},
    "threads_persistent": {"num_workers": 2, "worker_type": "thread", "persistent_workers": True},
    "processes": {"num_workers": 2, "worker_type": "process"},
}


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("workers", sorted(WORKERS))
@pytest.mark.parametrize("spelling", ["shuffle", "shuffle_drop", "batch_sampler"])
def test_workers_epoch_by_epoch_rng_is_torchs(spelling: str, workers: str, seeded: bool) -> None:
    gen = torch.Generator() if seeded else None
    kw, wk = SPELLINGS[spelling], WORKERS[workers]
    torch_kw = {k: v for k, v in wk.items() if k != "worker_type"}
    epochs = 2
    want = _run(
        lambda: tud.DataLoader(_Ints(N), timeout=60, **kw(gen), **torch_kw), gen, epochs, False
    )
    got = _run(
        lambda: feedpipe.DataLoader(_Ints(N), timeout=60, **kw(gen), **wk), gen, epochs, False
    )
    _equal(got, want)


def _torch_epochs(gen: torch.Generator, epochs: int) -> tuple[list[list[int]], torch.Tensor]:
    torch.manual_seed(7)
    gen.manual_seed(11)
    loader = tud.DataLoader(_Ints(N), batch_size=5, shuffle=True, generator=gen)
    batches = [b.tolist() for _ in range(epochs) for b in loader]
    return batches, gen.get_state()


@pytest.mark.parametrize("stop", [2, 5, 6, 10])  # mid-epoch, at the epoch's end (5 batches), ...
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"num_workers": 2, "worker_type": "thread", "timeout": 60}, {}),
        ({}, {"num_workers": 2, "worker_type": "process", "timeout": 60}),
    ],
)
def test_resume_gives_torchs_rest_and_generator_state(
    stop: int, before: dict[str, Any], after: dict[str, Any]
) -> None:
    """Two epochs of 5 batches; stopped after ``stop`` batches, saved, resumed in a new loader
    (another worker count) with a fresh generator: the rest, and the generator's final state,
    are torch's uninterrupted run's."""
    want, want_state = _torch_epochs(torch.Generator(), 2)
    torch.manual_seed(7)
    g1 = torch.Generator().manual_seed(11)
    a = feedpipe.DataLoader(_Ints(N), batch_size=5, shuffle=True, generator=g1, **before)
    got: list[list[int]] = []
    it = iter(a)
    while len(got) < stop:
        batch = next(it, None)
        if batch is None:
            it = iter(a)
            continue
        got.append(batch.tolist())
    state = json.loads(json.dumps(a.state_dict()))
    del it
    g2 = torch.Generator().manual_seed(12345)
    b = feedpipe.DataLoader(_Ints(N), batch_size=5, shuffle=True, generator=g2, **after)
    b.load_state_dict(state)
    for _ in range(3):  # the saved epoch's rest (maybe empty, still a pass), then the next
        got += [x.tolist() for x in b]
        if len(got) >= len(want):
            break
    assert got == want
    assert torch.equal(g2.get_state(), want_state)
