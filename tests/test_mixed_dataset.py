"""feedpipe.MixedDataset: exact per-epoch proportions, one read_batch per member per batch,
exact and elastic resume through the loader and feedpipe.DistributedSampler, weight changes."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import feedpipe
from feedpipe import DataLoader, DistributedSampler, MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets.mixed import mix_counts
from feedpipe.errors import DatasetError
from feedpipe.testing import DatasetContractTests, assert_batches_equal


def _write(path: Path, base: int, n: int, shard_bytes: int = 400) -> MemmapDataset:
    """A fixed-layout memmap dataset whose record i holds base + i (and a label field)."""
    x = (base + np.arange(n, dtype=np.int64))[:, None] * np.ones((1, 3), np.int64)
    with MemmapWriter(
        path, shape=(3,), dtype="int64", fields={"label": "int32"}, shard_bytes=shard_bytes
    ) as w:
        w.append_batch(x, label=np.arange(n, dtype=np.int32) % 7)
    return MemmapDataset(path)


def _members(tmp: Path, sizes: dict[str, int]) -> dict[str, MemmapDataset]:
    return {
        name: _write(tmp / name, 1000 * (k + 1), n) for k, (name, n) in enumerate(sizes.items())
    }


def _ids(batch: Any) -> list[int]:
    return batch["data"][:, 0].tolist()


class Counting:
    """A member that counts its calls (and forbids per-sample reads in read_batch's path)."""

    def __init__(self, ds: Any) -> None:
        self.ds, self.read_calls, self.item_calls = ds, 0, 0

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        self.item_calls += 1
        return self.ds[i]

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        self.read_calls += 1
        return self.ds.read_batch(indices)


# ------------------------------------------------------------------ the dataset contract
class TestMixedContract(DatasetContractTests):
    """Up-sampled (b: 6 samples, 14 drawn) and down-sampled (a: 25 samples, 16 drawn)."""

    def make_dataset(self, tmp_path: Path) -> Any:
        members = _members(tmp_path, {"a": 25, "b": 6})
        return MixedDataset(members, weights={"a": 8, "b": 7}, seed=3, epoch_samples=30)


# ------------------------------------------------------------------ proportions
@pytest.mark.parametrize(
    "weights,total",
    [
        ([0.6, 0.3, 0.1], 1000),
        ([1, 1, 1], 10),
        ([0.5, 0.25, 0.25], 7),
        ([3, 0, 1], 5),
        ([1e-9, 1.0, 2.5], 123457),
    ],
)
def test_counts_are_exact_shares_rounded(weights: list[float], total: int) -> None:
    counts = mix_counts(weights, total)
    assert sum(counts) == total
    whole = sum(Fraction(w) for w in weights)
    for c, w in zip(counts, weights, strict=True):
        assert abs(c - Fraction(w) * total / whole) < 1


def test_epoch_draws_exact_counts_with_up_and_down_sampling(tmp_path: Path) -> None:
    members = _members(tmp_path, {"web": 50, "code": 8, "books": 20})
    weights = {"web": 0.6, "code": 0.3, "books": 0.1}
    ds = MixedDataset(members, weights=weights, seed=1, epoch_samples=100)
    assert ds.counts == [60, 30, 10]
    subsets = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        ids = _ids(ds.read_batch(np.arange(100)))
        per = Counter(i // 1000 for i in ids)
        assert per == {1: 60, 2: 30, 3: 10}
        web = Counter(i for i in ids if i // 1000 == 1)
        code = Counter(i for i in ids if i // 1000 == 2)
        books = [i for i in ids if i // 1000 == 3]
        assert set(web) == set(range(1000, 1050))  # up-sampled: every sample, 1 or 2 times
        assert sorted(web.values()) == [1] * 40 + [2] * 10
        assert set(code) == set(range(2000, 2008))  # up-sampled: 30 = 3 full passes + 6
        assert sorted(code.values()) == [3, 3] + [4] * 6
        assert len(set(books)) == 10  # down-sampled: a subset without repeats
        subsets.append(set(books))
    assert subsets[0] != subsets[1]  # a new subset each epoch


def test_one_read_batch_per_member_per_batch_through_the_loader(tmp_path: Path) -> None:
    members = {k: Counting(v) for k, v in _members(tmp_path, {"a": 40, "b": 30, "c": 5}).items()}
    ds = MixedDataset(members, weights={"a": 2, "b": 1, "c": 1}, epoch_samples=64)
    loader = DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    batches = list(loader)
    assert len(batches) == 4
    present = sum(len({i // 1000 for i in _ids(b)}) for b in batches)
    assert sum(m.read_calls for m in members.values()) == present <= 3 * len(batches)
    assert all(m.item_calls == 0 for m in members.values())
    counts = Counter(i // 1000 for b in batches for i in _ids(b))
    assert counts == {1: 32, 2: 16, 3: 16}


def test_batches_equal_per_sample_reads_with_thread_workers(tmp_path: Path) -> None:
    ds = MixedDataset(_members(tmp_path, {"a": 33, "b": 9}), weights={"a": 1, "b": 1}, seed=5)
    gen = torch.Generator().manual_seed(2)
    got = list(
        DataLoader(
            ds, batch_size=5, shuffle=True, generator=gen, num_workers=2, worker_type="thread"
        )
    )
    gen = torch.Generator().manual_seed(2)
    want = list(torch.utils.data.DataLoader(ds, batch_size=5, shuffle=True, generator=gen))
    for g, w in zip(got, want, strict=True):
        assert_batches_equal(g, w)


def test_ragged_and_string_members_merge_per_sample() -> None:
    class Ragged:
        def __init__(self, tag: str, n: int) -> None:
            self.tag, self.n = tag, n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> Any:
            return {"tokens": torch.arange(i % 4 + 1), "name": f"{self.tag}{i}", "y": i}

        def read_batch(self, indices: Any, out: Any = None) -> Any:
            items = [self[int(i)] for i in indices]
            return {
                "tokens": [s["tokens"] for s in items],
                "name": [s["name"] for s in items],
                "y": torch.tensor([s["y"] for s in items]),
            }

    ds = MixedDataset({"a": Ragged("a", 5), "b": Ragged("b", 3)})
    idx = [7, 0, 5, 1, 6]
    got = ds.read_batch(idx)
    items = [ds[i] for i in idx]
    assert got["name"] == [s["name"] for s in items]
    assert all(torch.equal(g, s["tokens"]) for g, s in zip(got["tokens"], items, strict=True))
    assert got["y"].tolist() == [s["y"] for s in items]


_RECIPE_FIELDS = {"tokens": ("int32", (None,)), "text": "str", "label": "int64"}


def _recipe_member(path: Path, name: str, n: int, **kwargs: Any) -> MemmapDataset:
    """A member of docs/migration.md's Streaming recipe (records of 0 to 6 tokens)."""
    with MemmapWriter(path / name, records=False, fields=_RECIPE_FIELDS) as w:
        for i in range(n):
            w.append(tokens=np.arange(i % 7, dtype=np.int32), text=f"{name} {i}", label=i % 2)
    return MemmapDataset(path / name, **kwargs)


def _torch_collate(mode: str) -> Any:
    """What a torch user collates these samples with: pad_sequence + lengths, or nesting."""

    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        tokens = [s["tokens"] for s in samples]
        if mode == "nested":
            first = {"tokens": torch.nested.as_nested_tensor(tokens, layout=torch.jagged)}
        else:
            first = {
                "tokens": torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True),
                "tokens_lengths": torch.tensor([len(t) for t in tokens]),
            }
        rest = torch.utils.data.default_collate([{"label": s["label"]} for s in samples])
        return {**first, "text": [s["text"] for s in samples], **rest}

    return collate


def _torch_batches(ds: Any, batch_size: int, sampler: Any, mode: str) -> list[Any]:
    """torch's DataLoader over ``ds`` (its ``__getitems__``), collated as a torch user would."""
    loader: Any = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, sampler=sampler, collate_fn=_torch_collate(mode)
    )
    return list(loader)


def _rows_of(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with a jagged nested tensor as the list of its records (to compare)."""
    return {
        k: list(v.unbind()) if isinstance(v, torch.Tensor) and v.is_nested else v
        for k, v in batch.items()
    }


@pytest.mark.parametrize(
    ("mode", "worker_type"), [("pad", "thread"), ("pad", "process"), ("nested", "thread")]
)
def test_streaming_recipe_with_ragged_members_runs_to_the_end_like_torch(
    tmp_path: Path, mode: str, worker_type: str
) -> None:
    """Issue 25 item 13: docs/migration.md's Streaming recipe, iterated to the end. Members pad
    their ragged column to their own longest record; the merged batch is padded to the batch's
    longest (or nested), equal to torch's DataLoader over the same samples."""
    members = {
        name: _recipe_member(tmp_path, name, n, ragged=mode)
        for name, n in (("web", 600), ("code", 300))
    }
    mixed = MixedDataset(members, weights={"web": 0.75, "code": 0.25}, epoch_samples=800, seed=0)
    sampler = DistributedSampler(mixed, num_replicas=1, rank=0, seed=0)
    ours = DataLoader(mixed, batch_size=32, sampler=sampler, worker_type=worker_type, num_workers=2)
    got, want = list(ours), _torch_batches(mixed, 32, sampler, mode)
    assert len(got) == len(want) == 25
    widths = set()
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_batches_equal(_rows_of(g), _rows_of(w), f"batch {b}")
        widths.add(max(len(t) for t in _rows_of(g)["tokens"]))
    assert widths == {6}  # every batch holds a 6-token record; members' own widths differ


def test_ragged_batches_vary_in_width_through_the_loader(tmp_path: Path) -> None:
    """Small batches of ragged members change width from batch to batch (1 to 6 tokens):
    thread workers give torch's batches all the same."""
    members = {n: _recipe_member(tmp_path, n, k) for n, k in (("web", 60), ("code", 30))}
    mixed = MixedDataset(members, weights={"web": 0.75, "code": 0.25}, epoch_samples=80)
    sampler = DistributedSampler(mixed, num_replicas=1, rank=0, seed=0)
    want = _torch_batches(mixed, 3, sampler, "pad")
    got = DataLoader(mixed, batch_size=3, sampler=sampler, worker_type="thread", num_workers=2)
    widths = set()
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_batches_equal(g, w, f"batch {b}")
        widths.add(int(g["tokens"].shape[1]))
    assert widths == {1, 2, 3, 4, 5, 6}


def test_ragged_members_pad_with_their_own_pad_value(tmp_path: Path) -> None:
    a = _recipe_member(tmp_path, "a", 20, pad_value=-1)
    b = _recipe_member(tmp_path, "b", 20, pad_value=-2)
    mixed = MixedDataset({"a": a, "b": b})
    idx = [6, 27, 1, 20, 13]  # a's longest is 6 tokens, b's 1: b's rows are padded on to 6
    batch = mixed.read_batch(idx)
    assert batch["tokens"].shape == (5, 6) and list(batch) == [
        "tokens", "tokens_lengths", "text", "label"
    ]  # fmt: skip
    for j, i in enumerate(idx):
        sample, pad = mixed[i], -1 if i < 20 else -2
        k = len(sample["tokens"])
        assert int(batch["tokens_lengths"][j]) == k and batch["text"][j] == sample["text"]
        assert torch.equal(batch["tokens"][j, :k], sample["tokens"])
        assert (batch["tokens"][j, k:] == pad).all()


def test_members_with_other_batches_are_refused_by_name(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", 1000, 10)
    with MemmapWriter(tmp_path / "b", shape=(3,), dtype="float32", fields={"label": "int32"}) as w:
        w.append_batch(np.zeros((10, 3), np.float32), label=np.zeros(10, np.int32))
    ds = MixedDataset({"a": a, "b": MemmapDataset(tmp_path / "b")})
    with pytest.raises(DatasetError, match=r"'a' and 'b'.*float32"):
        ds.read_batch(list(range(20)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"weights": {"a": 1}}, "missing \\['b'\\]"),
        ({"weights": {"a": 1, "b": 1, "c": 1}}, "unknown \\['c'\\]"),
        ({"weights": {"a": -1, "b": 1}}, "'a' must be >= 0"),
        ({"weights": {"a": 0, "b": 0}}, "positive"),
        ({"weights": {"a": float("nan"), "b": 1}}, "finite"),
        ({"epoch_samples": 0}, "epoch_samples"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    members = _members(tmp_path, {"a": 4, "b": 4})
    with pytest.raises(ValueError, match=match):
        MixedDataset(members, **kwargs)


# ------------------------------------------------------------------ resume
N_TOTAL = 90
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def _rank_loader(
    members: dict[str, Any], world: int, rank: int, weights: dict[str, float], epoch: int = 1
) -> tuple[DataLoader, MixedDataset]:
    ds = MixedDataset(members, weights=weights, seed=7, epoch_samples=N_TOTAL)
    sampler = DistributedSampler(ds, world, rank, seed=11, pad=False, batch_size=4)
    loader = DataLoader(
        ds, batch_size=4, sampler=sampler, num_workers=2, worker_type="thread", prefetch_factor=3
    )
    return loader, ds


def _start(loader: DataLoader, ds: MixedDataset, epoch: int) -> None:
    loader.sampler.set_epoch(epoch)
    ds.set_epoch(epoch)


def _run_and_save(
    members: dict[str, Any], world: int, steps: int, weights: dict[str, float]
) -> tuple[list[list[int]], list[list[int]], Any]:
    """Every rank runs ``steps`` batches of epoch 1 and saves; also each rank's full epoch."""
    taken, full, states = [], [], []
    for rank in range(world):
        loader, ds = _rank_loader(members, world, rank, weights)
        _start(loader, ds, 1)
        it = iter(loader)
        taken.append([i for _ in range(steps) for i in _ids(next(it))])
        states.append(
            json.loads(json.dumps({"loader": loader.state_dict(), "mix": ds.state_dict()}))
        )
        del it
        ref, rds = _rank_loader(members, world, rank, weights)
        _start(ref, rds, 1)
        full.append([i for b in ref for i in _ids(b)])
    return taken, full, states[-1]


def _resume(
    members: dict[str, Any],
    world: int,
    state: Any,
    weights: dict[str, float],
    old: dict[str, float] | None = None,
) -> list[list[int]]:
    out = []
    for rank in range(world):
        loader, ds = _rank_loader(members, world, rank, weights)
        loader.load_state_dict(state["loader"])
        ds.load_state_dict(state["mix"], weights=old)
        _start(loader, ds, state["mix"]["epoch"])
        out.append([i for b in loader for i in _ids(b)])
    return out


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _members(tmp_path_factory.mktemp("mix"), {"web": 30, "code": 10, "books": 60})


def test_resume_same_world_is_exact(members: dict[str, Any]) -> None:
    taken, full, state = _run_and_save(members, 3, 4, WEIGHTS)
    resumed = _resume(members, 3, state, WEIGHTS)
    assert [t + r for t, r in zip(taken, resumed, strict=True)] == full


@pytest.mark.parametrize("old,new", [(3, 2), (2, 5)])
def test_elastic_resume_finishes_the_epoch_exactly(
    members: dict[str, Any], old: int, new: int
) -> None:
    taken, full, state = _run_and_save(members, old, 3, WEIGHTS)
    resumed = _resume(members, new, state, WEIGHTS)
    # the epoch's multiset of samples (with the repeats of up-sampling) is delivered exactly
    assert Counter(i for r in taken + resumed for i in r) == Counter(i for r in full for i in r)
    epoch = Counter(i // 1000 for r in full for i in r)
    assert epoch == {1: 45, 2: 27, 3: 18}


def test_changed_weights_finish_the_epoch_then_apply(members: dict[str, Any]) -> None:
    new = {"web": 0.1, "code": 0.1, "books": 0.8}
    taken, full, state = _run_and_save(members, 2, 3, WEIGHTS)
    with pytest.raises(ValueError, match="weights=old"):
        _resume(members, 2, state, new)
    resumed = _resume(members, 2, state, new, old=WEIGHTS)
    assert [t + r for t, r in zip(taken, resumed, strict=True)] == full  # the old weights
    loader, ds = _rank_loader(members, 1, 0, new)
    loader.load_state_dict(_run_and_save(members, 1, 2, WEIGHTS)[2]["loader"])
    ds.load_state_dict(state["mix"], weights=WEIGHTS)
    _start(loader, ds, 1)
    list(loader)
    _start(loader, ds, 2)  # the next epoch: the new weights
    assert Counter(i // 1000 for b in loader for i in _ids(b)) == {1: 9, 2: 9, 3: 72}


def test_state_is_small_whatever_the_number_of_members(tmp_path: Path) -> None:
    class Tiny:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> int:
            return i

    members = {f"member-{k:03d}": Tiny() for k in range(100)}
    ds = MixedDataset(members, weights={n: k + 1 for k, n in enumerate(members)}, seed=1)
    sampler = DistributedSampler(ds, 8, 3, seed=2, pad=False, batch_size=4)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    it = iter(loader)
    next(it)
    state = {"loader": loader.state_dict(), "mix": ds.state_dict()}
    # the mix adds O(1) to the state: the same size with 100 members as with 2
    two = MixedDataset(dict(list(members.items())[:2]), seed=1, epoch_samples=300)
    assert set(state["mix"]) == set(two.state_dict())
    assert len(json.dumps(state["mix"])) - len(json.dumps(two.state_dict())) <= 2  # "100"
    assert len(json.dumps(state["mix"])) < 200
    # each rank's position is the sampler's few integers (the loader adds its RNG state)
    assert len(json.dumps(state["loader"]["sampler"])) < 500


def test_state_of_other_members_is_refused(members: dict[str, Any], tmp_path: Path) -> None:
    ds = MixedDataset(members, weights=WEIGHTS, seed=7, epoch_samples=N_TOTAL)
    state = ds.state_dict()
    other = dict(members, books=_write(tmp_path / "more", 3000, 61))
    with pytest.raises(ValueError, match="another layout"):
        MixedDataset(other, weights=WEIGHTS, seed=7, epoch_samples=N_TOTAL).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        MixedDataset(members, weights=WEIGHTS, seed=8, epoch_samples=N_TOTAL).load_state_dict(state)


def test_public_name() -> None:
    assert feedpipe.MixedDataset is MixedDataset and "MixedDataset" in feedpipe.__all__


def test_process_workers_see_the_epoch_set_before_iter(members: dict[str, Any]) -> None:
    ds = MixedDataset(members, weights=WEIGHTS, seed=7, epoch_samples=N_TOTAL)
    loader = DataLoader(ds, batch_size=30, num_workers=2)  # torch's process workers
    for epoch in (0, 3):
        ds.set_epoch(epoch)
        got = [i for b in loader for i in _ids(b)]
        assert got == _ids(ds.read_batch(np.arange(N_TOTAL))), epoch
    ds.set_epoch(0)
    first = _ids(ds.read_batch(np.arange(N_TOTAL)))
    ds.set_epoch(3)
    assert first != _ids(ds.read_batch(np.arange(N_TOTAL)))  # books: another subset


@pytest.mark.parametrize("bad", [{"epoch": "1"}, {"epoch": True}, {"epoch": -1}, {"version": 2}])
def test_corrupt_states_are_refused(members: dict[str, Any], bad: dict[str, Any]) -> None:
    ds = MixedDataset(members, weights=WEIGHTS, seed=7, epoch_samples=N_TOTAL)
    with pytest.raises(ValueError):
        ds.load_state_dict({**ds.state_dict(), **bad})


# ====================================================================== MixedDataset
class _Member:
    """A map-style member whose sample ``i`` is ``[base + i]``."""

    def __init__(self, n: int, base: int) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([self.base + i])


def _mix(**kwargs: Any) -> MixedDataset:
    members = {"a": _Member(7, 0), "b": _Member(30, 100), "c": _Member(3, 1000)}
    args: dict[str, Any] = {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 5}
    args["epoch_samples"] = 41
    args.update(kwargs)
    return MixedDataset(members, **args)


def _flat(batches: Any) -> list[int]:
    return [int(x) for b in batches for x in b.reshape(-1)]


def test_mixed_numpy_weights_are_numbers() -> None:
    """Weights read from a numpy array (np.float32, np.int64) were refused as 'not a number'."""
    members = {"a": _Member(3, 0), "b": _Member(5, 100)}
    for w in (np.float32(0.5), np.int64(1), np.float64(2.0)):
        ds = MixedDataset(members, weights={"a": w, "b": w}, epoch_samples=8)
        assert ds.counts == [4, 4]
    with pytest.raises(ValueError, match="finite"):
        MixedDataset(members, weights={"a": np.float32("inf"), "b": 1})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"epoch_samples": 2.7}, "epoch_samples must be an integer"),  # was truncated to 2
        ({"epoch_samples": "5"}, "epoch_samples must be an integer"),  # was int("5")
        ({"epoch_samples": True}, "epoch_samples must be an integer"),
        ({"epoch_samples": 2**63}, r"2\*\*63"),  # was an OverflowError in len()
        ({"seed": 1.5}, "seed must be an integer"),  # was truncated to 1
    ],
)
def test_mixed_counts_are_integers_in_range(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _mix(**kwargs)


def test_mixed_largest_epoch_and_numpy_integers() -> None:
    ds = _mix(epoch_samples=np.int64(2**63 - 1), seed=np.int64(3))
    assert len(ds) == 2**63 - 1
    got = ds.read_batch(np.array([0, 2**62, 2**63 - 2]))
    assert got.shape == (3, 1)
    with pytest.raises(ValueError, match="epoch must be an integer"):
        ds.set_epoch(1.5)  # type: ignore[arg-type]


def test_mixed_member_names_with_any_characters() -> None:
    """A lone surrogate (a name decoded from bytes with surrogateescape) raised
    UnicodeEncodeError; names with NUL, slashes and newlines are ordinary keys."""
    members = {"\udcff": _Member(2, 7), "a\x00/../b\n": _Member(5, 100), "é": _Member(3, 50)}
    ds = MixedDataset(members)
    assert sorted(_flat([ds.read_batch(np.arange(10))])) == [7, 8, 50, 51, 52, *range(100, 105)]
    state = json.loads(json.dumps(ds.state_dict()))
    MixedDataset(members).load_state_dict(state)
    renamed = dict(zip(["\udcfe", "a\x00/../b\n", "é"], members.values(), strict=True))
    with pytest.raises(ValueError, match="another layout"):
        MixedDataset(renamed).load_state_dict(state)


def test_mixed_empty_member_with_zero_weight_is_left_out() -> None:
    members = {"empty": _Member(0, 0), "b": _Member(5, 100)}
    ds = MixedDataset(members, weights={"empty": 0, "b": 1}, epoch_samples=4)
    assert ds.counts == [0, 4]
    assert len(set(_flat([ds.read_batch(np.arange(4))]))) == 4
    assert MixedDataset(members).counts == [0, 5]  # weights=None: by length
    with pytest.raises(ValueError, match="'empty' is empty"):
        MixedDataset(members, weights={"empty": 1, "b": 1})


def test_mixed_persistent_worker_processes_refuse_a_new_epoch() -> None:
    """Persistent worker processes keep the dataset copy of the epoch they started with: after
    ``set_epoch`` they served the old epoch's subset without a word. Now it is a clear error,
    and thread workers (which share the dataset) follow ``set_epoch``."""
    ds = _mix()
    loader = DataLoader(ds, batch_size=10, num_workers=1, persistent_workers=True)
    assert sorted(_flat(loader)) == sorted(_flat([ds.read_batch(np.arange(41))]))
    assert sorted(_flat(loader)) == sorted(_flat([ds.read_batch(np.arange(41))]))  # same epoch
    ds.set_epoch(1)
    with pytest.raises(ValueError, match=r"set_epoch\(1\).*persistent worker processes"):
        iter(loader)
    threads = DataLoader(
        ds, batch_size=10, num_workers=2, worker_type="thread", persistent_workers=True
    )
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        assert sorted(_flat(threads)) == sorted(_flat([ds.read_batch(np.arange(41))]))


def test_mixed_padding_sampler_adds_repeats_pad_false_is_exact() -> None:
    """The docs' note: torch's sampler with drop_last=False pads; pad=False is exact."""
    ds = _mix()
    padded: Counter[int] = Counter()
    exact: Counter[int] = Counter()
    for rank in range(3):
        torch_s = tud.DistributedSampler(ds, num_replicas=3, rank=rank, drop_last=False)
        padded.update(_flat(DataLoader(ds, batch_size=4, sampler=torch_s)))
        ours = DistributedSampler(ds, 3, rank, pad=False, batch_size=4)
        exact.update(_flat(DataLoader(ds, batch_size=4, sampler=ours)))
    assert exact == Counter(_flat([ds.read_batch(np.arange(41))]))
    assert sum(padded.values()) == 42 and padded != exact


def _rank(world: int, rank: int, epoch: int = 1) -> tuple[DataLoader, MixedDataset, Any]:
    ds = _mix()
    sampler = DistributedSampler(ds, world, rank, seed=3, pad=False, batch_size=2)
    sampler.set_epoch(epoch)
    ds.set_epoch(epoch)
    return DataLoader(ds, batch_size=2, sampler=sampler), ds, sampler


def _save(loader: DataLoader, ds: MixedDataset) -> Any:
    return json.loads(json.dumps({"loader": loader.state_dict(), "mix": ds.state_dict()}))


def _load(world: int, rank: int, state: Any) -> DataLoader:
    loader, ds, sampler = _rank(world, rank)
    loader.load_state_dict(state["loader"])
    ds.load_state_dict(state["mix"])
    sampler.set_epoch(state["mix"]["epoch"])
    ds.set_epoch(state["mix"]["epoch"])
    return loader


def test_mixed_elastic_resume_one_then_three_then_two_ranks() -> None:
    """A resumed run resumed again at a third world size still delivers the exact epoch."""
    full = Counter(_flat(_rank(1, 0)[0]))
    assert sum(full.values()) == 41
    got: Counter[int] = Counter()
    loader, ds, _ = _rank(1, 0)
    it = iter(loader)
    for _ in range(3):
        got.update(_flat([next(it)]))
    state = _save(loader, ds)
    states = []
    for rank in range(3):
        loader = _load(3, rank, state)
        it = iter(loader)
        for _ in range(2):
            got.update(_flat([next(it)]))
        states.append(_save(loader, loader.dataset))  # type: ignore[arg-type]
    for rank in range(2):
        got.update(_flat(_load(2, rank, states[rank])))
    assert got == full


def test_mixed_state_is_the_same_on_every_rank_and_strictly_typed() -> None:
    states = []
    for rank in range(3):
        loader, ds, _ = _rank(3, rank)
        next(iter(loader))
        states.append(json.dumps(ds.state_dict(), sort_keys=True))
    assert len(set(states)) == 1  # "the same on every rank"
    state = json.loads(states[0])
    for key, bad in (("seed", 5.0), ("members", True), ("epoch_samples", 41.0), ("seed", "5")):
        with pytest.raises(ValueError, match=key):
            _mix().load_state_dict({**state, key: bad})
    with pytest.raises(ValueError, match="epoch_samples"):  # "must stay the same"
        _mix(epoch_samples=40).load_state_dict(state)


def test_mixed_forgotten_set_epoch_warns_once() -> None:
    """sampler.set_epoch(e) without mixed.set_epoch(e): every epoch drew the same subset of
    the down-sampled member, silently."""
    ds = _mix()
    sampler = DistributedSampler(ds, 1, 0, pad=False)
    loader = DataLoader(ds, batch_size=8, sampler=sampler)
    list(loader)  # epoch 0 both: no warning
    sampler.set_epoch(1)
    with pytest.warns(
        RuntimeWarning, match=r"sampler is at epoch 1 but the MixedDataset at epoch 0"
    ):
        list(loader)
    sampler.set_epoch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader)  # once per loader
        ds.set_epoch(2)
        list(DataLoader(ds, batch_size=8, sampler=sampler))  # in step: no warning


class _Dicts:
    """A member whose batches are dicts with the keys in another order than MemmapDataset's."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def read_batch(self, indices: Any, out: Any = None) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return {"label": (idx % 7).to(torch.int32), "data": (500 + idx)[:, None].repeat(1, 3)}


def test_mixed_members_may_order_their_keys_differently(tmp_path: Path) -> None:
    """{"data", "label"} and {"label", "data"} were refused as "different batches"; torch's
    default_collate takes the keys by name, so does the mix now (in the first member's order)."""
    with MemmapWriter(tmp_path / "m", shape=(3,), dtype="int64", fields={"label": "int32"}) as w:
        w.append_batch(np.arange(6)[:, None].repeat(3, 1), label=np.arange(6, dtype=np.int32))
    ds = MixedDataset({"m": MemmapDataset(tmp_path / "m"), "d": _Dicts(4)})
    batch = ds.read_batch(np.arange(10))
    assert list(batch) == ["data", "label"]
    assert batch["data"][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 500, 501, 502, 503]
    assert batch["label"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    with pytest.raises(DatasetError, match="keys"):  # other keys still refused

        class Other(_Dicts):
            def read_batch(self, indices: Any, out: Any = None) -> dict[str, torch.Tensor]:
                return {"data": super().read_batch(indices)["data"]}

        MixedDataset({"m": MemmapDataset(tmp_path / "m"), "o": Other(4)}).read_batch(np.arange(10))
