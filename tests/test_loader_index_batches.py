"""Vectorised index batches: exactly torch's batches and RNG draws, batch by batch."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import fixed_int32_dataset as _fixed
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from feedpipe import DataLoader, DistributedSampler, MemmapDataset, MemmapWriter, TokenWindows
from feedpipe.loader.index_stream import index_batches

SIZES = [1, 2, 7, 10, 31, 64, 100]
BATCHES = [1, 3, 8, 10, 64, 128]


def _vectorised(batch_sampler: Any) -> bool:
    it = index_batches(batch_sampler)
    return getattr(it, "__qualname__", "") in {"_random", "_sequential", "_distributed"}


def _rng_states(gen: torch.Generator | None) -> torch.Tensor:
    return (gen.get_state() if gen is not None else torch.get_rng_state()).clone()


def _lockstep(make: Any, gen: torch.Generator | None, extra: Any = None) -> int:
    """Step torch's iterator and ours side by side from the same RNG state; compare each step.

    After every ``next()`` (including the final StopIteration) the batch, the RNG state and
    ``extra()`` (sampler bookkeeping) must be equal. Returns the number of batches.
    """
    start = _rng_states(gen)

    def steps(it_of: Any) -> list[tuple[Any, torch.Tensor, Any]]:
        if gen is None:
            torch.set_rng_state(start)
        else:
            gen.set_state(start)
        it: Iterator[Any] = it_of(make())
        out = []
        for _ in range(10_000):
            batch = next(it, None)
            out.append((batch, _rng_states(gen), extra() if extra else None))
            if batch is None:
                return out
        raise AssertionError("no end")  # pragma: no cover

    theirs, ours = steps(iter), steps(index_batches)
    assert len(ours) == len(theirs)
    for (b1, s1, e1), (b2, s2, e2) in zip(theirs, ours, strict=True):
        assert b1 == b2 and type(b2) is type(b1)
        assert torch.equal(s1, s2)
        assert e1 == e2
    return len(ours) - 1


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_random_sampler_batches_and_draws_match_torch(drop_last: bool, seeded: bool) -> None:
    for n, bs in itertools.product(SIZES, BATCHES):
        gen = torch.Generator().manual_seed(n * 1000 + bs) if seeded else None
        if gen is None:
            torch.manual_seed(n * 1000 + bs)

        def make(n: int = n, bs: int = bs, gen: Any = gen) -> BatchSampler:
            return BatchSampler(RandomSampler(range(n), generator=gen), bs, drop_last)

        assert _vectorised(make())
        expected = n // bs if drop_last else -(-n // bs)
        assert _lockstep(make, gen) == expected


@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_sampler_matches_torch(drop_last: bool) -> None:
    for n, bs in itertools.product([0, *SIZES], BATCHES):
        make = lambda n=n, bs=bs: BatchSampler(SequentialSampler(range(n)), bs, drop_last)  # noqa: E731
        _lockstep(make, None)


def test_empty_random_sampler_raises_like_torch() -> None:
    class Sized:
        n = 3

        def __len__(self) -> int:
            return self.n

    ds = Sized()
    bs = BatchSampler(RandomSampler(ds), 2, False)
    ds.n = 0  # the dataset shrank after the sampler was made
    with pytest.raises(ZeroDivisionError):
        next(iter(bs))
    with pytest.raises(ZeroDivisionError):
        next(index_batches(bs))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"shuffle": False},
        {"drop_last": True},
        {"pad": False},
        {"pad": False, "equal_batches": True, "batch_size": 4},
        {"shuffle_mode": "block", "block_size": 8, "block_window": 2},
        {"permutation": "feistel"},
    ],
)
def test_distributed_sampler_matches_its_own_iterator(kw: dict[str, Any]) -> None:
    cases = [(1, 1), (13, 4), (100, 1), (100, 64), (9000, 100)]  # 9000: crosses a chunk
    for (n, bs), world, drop in itertools.product(cases, [1, 3], [False, True]):
        for rank in range(world):

            def make(
                n: int = n, world: int = world, rank: int = rank, bs: int = bs, drop: bool = drop
            ) -> Any:
                s = DistributedSampler(range(n), world, rank, seed=5, **kw)
                s.set_epoch(2)
                make.sampler = s  # type: ignore[attr-defined]
                return BatchSampler(s, bs, drop)

            def extra(make: Any = make) -> Any:
                return make.sampler.state_dict()

            _lockstep(make, None, extra)


def test_distributed_sampler_resumed_mid_epoch() -> None:
    for consumed in (0, 5, 64, 8200, 9000):
        states = []
        for _ in range(2):
            s = DistributedSampler(range(20_000), 2, 1, seed=3)
            s.load_state_dict({**s.state_dict(), "consumed": consumed})
            states.append(s)
        bs1, bs2 = BatchSampler(states[0], 32, False), BatchSampler(states[1], 32, False)
        assert list(iter(bs1)) == list(index_batches(bs2))
        assert states[0].state_dict() == states[1].state_dict()


def test_other_samplers_take_the_generic_path() -> None:
    class MyRandom(RandomSampler):
        pass

    class MyBatch(BatchSampler):
        pass

    generic = [
        BatchSampler(MyRandom(range(10)), 3, False),
        BatchSampler(RandomSampler(range(10), replacement=True), 3, False),
        BatchSampler(RandomSampler(range(10), num_samples=25), 3, False),
        MyBatch(SequentialSampler(range(10)), 3, False),
        BatchSampler(range(10), 3, False),
    ]
    for bs in generic:
        assert not _vectorised(bs)
        torch.manual_seed(0)
        ours = list(index_batches(bs))
        torch.manual_seed(0)
        assert ours == list(bs)
    assert _vectorised(BatchSampler(SequentialSampler(range(10)), 3, False))
    assert _vectorised(BatchSampler(DistributedSampler(range(10), 1, 0), 3, False))


class _Ints(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_batches_and_rng_match_torch_over_seeds(num_workers: int) -> None:
    kw: dict[str, Any] = {"num_workers": num_workers, "worker_type": "thread"}
    for seed, (n, bs, drop) in enumerate(itertools.product([5, 33, 64], [1, 4, 16], [0, 1])):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        a = torch.utils.data.DataLoader(_Ints(n), bs, True, drop_last=bool(drop), generator=g1)
        b = DataLoader(_Ints(n), bs, True, drop_last=bool(drop), generator=g2, **kw)
        for _ in range(2):  # two epochs: the second starts from the RNG state the first left
            assert [t.tolist() for t in a] == [t.tolist() for t in b]
            assert torch.equal(g1.get_state(), g2.get_state())


@pytest.mark.parametrize("shuffle", [False, True])
def test_arrays_are_the_same_batches(shuffle: bool) -> None:
    def make() -> Any:
        sampler = RandomSampler(range(103), generator=torch.Generator().manual_seed(4))
        return BatchSampler(sampler if shuffle else SequentialSampler(range(103)), 10, False)

    lists, arrays = list(index_batches(make())), list(index_batches(make(), arrays=True))
    assert all(type(a).__name__ == "ndarray" and a.dtype.name == "int64" for a in arrays)
    assert [a.tolist() for a in arrays] == lists


def test_own_datasets_get_index_arrays_and_others_lists(tmp_path: Any) -> None:
    import numpy as np

    from feedpipe import MemmapDataset, MemmapWriter

    with MemmapWriter(tmp_path / "ds", shape=(2,), dtype="int64") as w:
        w.append_batch(np.arange(40).reshape(20, 2))
    seen: list[type] = []

    class Spy(MemmapDataset):
        def read_batch(self, indices: Any, out: Any = None) -> Any:
            seen.append(type(indices))
            return super().read_batch(indices, out)

    class UserDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 20

        def read_batch(self, indices: Any) -> Any:
            seen.append(type(indices))
            return torch.tensor(indices)

    got = list(DataLoader(Spy(tmp_path / "ds"), batch_size=8, shuffle=True, num_workers=0))
    assert seen and set(seen) == {np.ndarray} and sum(len(b) for b in got) == 20
    seen.clear()
    loader = DataLoader(Spy(tmp_path / "ds"), batch_size=8, num_workers=2, worker_type="thread")
    batches = list(loader)
    assert batches[0][:, 0].tolist() == list(range(0, 16, 2)) and len(batches) == 3
    assert set(seen) == {np.ndarray}
    seen.clear()
    assert len(list(DataLoader(UserDataset(), batch_size=8, num_workers=0))) == 3
    assert set(seen) == {list}


def _tokens(path: Path) -> None:
    with MemmapWriter(path, records=False, fields={"tokens": ("int32", (None,))}) as w:
        for doc in ([1, 2, 3], [], [4, 5, 6, 7, 8, 9]):
            w.append(tokens=doc)


@pytest.mark.parametrize("kind", ["memmap", "tokens"])
def test_batch_indices_refuse_bool_masks_and_uint64_beyond_int64(tmp_path: Path, kind: str) -> None:
    """Found: MemmapDataset.read_batch took a bool mask as indices 1 and 0 (while ds[True] is a
    TypeError), and a uint64 index of 2**64-1 wrapped to -1 and read the last record, silently
    (TokenWindows too)."""
    if kind == "memmap":
        _fixed(tmp_path / "d")
        ds: Any = MemmapDataset(tmp_path / "d")
    else:
        _tokens(tmp_path / "d")
        ds = TokenWindows(tmp_path / "d", block_size=2)
    n = len(ds)
    for mask in ([True, False, True], np.array([True, False]), torch.tensor([False, True])):
        with pytest.raises(TypeError, match="integers, got bool"):
            ds.read_batch(mask)
    for big in (np.array([0, 2**64 - 1], np.uint64), [2**63], np.array([2**63], np.uint64)):
        with pytest.raises(IndexError, match=str(int(np.asarray(big)[-1]))):
            ds.read_batch(big)
    assert torch.equal(ds.read_batch(np.array([n - 1], np.uint64)), ds.read_batch([-1]))
    assert torch.equal(ds.read_batch(np.array([-1, 0], np.int8)), ds.read_batch([n - 1, 0]))
