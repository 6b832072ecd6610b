"""Adversarial review (attacker and careless user) of the newest loader-side features:
``MixedDataset``, ``DataLoader(on_error="skip")``, ``feedpipe.convert(fn, ...)`` and the lazy
cache's Belady plan. Each test is a finding (fixed) or a promise of the docs checked once more."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import feedpipe
from feedpipe import (
    DataLoader,
    DistributedSampler,
    MemmapDataset,
    MemmapWriter,
    MixedDataset,
)
from feedpipe.datasets._convert_sink import STATE_DIR
from feedpipe.datasets.convert_fn import load_function
from feedpipe.errors import DatasetError, WorkerError


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


# ====================================================================== on_error="skip"
SKIP_WORKERS = [(0, "process"), (2, "thread"), (2, "process")]


class _Flaky(tud.Dataset):  # type: ignore[type-arg]
    """Sample 5 fails on its 1st and 3rd reads (a transient error; count in a file, so it
    holds across worker processes): the batch read fails, the read alone succeeds."""

    def __init__(self, counter: Path) -> None:
        self.counter = counter

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5:
            count = int(self.counter.read_text()) if self.counter.exists() else 0
            self.counter.write_text(str(count + 1))
            if count % 2 == 0:
                raise OSError("transient read error on 5")
        return torch.tensor(i)


@pytest.mark.parametrize(("workers", "kind"), SKIP_WORKERS)
def test_skip_transient_error_keeps_the_sample(tmp_path: Path, workers: int, kind: str) -> None:
    """The batch read failed, sample 5 alone read fine, then the batch was read a third time
    and failed again: the loader raised OSError although on_error="skip". Now the samples
    just read form the batch."""
    loader = DataLoader(
        _Flaky(tmp_path / "n"), batch_size=4, num_workers=workers, worker_type=kind,
        on_error="skip",
    )  # fmt: skip
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert loader.stats.skipped == 0
    assert int((tmp_path / "n").read_text()) == 2  # the batch read and the read alone


class _AllBad(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        raise FileNotFoundError(f"/data/{i}.jpg")


@pytest.mark.parametrize(("workers", "kind"), SKIP_WORKERS)
@pytest.mark.parametrize("batch_size", [4, None])
def test_skip_every_sample_failing_is_an_error(
    workers: int, kind: str, batch_size: int | None
) -> None:
    """Every read failing (a wrong path) gave empty epochs forever, without a word."""
    loader = DataLoader(
        _AllBad(), batch_size=batch_size, num_workers=workers, worker_type=kind, on_error="skip"
    )
    for _ in range(2):  # the second epoch drops them all unread: still an error
        with pytest.raises(DatasetError, match=r"every sample of the epoch failed \(8 skipped"):
            list(loader)


def test_skip_resumed_tail_of_bad_samples_is_no_error() -> None:
    """Resumed mid-epoch before a last, all-bad batch: the epoch delivered batches before."""
    ds = _Bad({4, 5, 6, 7})
    loader = DataLoader(ds, batch_size=4, on_error="skip")
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    state = loader.state_dict()
    again = DataLoader(ds, batch_size=4, on_error="skip")
    again.load_state_dict(state)
    assert list(again) == []


class _Bad(tud.Dataset):  # type: ignore[type-arg]
    """Samples ``bad`` raise ``exc``; the others are ``tensor(i)``."""

    def __init__(self, bad: set[int], exc: BaseException | None = None, n: int = 8) -> None:
        self.bad, self.exc, self.n = bad, exc, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.bad:
            raise self.exc if self.exc is not None else ValueError(f"bad {i}")
        return torch.tensor(i)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(("workers", "kind"), SKIP_WORKERS)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_skip_never_swallows_interrupts(workers: int, kind: str, exc: type) -> None:
    loader = DataLoader(
        _Bad({5}, exc()), batch_size=4, num_workers=workers, worker_type=kind, on_error="skip"
    )
    # in this process the interrupt itself; from a worker the loader's WorkerError, as without
    # on_error="skip"
    with pytest.raises(exc if workers == 0 else WorkerError):
        list(loader)
    assert loader.stats.skipped == 0


def _sigkill_at_5(i: int) -> torch.Tensor:
    if i == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.tensor(i)


class _Killer(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return _sigkill_at_5(i)


def test_skip_a_killed_worker_process_is_not_a_skip() -> None:
    loader = DataLoader(_Killer(), batch_size=4, num_workers=2, on_error="skip", timeout=30)
    with pytest.raises(WorkerError, match="exit code -9"):
        list(loader)
    assert loader.stats.skipped == 0


def _fail_on_5(sample: Any) -> Any:
    if int(np.asarray(sample).reshape(-1)[0]) == 5:
        raise ValueError("cannot decode sample 5")
    return sample


@pytest.mark.parametrize(("workers", "kind"), SKIP_WORKERS)
def test_skip_a_transform_error_like_a_read_error(tmp_path: Path, workers: int, kind: str) -> None:
    """MemmapDataset(transform=) raising for one sample drops that sample, on read_batch's
    path (one gather per batch) as on the per-sample path, and a resume drops it again."""
    with MemmapWriter(tmp_path / "ds", shape=(2,), dtype="int64") as w:
        w.append_batch(np.repeat(np.arange(12, dtype=np.int64)[:, None], 2, axis=1))
    ds = MemmapDataset(tmp_path / "ds", transform=_fail_on_5)
    loader = DataLoader(ds, batch_size=4, num_workers=workers, worker_type=kind, on_error="skip")
    got = [b[:, 0].tolist() for b in loader]
    assert got == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11]]
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["skipped"] == {"known": [5], "epoch": []}
    del it
    again = DataLoader(ds, batch_size=4, num_workers=workers, worker_type=kind, on_error="skip")
    again.load_state_dict(state)
    assert [b[:, 0].tolist() for b in again] == got[1:]
    assert again.stats.skipped == 1  # the known-bad sample, dropped unread


# ====================================================================== convert(fn, ...)
def _scalar(item: int) -> Any:
    """A numpy scalar (0-d record) for even inputs, a Python int for odd ones."""
    return np.int64(item) if item % 2 == 0 else int(item)


def _yields_none(item: int) -> Any:
    yield np.zeros(2, np.int64)
    yield None


def _yields_str(item: int) -> Any:
    yield "text"


def _exits(item: int) -> Any:
    if item == 3:
        sys.exit(3)
    return np.zeros(2, np.int64)


def test_convert_unpicklable_fn_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A lambda or closure with worker processes failed inside the pool with "Can't pickle
    local object", after the output's state folder was created."""
    k = 3
    for fn in (lambda x: np.full(2, x), lambda x: np.full(2, k)):
        out = tmp_path / "ds"
        with pytest.raises(ValueError, match=r"cannot be sent to worker processes.*num_workers=1"):
            feedpipe.convert(fn, range(8), output=str(out), num_workers=2, inputs_per_part=2)
        assert not out.exists() and not Path(f"{out}.partial").exists()
    done = feedpipe.convert(  # in this process, a closure is fine
        lambda x: np.full(2, k), range(8), output=str(tmp_path / "one"), num_workers=1
    )
    assert done.records == 8


def test_convert_dotted_path_errors_are_value_errors() -> None:
    """A relative module name raised TypeError from importlib, not the documented ValueError."""
    for spec in (".:x", "..x", ".mod:f"):
        with pytest.raises(ValueError, match="cannot import"):
            load_function(spec)
    for spec in ("os:sep", "no_such_module_attackl:f", "os:path.no_such_attr"):
        with pytest.raises(ValueError, match=re.escape(spec)):
            load_function(spec)


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_records_scalars_none_str_and_exit(tmp_path: Path, workers: int) -> None:
    """A scalar record (numpy or Python) raised "object is not iterable"; a yielded None or str
    gave a dtype error naming a temporary folder; sys.exit() in fn ended the whole command."""
    kw: dict[str, Any] = {"num_workers": workers, "inputs_per_part": 2, "progress_bar": False}
    res = feedpipe.convert(_scalar, range(6), output=str(tmp_path / "s"), **kw)
    assert res.records == 6
    assert [int(x) for x in feedpipe.MemmapDataset(tmp_path / "s")] == list(range(6))
    for fn, match in (
        (_yields_none, r"_yields_none on input \d \(\d\): a None record"),
        (_yields_str, r"_yields_str on input \d \(\d\): a str record"),
        (_exits, r"_exits failed on input 3 \(3\): SystemExit: 3"),
    ):
        with pytest.raises(DatasetError, match=match):
            feedpipe.convert(fn, range(6), output=str(tmp_path / fn.__name__), **kw)


def _rows(item: int) -> list[np.ndarray]:
    return [np.full(4, item * 10 + j, np.int32) for j in range(item % 3)]


_CONVERT_KW: dict[str, Any] = {"inputs_per_part": 4, "shard_bytes": 64, "progress_bar": False}


def _convert_then_die_at_state_removal(dest: str) -> None:
    """In a forked child: convert, SIGKILLed just after the final rename (at the state's
    removal)."""
    from feedpipe.datasets import _convert_sink

    real = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(STATE_DIR):
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, *args, **kwargs)

    _convert_sink.shutil.rmtree = rmtree  # type: ignore[assignment]
    feedpipe.convert(_rows, range(16), output=dest, num_workers=1, **_CONVERT_KW)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_convert_killed_after_the_final_rename_reruns_to_the_same_bytes(tmp_path: Path) -> None:
    """SIGKILL between renaming ``OUTPUT.partial`` to ``OUTPUT`` and removing the state in it:
    the rerun of the same call said "a dataset already exists here" and the output kept a
    stray ``.feedpipe-convert/``. Now the rerun finishes it: the uninterrupted run's bytes."""
    import multiprocessing as mp

    dest = tmp_path / "ds"
    child = mp.get_context("fork").Process(
        target=_convert_then_die_at_state_removal, args=(str(dest),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert (dest / "index.json").exists() and (dest / STATE_DIR / "plan.json").exists()
    again = feedpipe.convert(_rows, range(16), output=str(dest), num_workers=1, **_CONVERT_KW)
    clean = feedpipe.convert(_rows, range(16), output=str(tmp_path / "clean"), **_CONVERT_KW)
    assert _tree(dest) == _tree(tmp_path / "clean")
    assert (again.records, again.shards, again.resumed_parts) == (clean.records, clean.shards, 4)
    with pytest.raises(DatasetError, match="already exists"):  # finished: a second rerun
        feedpipe.convert(_rows, range(16), output=str(dest), **_CONVERT_KW)
    other = feedpipe.convert(_rows, range(16), output=str(dest), overwrite=True, **_CONVERT_KW)
    assert other.resumed_parts == 0 and _tree(dest) == _tree(tmp_path / "clean")


# ====================================================================== the Belady plan
def _remote(tmp_path: Path) -> str:
    """A 64-record dataset (16 KiB shards, record ``i`` holds ``i``) behind a real fsspec
    filesystem of a remote protocol (the local one, as ``attackfile://``)."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class AttackFileSystem(LocalFileSystem):  # type: ignore[misc]
        protocol = ("attackfile",)
        root_marker = "/"

        @classmethod
        def _strip_protocol(cls, path: Any) -> str:
            text = str(path).removeprefix("attackfile://")
            return str(super()._strip_protocol(text))

    fsspec.register_implementation("attackfile", AttackFileSystem, clobber=True)
    with MemmapWriter(tmp_path / "src", shape=(512,), dtype="int64", shard_bytes=4 * 4096) as w:
        w.append_batch(np.repeat(np.arange(64, dtype=np.int64)[:, None], 512, axis=1))
    return f"attackfile://{tmp_path / 'src'}"


@pytest.mark.parametrize("workers", [0, 2])
def test_plan_holds_the_batches_read_after_known_bad_samples_drop(
    tmp_path: Path, workers: int
) -> None:
    """on_error="skip": the plan was told each batch before the known-bad samples were dropped
    from it, so the read (of the smaller batch) never matched it and its files stayed planned
    "soon" for the rest of the pass. Now every planned read is started, and the data is right."""
    url = _remote(tmp_path)
    ds = MemmapDataset(
        url, cache_dir=tmp_path / "c", cache_limit_bytes=20_000, transform=_fail_on_5
    )
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(
        ds, batch_size=4, shuffle=True, generator=gen, num_workers=workers,
        worker_type="thread", on_error="skip",
    )  # fmt: skip
    for _epoch in range(2):
        got = sorted(int(x) for b in loader for x in b[:, 0])
        assert got == [i for i in range(64) if i != 5]
        assert len(ds._shard_cache().plan) == 0  # nothing planned is left unread
    ds.close()


def test_cache_limit_below_one_shard_is_a_clear_error(tmp_path: Path) -> None:
    """A limit smaller than a shard: a DatasetError naming the file and the limit, not a wait;
    under on_error="skip" every read fails, which is now an error too (not an empty epoch)."""
    url = _remote(tmp_path)
    ds = MemmapDataset(url, cache_dir=tmp_path / "c", cache_limit_bytes=1000)
    with pytest.raises(DatasetError, match=r"shard-00000\.data: file of 16384 bytes does not fit"):
        next(iter(DataLoader(ds, batch_size=4)))
    with pytest.raises(DatasetError, match="every sample of the epoch failed"):
        list(DataLoader(ds, batch_size=4, on_error="skip"))
    ds.close()


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


@pytest.mark.parametrize("per", [0, -1, 2.5, True])
def test_convert_inputs_per_part_must_be_a_positive_int(tmp_path: Path, per: Any) -> None:
    """inputs_per_part=0 silently meant "the default"; 2.5 failed inside range()."""
    with pytest.raises(ValueError, match="inputs_per_part must be >= 1"):
        feedpipe.convert(_scalar, range(4), output=str(tmp_path / "x"), inputs_per_part=per)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


@pytest.mark.slow
def test_convert_sigkill_at_random_moments_then_rerun_gives_the_same_bytes(tmp_path: Path) -> None:
    """The real CLI process group SIGKILLed at seeded random moments of a run (parts, shard
    moves, manifests, index, rename, exit); the rerun of the same command gives the bytes of an
    uninterrupted run. A kill after the run finished leaves the finished dataset (a rerun then
    says it exists, as for any finished conversion)."""
    import random
    import subprocess
    import time

    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": f"{here.parent}{os.pathsep}{here}",
        "FEEDPIPE_TEST_SLEEP": "0",
    }
    items = [str(i) for i in range(24)]

    def cli(dest: Path) -> subprocess.Popen[bytes]:
        args = ["--fn", "_convert_fns:slow_tokens", *items, str(dest), "--workers", "2",
                "--inputs-per-part", "3", "--shard-size", "256", "--no-progress"]  # fmt: skip
        return subprocess.Popen(
            [sys.executable, "-m", "feedpipe.cli", "convert", *args], cwd=here.parent, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip

    t0 = time.monotonic()
    clean = cli(tmp_path / "clean")
    assert clean.wait(120) == 0
    took = time.monotonic() - t0
    want = _tree(tmp_path / "clean")
    rng = random.Random(20261201)
    for k in range(6):
        dest = tmp_path / f"d{k}"
        proc = cli(dest)
        time.sleep(rng.uniform(0.2, 1.0) * took)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        rerun = cli(dest)
        _out, err = rerun.communicate(timeout=120)
        if rerun.returncode != 0:  # only when the killed run had finished
            assert b"a dataset already exists here" in err, err.decode()
        assert _tree(dest) == want, f"kill {k}"
        assert not Path(f"{dest}.partial").exists()


def _rows_unless(marker: str, item: int) -> list[np.ndarray]:
    """``_rows``, failing on inputs >= 8 while the file ``marker`` exists."""
    if item >= 8 and os.path.exists(marker):
        raise RuntimeError("injected failure")
    return _rows(item)


@pytest.mark.slow
def test_convert_to_s3_failed_run_is_no_dataset_and_overwrite_leaves_nothing_stale(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """Through the S3 server: a run that fails half way leaves no index.json (no reader can
    open half a dataset); the rerun resumes to the local bytes; an overwrite by a conversion
    with fewer shards leaves none of the old ones behind."""
    import functools

    import s3fs

    bucket, opts = s3_bucket
    fs = s3fs.S3FileSystem(**opts)
    url = f"s3://{bucket}/ds"
    marker = tmp_path / "fail"
    marker.touch()
    fn = functools.partial(_rows_unless, str(marker))
    kw = {**_CONVERT_KW, "storage_options": opts, "num_workers": 2}
    with pytest.raises(DatasetError, match="injected failure"):
        feedpipe.convert(fn, range(16), output=url, **kw)
    fs.invalidate_cache()
    assert fs.ls(f"{bucket}/ds") and not fs.exists(f"{bucket}/ds/index.json")
    with pytest.raises((DatasetError, FileNotFoundError)):
        MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "c0")
    marker.unlink()
    resumed = feedpipe.convert(fn, range(16), output=url, **kw)
    assert resumed.resumed_parts == 2
    feedpipe.convert(fn, range(16), output=str(tmp_path / "clean"), **_CONVERT_KW)

    def remote_tree() -> dict[str, bytes]:
        fs.invalidate_cache()
        return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.ls(f"{bucket}/ds")}

    assert remote_tree() == _tree(tmp_path / "clean")
    with pytest.raises(DatasetError, match="exists"):
        feedpipe.convert(_rows, range(4), output=url, **kw)
    feedpipe.convert(_rows, range(4), output=url, overwrite=True, **kw)
    feedpipe.convert(_rows, range(4), output=str(tmp_path / "small"), **_CONVERT_KW)
    assert remote_tree() == _tree(tmp_path / "small")
    ds = MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "c1")
    assert [int(x[0]) for x in ds] == [int(r[0]) for i in range(4) for r in _rows(i)]


def _rows_times(k: int, item: int) -> list[np.ndarray]:
    return [r * k for r in _rows(item)]


def test_convert_rerun_with_other_partial_arguments_starts_over(tmp_path: Path) -> None:
    """The plan's fingerprint took a partial's name ("functools:partial") and no code or
    arguments: a run of partial(f, 1) interrupted, then partial(f, 2) (or of another function)
    "resumed" the parts of the first, a silently mixed dataset."""
    import functools

    marker = tmp_path / "fail"
    marker.touch()
    first = functools.partial(_rows_unless, str(marker))
    with pytest.raises(DatasetError, match="partial\\(test_attack_loader2:_rows_unless\\)"):
        feedpipe.convert(first, range(16), output=str(tmp_path / "ds"), **_CONVERT_KW)
    second = functools.partial(_rows_times, 2)
    res = feedpipe.convert(second, range(16), output=str(tmp_path / "ds"), **_CONVERT_KW)
    assert res.resumed_parts == 0
    feedpipe.convert(second, range(16), output=str(tmp_path / "clean"), **_CONVERT_KW)
    assert _tree(tmp_path / "ds") == _tree(tmp_path / "clean")
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["source"]["fn"] == "partial(test_attack_loader2:_rows_times)"
    marker.touch()  # the same partial, other arguments
    with pytest.raises(DatasetError):
        feedpipe.convert(functools.partial(_rows_unless, str(marker)), range(16),
                         output=str(tmp_path / "p"), **_CONVERT_KW)  # fmt: skip
    other = functools.partial(_rows_unless, str(tmp_path / "no-such-marker"))
    res = feedpipe.convert(other, range(16), output=str(tmp_path / "p"), **_CONVERT_KW)
    assert res.resumed_parts == 0
