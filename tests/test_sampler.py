"""In-process tests of feedpipe.DistributedSampler: torch equality, coverage, resume arithmetic.

Every rank is simulated by its own sampler object (the arithmetic is the same on real ranks);
tests/test_sampler_dist.py runs representative cases on real gloo process groups.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from feedpipe import DistributedSampler
from feedpipe._permutation import BlockPermutation, FeistelPermutation


def _ranks(n: int, world: int, state: dict[str, Any] | None = None, epoch: int = 0, **opts: Any):
    samplers = [DistributedSampler(range(n), world, r, **opts) for r in range(world)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch)  # the usual training loop calls set_epoch after loading
    return samplers


def _epoch(n: int, world: int, **kw: Any) -> list[list[int]]:
    return [list(s) for s in _ranks(n, world, **kw)]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------- torch equality
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_identical_to_torch(shuffle: bool, drop_last: bool) -> None:
    for n, world, seed, epoch in itertools.product(
        [0, 1, 2, 7, 10, 33, 100], [1, 2, 3, 4, 8], [0, 1234], [0, 3]
    ):
        for rank in range(world):
            ours = DistributedSampler(range(n), world, rank, shuffle, seed, drop_last)
            ref = torch.utils.data.DistributedSampler(
                range(n), world, rank, shuffle, seed, drop_last
            )
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref), (n, world, rank, seed, epoch)
            assert len(ours) == len(ref)
            assert (ours.num_samples, ours.total_size) == (ref.num_samples, ref.total_size)


def test_epochs_differ_and_repeat_like_torch() -> None:
    s = DistributedSampler(range(50), 2, 0, seed=3)
    first, again = list(s), list(s)
    assert first == again  # without set_epoch the order repeats, as in torch
    s.set_epoch(1)
    assert list(s) != first


# ------------------------------------------------------------------ coverage, pad=False
@pytest.mark.parametrize("mode", ["global", "block"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_no_pad_every_sample_once(mode: str, shuffle: bool) -> None:
    for n, world in itertools.product([0, 1, 5, 64, 101, 1000], [1, 2, 3, 7, 8]):
        ranks = _epoch(n, world, pad=False, shuffle=shuffle, shuffle_mode=mode, block_size=16)
        flat = [i for r in ranks for i in r]
        assert sorted(flat) == list(range(n))
        lens = [len(r) for r in ranks]
        assert max(lens) - min(lens) <= 1


@given(
    n=st.integers(0, 300), world=st.integers(1, 8), batch=st.integers(1, 9), seed=st.integers(0, 9)
)
@settings(max_examples=150, deadline=None)
def test_equal_batches_drops_least(n: int, world: int, batch: int, seed: int) -> None:
    ranks = _epoch(n, world, pad=False, equal_batches=True, batch_size=batch, seed=seed)
    batches = {_ceil(len(r), batch) for r in ranks}
    assert len(batches) == 1  # every rank runs the same number of batches
    flat = [i for r in ranks for i in r]
    assert len(flat) == len(set(flat))
    q, extra = divmod(n, world)
    dropped = extra if extra and q % batch == 0 else 0  # only when the extra costs a batch
    assert len(flat) == n - dropped


def test_equal_batches_drops_different_samples_each_epoch() -> None:
    dropped = set()
    for epoch in range(6):
        flat = {i for r in _epoch(10, 4, epoch=epoch, pad=False, equal_batches=True) for i in r}
        dropped.add(frozenset(set(range(10)) - flat))
    assert len(dropped) > 1


# ------------------------------------------------------------------ permutations
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 255, 256, 257, 10_007])
def test_feistel_is_bijection(n: int) -> None:
    p = FeistelPermutation(n, 99)
    values = p(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))
    assert (p.inverse(values) == np.arange(n)).all()


def test_feistel_scales_without_materialising() -> None:
    n = 10**10
    p = FeistelPermutation(n, 7)
    positions = np.arange(0, n, n // 100_000, dtype=np.int64)[:100_000]
    values = p(positions)
    assert values.min() >= 0 and values.max() < n
    assert len(np.unique(values)) == len(values)
    assert (p.inverse(values) == positions).all()
    # rank 9_999 of 10_000: its state is small and its first indices are cheap to get
    s = DistributedSampler(range(n), 10_000, 9_999, pad=False)
    it = iter(s)
    first = [next(it) for _ in range(5)]
    assert len(set(first)) == 5 and len(s) == n // 10_000
    assert len(json.dumps(s.state_dict())) < 500


@pytest.mark.parametrize("n,bs,window", [(1000, 10, 1), (1000, 16, 4), (997, 7, 3), (5, 8, 2)])
def test_block_permutation_is_bijection(n: int, bs: int, window: int) -> None:
    values = BlockPermutation(n, 3, bs, window)(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))


def test_block_shuffle_locality_and_mixing() -> None:
    n, bs, window, world = 10_000, 50, 4, 4
    epochs = []
    for epoch in range(2):
        ranks = _epoch(
            n,
            world,
            epoch=epoch,
            pad=False,
            shuffle_mode="block",
            block_size=bs,
            block_window=window,
        )
        stream = [ranks[j % world][j // world] for j in range(n)]  # the global order
        epochs.append(stream)
        blocks = np.array(stream) // bs
        span = window * bs
        for start in range(0, n - span + 1, 37):  # any `span` consecutive reads ...
            assert len(set(blocks[start : start + span].tolist())) <= 2 * window  # ... few blocks
        for r in ranks:  # and each rank alone reads few blocks at a time
            rb = np.array(r) // bs
            for start in range(0, len(r) - span // world, 13):
                assert len(set(rb[start : start + span // world].tolist())) <= 2 * window
        # mixing: the block order is shuffled, and samples of a window are interleaved
        first_blocks = list(dict.fromkeys(blocks.tolist()))
        assert first_blocks != sorted(first_blocks)
        assert np.mean(blocks[1:] != blocks[:-1]) > 0.5
    assert epochs[0] != epochs[1]


# ------------------------------------------------------------------ state and resume
def test_state_is_small_and_json() -> None:
    s = DistributedSampler(range(10**9), 64, 3, pad=False, seed=5)
    it = iter(s)
    for _ in range(10):
        next(it)
    state = s.state_dict()
    blob = json.dumps(state)
    assert len(blob) < 500
    assert state["consumed"] == 10 and state["seed"] == 5 and state["dataset_length"] == 10**9


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"pad": False},
        {"pad": False, "equal_batches": True, "batch_size": 3},
        {"drop_last": True},
        {"shuffle_mode": "block", "block_size": 8},
        {"shuffle": False},
    ],
)
def test_resume_same_world_is_exact(opts: dict[str, Any]) -> None:
    n, world = 103, 4
    full = _epoch(n, world, epoch=2, **opts)
    batch = opts.get("batch_size", 1)
    for steps in (0, 1, 2, 8, 9, 26, 27):  # batches every rank ran (lockstep)
        for saver in range(world):
            if saver and _ceil(len(full[saver]), batch) < steps:
                continue  # this rank ran out of batches first: only rank 0's state is valid
            samplers = _ranks(n, world, epoch=2, **opts)
            for s in samplers:  # the loader prefetches: the sampler runs ahead ...
                list(s)
            state = samplers[saver].state_dict()
            # ... and the loader overwrites `consumed` with what it delivered
            state["consumed"] = min(steps * batch, len(full[saver]))
            state = json.loads(json.dumps(state))
            resumed = _epoch(n, world, state=state, epoch=2, **opts)
            for r in range(world):
                used = min(steps * batch, len(full[r]))
                assert resumed[r] == full[r][used:], (steps, saver, r)
    # and the epoch after the resumed one starts fresh
    s = _ranks(n, world, state=state, epoch=2, **opts)[1]
    list(s)
    assert list(s) == full[1]


def _check_elastic(
    n: int, old: int, new: int, *, batch: int, steps: int, saver: int, opts: dict[str, Any]
) -> None:
    full = _epoch(n, old, epoch=1, batch_size=batch, **opts)
    used = [min(steps * batch, len(r)) for r in full]
    consumed = Counter(i for r, c in zip(full, used, strict=True) for i in r[:c])
    s = _ranks(n, old, epoch=1, batch_size=batch, **opts)[saver]
    list(s)
    state = s.state_dict()
    state["consumed"] = used[saver]
    resumed = _epoch(n, new, state=state, epoch=1, batch_size=batch, **opts)
    flat = [i for r in resumed for i in r]
    seen = Counter(flat)
    rest = set(range(n)) - set(consumed)
    if old == new:
        assert resumed == [r[c:] for r, c in zip(full, used, strict=True)]
        return
    assert not set(seen) & set(consumed), "a consumed sample was repeated"
    if opts.get("drop_last"):
        assert set(seen) <= rest and len(rest) - len(seen) < new
        assert len({len(r) for r in resumed}) == 1
    elif opts.get("pad", True):
        assert set(seen) == rest  # every remaining sample, padded with remaining ones only
        assert len({len(r) for r in resumed}) == 1
        assert len(flat) - len(rest) < new
    else:
        assert max(seen.values(), default=1) == 1
        lens = [len(r) for r in resumed]
        if opts.get("equal_batches"):
            assert len({_ceil(x, batch) for x in lens}) == 1
            assert set(seen) <= rest and len(rest) - len(seen) < new
        else:
            assert set(seen) == rest
            assert max(lens) - min(lens) <= 1


_OPTS = st.sampled_from(
    [
        {},
        {"pad": False},
        {"pad": False, "equal_batches": True},
        {"drop_last": True},
        {"pad": False, "shuffle_mode": "block", "block_size": 5},
        {"permutation": "feistel"},
        {"shuffle": False, "pad": False},
    ]
)


@given(
    n=st.integers(0, 200),
    old=st.integers(1, 8),
    new=st.integers(1, 8),
    batch=st.integers(1, 6),
    data=st.data(),
    opts=_OPTS,
)
@settings(max_examples=300, deadline=None)
def test_elastic_resume_property(  # noqa: PLR0917 - hypothesis arguments
    n: int, old: int, new: int, batch: int, data: st.DataObject, opts: dict[str, Any]
) -> None:
    lens = [len(r) for r in _epoch(n, old, epoch=1, batch_size=batch, **opts)]
    batches = [_ceil(x, batch) for x in lens]
    steps = data.draw(st.integers(0, max(batches, default=0)), label="steps")
    # in lockstep any rank's state will do; past a short rank's end, rank 0's (the longest)
    savers = [r for r in range(old) if batches[r] >= steps]
    saver = data.draw(st.sampled_from(savers), label="saver")
    _check_elastic(n, old, new, batch=batch, steps=steps, saver=saver, opts=opts)


@pytest.mark.parametrize("pad", [True, False])
def test_elastic_resume_twice(pad: bool) -> None:
    """8 ranks -> 3 ranks -> 5 ranks within one epoch: every sample once overall (pad=False)."""
    n = 1000
    seen: Counter[int] = Counter()
    state = None
    for world, stop in ((8, 40), (3, 60), (5, None)):
        samplers = _ranks(n, world, state=state, epoch=4, pad=pad)
        taken = [list(s)[:stop] for s in samplers]
        if stop is not None:
            assert len({len(t) for t in taken}) == 1
        for t in taken:
            seen.update(t)
        state = samplers[world - 1].state_dict()
        if stop is not None:
            state["consumed"] = state["consumed_base"] + stop
    assert set(seen) == set(range(n))
    if not pad:
        assert max(seen.values()) == 1
    else:
        assert sum(seen.values()) - n < 8 + 3 + 5


def test_set_epoch_discards_a_state_for_another_epoch() -> None:
    a = DistributedSampler(range(40), 2, 0)
    a.set_epoch(3)
    it = iter(a)
    for _ in range(5):
        next(it)
    b = DistributedSampler(range(40), 2, 0)
    b.load_state_dict(a.state_dict())
    assert b.epoch == 3 and len(b) == 15
    b.set_epoch(4)
    ref = DistributedSampler(range(40), 2, 0)
    ref.set_epoch(4)
    assert list(b) == list(ref)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"num_replicas": 4, "rank": 4},
            r"Invalid rank 4, rank should be in the interval \[0, 3\]",
        ),
        ({"num_replicas": 4, "rank": -1}, "Invalid rank -1"),
        ({"num_replicas": 0, "rank": 0}, "num_replicas"),
        ({"num_replicas": 2, "rank": 0, "seed": -1}, "Invalid seed -1"),
        ({"num_replicas": 2, "rank": 0, "shuffle_mode": "local"}, "shuffle_mode"),
        ({"num_replicas": 2, "rank": 0, "permutation": "random"}, "permutation"),
        ({"num_replicas": 2, "rank": 0, "batch_size": 0}, "batch_size"),
        ({"num_replicas": 2, "rank": 0, "block_size": 0}, "block_size"),
        ({"num_replicas": 2, "rank": 0, "shuffle_mode": "block", "permutation": "torch"}, "block"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedSampler(range(10), **kwargs)
    if "rank" in kwargs and kwargs.get("num_replicas", 1) > 0 and len(kwargs) == 2:
        with pytest.raises(ValueError, match=match):  # torch raises the same
            torch.utils.data.DistributedSampler(range(10), **kwargs)


def test_no_process_group_is_torch_error() -> None:
    with pytest.raises(ValueError, match="not been initialized"):
        torch.utils.data.DistributedSampler(range(10))
    with pytest.raises(ValueError, match="not been initialized"):
        DistributedSampler(range(10))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"dataset_length": 11}, "dataset_length is 11 in the state but 10 here"),
        ({"seed": 1}, "seed is 1 in the state but 0 here"),
        ({"permutation": "feistel"}, "permutation"),
        ({"consumed": 6}, "consumed=6"),
        ({"consumed": -1}, "consumed=-1"),
        ({"version": 99}, "version"),
    ],
)
def test_bad_state(change: dict[str, Any], match: str) -> None:
    state = DistributedSampler(range(10), 2, 0).state_dict()
    state.update(change)
    with pytest.raises(ValueError, match=match):
        DistributedSampler(range(10), 2, 1).load_state_dict(state)


def test_state_from_another_dataset_length_names_both() -> None:
    state = DistributedSampler(range(100), 4, 0).state_dict()
    with pytest.raises(ValueError, match="dataset_length is 100 in the state but 99 here"):
        DistributedSampler(range(99), 4, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        DistributedSampler(range(99), 4, 0).load_state_dict({"seed": 0})


def test_feistel_looks_uniform() -> None:
    """Where position 0 goes, over many keys, is spread evenly (a chi-square sanity check)."""
    n, keys = 1000, 4000
    firsts = np.array([FeistelPermutation(n, k)(np.array([0]))[0] for k in range(keys)])
    counts = np.bincount(firsts * 10 // n, minlength=10)
    chi2 = float(((counts - keys / 10) ** 2 / (keys / 10)).sum())
    assert chi2 < 30.0  # 9 degrees of freedom: p < 0.001 above ~27.9


def test_is_a_torch_distributed_sampler() -> None:
    s = DistributedSampler(range(10), 2, 1)
    assert isinstance(s, torch.utils.data.DistributedSampler)
    assert isinstance(s, torch.utils.data.Sampler)
    loader = torch.utils.data.DataLoader(range(10), batch_size=2, sampler=s)
    ref = torch.utils.data.DistributedSampler(range(10), 2, 1)
    assert [b.tolist() for b in loader] == [list(ref)[i : i + 2] for i in range(0, 5, 2)]
