"""Resume reproduces the order from every RNG that decides it, and leaves the user's RNG alone.

Issue 16, points 1 and 2. Every check compares a run stopped mid-epoch and resumed in a fresh
loader with the run that was never interrupted: the concatenation must be the same batches, in
the same order (so none repeated, none missing), and the global torch RNG must be exactly where
the user put it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler

from feedpipe import DataLoader, MemmapWriter

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


# ------------------------------------------------------------------ point 2: the global RNG
def _global_loader(workers: str, **kw: Any) -> DataLoader:
    return DataLoader(DATA, batch_size=B, shuffle=True, **WORKERS[workers], **kw)


@pytest.mark.parametrize("workers", list(WORKERS))
def test_torch_order_and_draws_unchanged_without_resume(workers: str) -> None:
    """No resume: feedpipe draws from the global RNG exactly as torch's DataLoader does."""
    torch.manual_seed(3)
    theirs = [_steps(iter(torch.utils.data.DataLoader(DATA, batch_size=B, shuffle=True)))
              for _ in range(2)]  # fmt: skip
    after = torch.get_rng_state()
    torch.manual_seed(3)
    loader = _global_loader(workers)
    assert [_steps(iter(loader)) for _ in range(2)] == theirs
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("workers", list(WORKERS))
def test_resume_twice_leaves_the_global_rng_alone(workers: str) -> None:
    torch.manual_seed(0)
    full = _global_loader(workers)
    want = [_steps(iter(full)) for _ in range(2)]
    want_rng = torch.get_rng_state()
    torch.manual_seed(0)
    a = _global_loader(workers)
    _steps(iter(a))
    got = _steps(iter(a), K)
    state, user = a.state_dict(), torch.get_rng_state()
    for stop in (2, None):  # resume, stop again 2 batches later, resume again
        b = _global_loader(workers)
        torch.set_rng_state(user)
        b.load_state_dict(json.loads(json.dumps(state)))
        got += _steps(iter(b), stop)
        state, user = b.state_dict(), torch.get_rng_state()
    assert got == want[1]
    assert torch.equal(torch.get_rng_state(), want_rng)  # the same draws, dropout included


@pytest.mark.parametrize("restored", [True, False])
@pytest.mark.parametrize("workers", ["inline", "processes", "persistent_threads"])
def test_epoch_boundary_state(workers: str, restored: bool) -> None:
    """Saved between epochs: with the user's RNG restored the next epoch draws from it, as the
    uninterrupted run does; without, the order is still reproduced and the RNG left alone."""
    kw = {"persistent_workers": True} if workers.startswith("persistent") else {}
    workers = workers.removeprefix("persistent_")
    torch.manual_seed(0)
    full = _global_loader(workers, **kw)
    want = [_steps(iter(full)) for _ in range(2)]
    want_rng = torch.get_rng_state()
    torch.manual_seed(0)
    a = _global_loader(workers, **kw)
    _steps(iter(a))
    state, user = a.state_dict(), torch.get_rng_state()
    assert state["in_epoch"] is False
    torch.manual_seed(99)
    other = torch.get_rng_state()
    b = _global_loader(workers, **kw)
    b.load_state_dict(state)
    if restored:
        torch.set_rng_state(user)
    assert _steps(iter(b)) == want[1]
    if restored:
        assert torch.equal(torch.get_rng_state(), want_rng)
    else:  # only the training loop's own draws moved it
        after = torch.get_rng_state()
        torch.set_rng_state(other)
        _steps(iter(torch.tensor(want[1])))
        assert torch.equal(after, torch.get_rng_state())


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_persistent_workers_resume_leaves_the_global_rng_alone(worker_type: str) -> None:
    kw = {"batch_size": B, "shuffle": True, "num_workers": 2, "persistent_workers": True,
          "worker_type": worker_type}  # fmt: skip
    torch.manual_seed(0)
    full = DataLoader(DATA, **kw)
    want = [_steps(iter(full)) for _ in range(2)]
    torch.manual_seed(0)
    a = DataLoader(DATA, **kw)
    _steps(iter(a))
    it = iter(a)
    got = _steps(it, K)
    state, user = a.state_dict(), torch.get_rng_state()
    del it
    b = DataLoader(DATA, **kw)
    torch.set_rng_state(user)
    b.load_state_dict(state)
    it = iter(b)
    rest = [next(it).tolist()]
    assert torch.equal(torch.get_rng_state(), user)
    torch.rand(3)
    assert got + rest + _steps(it) == want[1]


def test_load_state_dict_and_iter_do_not_touch_the_global_rng() -> None:
    """The issue's direct check: after load_state_dict + iter(), torch.get_rng_state() is what
    the user set, at every point of the resumed epoch."""
    a = _global_loader("threads")
    it = iter(a)
    for _ in range(K):
        next(it)
    state = a.state_dict()
    torch.manual_seed(2024)
    mine = torch.get_rng_state()
    b = _global_loader("threads")
    b.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), mine)
    for _ in iter(b):
        assert torch.equal(torch.get_rng_state(), mine)


def test_readme_loader_killed_and_resumed_trains_bit_identically(tmp_path: Path) -> None:
    """The README's loader (shuffle=True, no generator=, thread workers) in a loop with dropout,
    saved by ckpt with rng=True, SIGKILLed mid-epoch twice: the parameters after resuming are
    bit for bit those of the run that was never interrupted, and so is every step's batch."""
    data = tmp_path / "data"
    with MemmapWriter(data, shape=(8,), dtype="float32") as w:  # record i starts with i
        w.append_batch(np.arange(200, dtype=np.float32)[:, None] * np.ones(8, np.float32))
    steps = 30  # 13 batches an epoch: the kills are in epochs 0 and 1, after saves at 8 and 16
    script = str(Path(__file__).with_name("_resume_dropout_train.py"))
    args = [sys.executable, script, str(data), str(tmp_path), str(steps), "10", "19"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = torch.load(tmp_path / "full" / "params.pt")
    resumed = torch.load(tmp_path / "killed" / "params.pt")
    for name, value in full.items():
        assert torch.equal(value, resumed[name]), name
    want = (tmp_path / "full" / "steps.log").read_text().split("\n")
    log = (tmp_path / "killed" / "steps.log").read_text().split("\n")
    done = dict(line.split() for line in log if line)  # a redone step logs its batch again
    assert done == dict(line.split() for line in want if line)
    assert len(log) == len(want) + (10 - 8) + (19 - 16)  # both resumes were mid-epoch


@pytest.mark.parametrize("bad", ["not base64!", "AAAA", 7, None])
def test_corrupt_rng_state_is_refused_at_load(bad: Any) -> None:
    loader = _loader("batch_sampler.sampler", "inline")
    state = json.loads(json.dumps(loader.state_dict()))
    state["rng"]["batch_sampler.sampler"] = bad
    with pytest.raises(ValueError, match=r"RNG state for 'batch_sampler\.sampler'"):
        _loader("batch_sampler.sampler", "inline").load_state_dict(state)


class _Draw(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each sample is its index and the workers' base seed, so both the order and the seed the
    workers started with show in the batches."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        import feedpipe

        info = feedpipe.get_worker_info()
        assert info is not None
        return torch.tensor([i, (info.seed - info.id) % (1 << 30)])


@pytest.mark.parametrize("global_rng", [False, True], ids=["generator", "global"])
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_state_saved_before_persistent_workers_started_replays_their_first_epoch(
    kind: str, global_rng: bool
) -> None:
    """``state_dict()`` before any pass, a pass (which starts persistent workers), then
    ``load_state_dict()``: the next epoch is the first one, workers' draws included (the workers
    start anew so that the base seed is drawn again; found by the headspace helper)."""

    def make() -> DataLoader:
        gen = None if global_rng else torch.Generator().manual_seed(7)
        return DataLoader(
            _Draw(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
            worker_type=kind, generator=gen,
        )  # fmt: skip

    torch.manual_seed(3)
    expected = [b.tolist() for b in make()]
    torch.manual_seed(3)
    loader = make()
    state = loader.state_dict()
    first = [b.tolist() for b in loader]
    assert first == expected
    second = [b.tolist() for b in loader]
    assert second != expected  # the test can tell epochs apart
    torch.manual_seed(3)
    loader.load_state_dict(state)
    assert [b.tolist() for b in loader] == expected
    del loader
