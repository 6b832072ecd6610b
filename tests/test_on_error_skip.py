"""DataLoader(on_error="skip"): deterministic skipping, resume, all-bad batches, stall count."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _helpers import fail_on_5 as _fail_on_5
from torch.utils.data import Dataset, IterableDataset

import feedpipe
from feedpipe import DataLoader, MemmapDataset, MemmapWriter
from feedpipe.errors import DatasetError, WorkerError
from feedpipe.loader.skip import SKIP_LIMIT

BAD = {5, 8, 9, 10, 11}  # batch 2 (indices 8..11) is all bad
EXPECTED = [[0, 1, 2, 3], [4, 6, 7], [12, 13, 14, 15], [16, 17, 18, 19]]
WORKERS = [(0, "process"), (2, "thread"), (2, "process")]


class PerSample(Dataset):  # type: ignore[type-arg]
    """Torch's per-sample path (process workers collate into shared slots)."""

    def __init__(self, bad: set[int] = BAD, n: int = 20) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.bad:
            raise ValueError(f"corrupt sample {i}")
        return torch.tensor(i)


class Batched(PerSample):
    """A read_batch dataset: a batch read raises if any of its samples is bad."""

    def read_batch(self, indices: Any, out: Any = None) -> torch.Tensor:
        idx = [int(i) for i in indices]
        if self.bad.intersection(idx):
            raise ValueError(f"corrupt sample in {idx}")
        return torch.tensor(idx, dtype=torch.int64)


class Flaky(Batched):
    """Sample ``flaky`` fails its first two reads (the batch read and the one-by-one read), then
    reads fine; the count lives in a file, so it holds across processes."""

    def __init__(self, counter: Path, flaky: int = 5) -> None:
        super().__init__(bad=set())
        self.counter, self.flaky = counter, flaky

    def read_batch(self, indices: Any, out: Any = None) -> torch.Tensor:
        idx = [int(i) for i in indices]
        if self.flaky in idx:
            count = int(self.counter.read_text()) if self.counter.exists() else 0
            self.counter.write_text(str(count + 1))
            if count < 2:
                raise OSError(f"transient read error on {self.flaky}")
        return torch.tensor(idx, dtype=torch.int64)


@pytest.mark.parametrize("cls", [PerSample, Batched])
@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_skip_is_deterministic(cls: type, workers: int, kind: str) -> None:
    loader = feedpipe.DataLoader(
        cls(), batch_size=4, num_workers=workers, worker_type=kind, on_error="skip"
    )
    for _ in range(2):  # the second epoch drops the known-bad samples unread
        assert [b.tolist() for b in loader] == EXPECTED
    assert loader.stats.skipped == 2 * len(BAD)
    assert "skipped 10 samples" in loader.stats.summary()
    assert loader.meter.state_dict()["skipped"] == 10
    assert loader.state_dict()["skipped"] == {"known": sorted(BAD), "epoch": []}
    if cls is PerSample and workers and kind == "process":  # the shared-slot path carried the skips
        slots = loader.worker_slots
        assert slots is not None and slots["batches_in_slots"] > 0


def test_known_bad_are_not_read_again(tmp_path: Path) -> None:
    ds = Flaky(tmp_path / "count")
    loader = feedpipe.DataLoader(ds, batch_size=4, on_error="skip")
    first = [b.tolist() for b in loader]
    second = [b.tolist() for b in loader]
    assert first[1] == [4, 6, 7] and second == first  # reads fine now, yet stays skipped
    assert int((tmp_path / "count").read_text()) == 2


@pytest.mark.parametrize(("workers", "kind"), [(0, "process"), (2, "thread"), (2, "process")])
def test_resume_mid_epoch_with_flaky_sample(tmp_path: Path, workers: int, kind: str) -> None:
    def make(counter: Path) -> feedpipe.DataLoader:
        gen = torch.Generator().manual_seed(7)
        return feedpipe.DataLoader(
            Flaky(counter), batch_size=4, shuffle=True, generator=gen,
            num_workers=workers, worker_type=kind, on_error="skip",
        )  # fmt: skip

    whole = make(tmp_path / "a")
    expected = [b.tolist() for _ in range(2) for b in whole]
    assert sum(map(len, expected)) == 38  # sample 5 skipped in both epochs

    first = make(tmp_path / "b")
    got: list[list[int]] = []
    it = iter(first)
    while True:  # stop right after the batch that skipped the flaky sample
        got.append(next(it).tolist())
        if first.state_dict()["skipped"]["epoch"]:
            break
    state = first.state_dict()
    assert state["skipped"] == {"known": [], "epoch": [5]}
    del it
    resumed = make(tmp_path / "b")  # the same counter: sample 5 would read fine now
    resumed.load_state_dict(state)
    got += [b.tolist() for b in resumed]
    got += [b.tolist() for b in resumed]
    assert got == expected
    assert resumed.state_dict()["skipped"] == {"known": [5], "epoch": []}


@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_all_bad_batch_keeps_numbering_and_resume(workers: int, kind: str) -> None:
    loader = feedpipe.DataLoader(
        Batched(), batch_size=4, num_workers=workers, worker_type=kind, on_error="skip"
    )
    it = iter(loader)
    assert [next(it).tolist() for _ in range(3)] == EXPECTED[:3]
    state = loader.state_dict()
    assert state["batches"] == 4 and state["samples"] == 16  # the all-bad batch counts
    del it
    again = feedpipe.DataLoader(Batched(), batch_size=4, on_error="skip")
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == EXPECTED[3:]


def test_every_batch_bad() -> None:
    loader = feedpipe.DataLoader(PerSample(bad=set(range(8)), n=8), batch_size=4, on_error="skip")
    with pytest.raises(feedpipe.DatasetError, match="every sample of the epoch failed"):
        list(loader)  # an epoch of nothing is an error (test_skip_every_sample_failing_is_an_error)
    assert loader.stats.skipped == 8


@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_errors_still_raise_by_default(workers: int, kind: str) -> None:
    loader = feedpipe.DataLoader(Batched(), batch_size=4, num_workers=workers, worker_type=kind)
    with pytest.raises(ValueError, match="corrupt sample"):
        list(loader)


@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_collate_error_is_not_a_sample_error(workers: int, kind: str) -> None:
    def collate(samples: list[Any]) -> Any:
        raise RuntimeError("collate broke")

    loader = feedpipe.DataLoader(
        PerSample(bad=set()), batch_size=4, collate_fn=collate,
        num_workers=workers, worker_type=kind, on_error="skip",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="collate broke"):
        list(loader)


def test_batch_size_none() -> None:
    loader = feedpipe.DataLoader(PerSample(), batch_size=None, on_error="skip")
    assert [int(x) for x in loader] == [i for i in range(20) if i not in BAD]
    assert [int(x) for x in loader] == [i for i in range(20) if i not in BAD]
    assert loader.stats.skipped == 10


def test_bad_arguments_and_states() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.raises(ValueError, match="map-style"):
        feedpipe.DataLoader(Stream(), on_error="skip")
    with pytest.raises(ValueError, match="on_error must be"):
        feedpipe.DataLoader(PerSample(), on_error="ignore")
    loader = feedpipe.DataLoader(PerSample(), batch_size=4, on_error="skip")
    state = loader.state_dict()
    for bad in ({"known": ["5"], "epoch": []}, {"known": [-1], "epoch": []}, [5]):
        with pytest.raises(ValueError, match="'skipped'"):
            loader.load_state_dict({**state, "skipped": bad})
    too_many = {"known": list(range(2 * SKIP_LIMIT + 1)), "epoch": []}
    with pytest.raises(ValueError, match="more than"):
        loader.load_state_dict({**state, "skipped": too_many})


def test_too_many_bad_samples_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("feedpipe.loader.skip_iter.SKIP_LIMIT", 3)
    loader = feedpipe.DataLoader(PerSample(), batch_size=4, on_error="skip")
    with pytest.raises(feedpipe.DatasetError, match="more than 3 distinct samples"):
        list(loader)


@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_through_the_device_feed(workers: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """device= takes the feed's path (on a CPU-only machine, its ring in host memory): all-bad
    batches pass through it as skipped slots, and only delivered batches count."""
    monkeypatch.setenv("FEEDPIPE_HOST_RING", "1")
    with warnings.catch_warnings():  # "no CUDA: host batches" (warned once per process)
        warnings.simplefilter("ignore")
        loader = feedpipe.DataLoader(
            Batched(), batch_size=4, num_workers=workers, worker_type=kind,
            on_error="skip", device="cpu",
        )  # fmt: skip
    assert loader._feed is not None
    it = iter(loader)
    assert [next(it).tolist() for _ in range(3)] == EXPECTED[:3]
    assert loader.state_dict()["batches"] == 4
    assert [b.tolist() for b in it] == EXPECTED[3:]


@pytest.mark.parametrize("trace", [True, False])
def test_counters_with_all_bad_batches(trace: bool) -> None:
    """Only delivered batches count (an all-bad batch is no batch), with or without the
    profiler ranges."""
    meter = feedpipe.StallMeter(trace=trace)
    loader = feedpipe.DataLoader(Batched(), batch_size=4, on_error="skip", meter=meter)
    assert [b.tolist() for b in loader] == EXPECTED
    stats = loader.stats
    assert (stats.batches, stats.samples, stats.skipped) == (4, 15, 5)


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
