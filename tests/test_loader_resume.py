"""Resume: stop after k batches, save, resume in a fresh process -> the uninterrupted batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, RandomSampler

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
