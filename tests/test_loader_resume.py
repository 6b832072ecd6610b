"""Resume: stop after k batches, save, resume in a fresh process -> the uninterrupted batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data import DistributedSampler as TorchDistributedSampler

import feedpipe
from feedpipe import DataLoader

HERE = Path(__file__).resolve().parent


class Squares(Dataset):
    """Counts its reads so a test can check that resume reads no skipped sample."""

    def __init__(self, n: int = 30) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        return {"i": i, "sq": torch.tensor([i * i], dtype=torch.int64)}


class Counter(IterableDataset):
    """An iterable dataset that knows its position in the epoch (state_dict/load_state_dict)."""

    def __init__(self, n: int = 26) -> None:
        self.n, self.pos = n, 0

    def __iter__(self) -> Any:
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0  # the next pass is a new epoch

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class NoState(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(5))


CASES: dict[str, dict[str, Any]] = {
    "sequential": {"batch_size": 4},
    "shuffle": {"batch_size": 4, "shuffle": True},
    "shuffle_process_workers": {"batch_size": 4, "shuffle": True, "num_workers": 2},
    "shuffle_thread_workers": {
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 2,
        "worker_type": "thread",
    },
    "persistent_process_workers": {
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 2,
        "persistent_workers": True,
    },
    "persistent_thread_workers": {
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 2,
        "persistent_workers": True,
        "worker_type": "thread",
    },
    "global_rng": {"batch_size": 3, "shuffle": True, "generator": None},
    "sampler_generator": {"batch_size": 3, "num_workers": 2, "sampler": "random-own-generator"},
    "distributed_sampler": {"batch_size": 4, "num_workers": 2, "sampler": "distributed"},
    "no_batching": {"batch_size": None, "shuffle": True, "num_workers": 2, "worker_type": "thread"},
    "iterable": {"batch_size": 4, "dataset": "counter"},
}


def make(case: str) -> DataLoader:
    """Build the loader for ``case`` exactly as a restarted training job would."""
    kw = dict(CASES[case])
    ds: Any = Counter() if kw.pop("dataset", None) == "counter" else Squares()
    if kw.get("generator", 0) is None:
        torch.manual_seed(1234)
    else:
        kw["generator"] = torch.Generator().manual_seed(99)
    if kw.get("sampler") == "random-own-generator":
        kw["sampler"] = RandomSampler(ds, generator=torch.Generator().manual_seed(5))
    elif kw.get("sampler") == "distributed":
        kw["sampler"] = feedpipe.DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    return DataLoader(ds, **kw)


def epoch(loader: DataLoader, e: int) -> list[Any]:
    if isinstance(loader.sampler, feedpipe.DistributedSampler):
        loader.sampler.set_epoch(e)
    return list(loader)


def take(loader: DataLoader, e: int, k: int) -> list[Any]:
    if isinstance(loader.sampler, feedpipe.DistributedSampler):
        loader.sampler.set_epoch(e)
    it = iter(loader)
    out = [next(it) for _ in range(k)]
    del it
    return out


K = 3  # batches taken before the stop


def _resume_in_fresh_process(states: dict[str, Any], out: Path) -> None:
    """One new interpreter resumes every case from its saved state and saves the rest of epoch 1."""
    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[1]);"
        "import test_loader_resume as m;"
        "states = json.loads(open(sys.argv[2]).read()); rest = {}\n"
        "for case, state in states.items():\n"
        "    loader = m.make(case); loader.load_state_dict(state)\n"
        "    rest[case] = m.epoch(loader, 1)\n"
        "torch.save(rest, sys.argv[3])"
    )
    (out.parent / "states.json").write_text(json.dumps(states))
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    args = [sys.executable, "-c", code, str(HERE), str(out.parent / "states.json"), str(out)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_batches_equal(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        _same(x, y)


def _same(x: Any, y: Any) -> None:
    assert type(x) is type(y)
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and torch.equal(x, y)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for key in x:
            _same(x[key], y[key])
    else:
        assert x == y


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uninterrupted epochs 0-1 per case, and epoch 1 resumed after K batches in a fresh process."""
    want, states = {}, {}
    for case in CASES:
        full = make(case)
        want[case] = [epoch(full, 0), epoch(full, 1)]
        stopped = make(case)
        assert_batches_equal(epoch(stopped, 0), want[case][0])
        assert_batches_equal(take(stopped, 1, K), want[case][1][:K])
        states[case] = json.loads(json.dumps(stopped.state_dict()))  # plain, JSON-able
    out = tmp_path_factory.mktemp("resume") / "rest.pt"
    _resume_in_fresh_process(states, out)
    return {"want": want, "states": states, "rest": torch.load(out, weights_only=False)}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_in_fresh_process(case: str, resumed: dict[str, Any]) -> None:
    want, rest = resumed["want"][case][1], resumed["rest"][case]
    assert resumed["states"][case]["batches"] == K
    assert len(rest) == len(want) - K
    assert_batches_equal(rest, want[K:])


@pytest.mark.parametrize(
    "case",
    ["shuffle", "shuffle_thread_workers", "persistent_process_workers", "distributed_sampler"],
)
def test_resume_at_epoch_boundary_and_twice(case: str) -> None:
    full = make(case)
    want = [epoch(full, e) for e in range(3)]
    a = make(case)
    epoch(a, 0)
    boundary = a.state_dict()  # between epochs: the next epoch starts fresh
    assert boundary["in_epoch"] is False
    b = make(case)
    b.load_state_dict(boundary)
    got = take(b, 1, 2)
    c = make(case)
    c.load_state_dict(b.state_dict())  # resume a resumed loader
    got += take(c, 1, 3)
    d = make(case)
    d.load_state_dict(c.state_dict())
    got += epoch(d, 1)
    assert_batches_equal(got, want[1])
    assert_batches_equal(epoch(d, 2), want[2])


def test_resume_reads_no_skipped_sample() -> None:
    a = make("shuffle")
    take(a, 0, 5)
    b = make("shuffle")
    b.load_state_dict(a.state_dict())
    rest = epoch(b, 0)
    assert len(rest) == 8 - 5
    assert b.dataset.reads == 30 - 5 * 4


def test_stateful_sampler_gets_delivered_count() -> None:
    loader = make("distributed_sampler")  # 2 process workers prefetch ahead of the user
    got = take(loader, 0, 2)
    state = loader.state_dict()
    assert state["sampler"]["consumed"] == sum(len(b["i"]) for b in got) == 8
    sampler_state = loader.sampler.state_dict()
    assert sampler_state["consumed"] > 8  # the sampler itself ran ahead (prefetch)


def test_iterable_without_state_cannot_save() -> None:
    loader = DataLoader(NoState(), batch_size=2)
    next(iter(loader))
    with pytest.raises(ValueError, match=r"NoState.*state_dict"):
        loader.state_dict()
    with pytest.raises(ValueError, match="num_workers=0"):
        DataLoader(Counter(), batch_size=2, num_workers=1).state_dict()


def test_bad_states_are_rejected() -> None:
    loader = make("shuffle")
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict({"version": 99})
    with pytest.raises(ValueError, match="missing keys"):
        loader.load_state_dict({"version": 1, "batches": 2})
    other = make("distributed_sampler").state_dict()
    with pytest.raises(ValueError, match="sampler state"):
        loader.load_state_dict(other)
    with pytest.raises(ValueError, match="in_order=True"):
        DataLoader(Squares(), num_workers=1, in_order=False).state_dict()


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
