"""``feedpipe.DataLoader(device=..., prefetch=...)``: the GPU feed inside the loader.

CPU tests run the loader's device path with the ring in host memory (``FEEDPIPE_HOST_RING=1``:
same ring, same ordering code); the ``gpu`` test checks every batch of a thread-worker loader
under a slow consumer on a real device.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe.device.feed import GPUFeedWarning
from feedpipe.stall import StallMeter

N, DIM = 200, 16


@pytest.fixture(autouse=True)
def _host_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU device runs the feed's ring in host memory (a loader's default there: no ring)."""
    monkeypatch.setenv("FEEDPIPE_HOST_RING", "1")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = Path(tmp_path_factory.mktemp("gpu_feed")) / "ds"
    data = np.arange(N * DIM, dtype=np.float32).reshape(N, DIM)
    with feedpipe.MemmapWriter(path, shape=(DIM,), dtype="float32", fields={"label": "int64"}) as w:
        w.append_batch(data, label=np.arange(N) % 7)
    ds = feedpipe.MemmapDataset(path)
    yield ds
    ds.close()


def _loader(ds: Any, seed: int = 0, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return feedpipe.DataLoader(
            ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw
        )


def _reference(ds: Any, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    loader = torch.utils.data.DataLoader(
        ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return list(loader)


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["data"].cpu(), w["data"]) and torch.equal(g["label"].cpu(), w["label"])


@pytest.mark.parametrize(
    ("worker_type", "workers", "slots"), [("thread", 2, 8), ("thread", 0, 4), ("process", 1, 4)]
)
def test_device_loader_matches_torch_and_warns_once(
    dataset: Any, worker_type: str, workers: int, slots: int
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = feedpipe.DataLoader(
            dataset,
            batch_size=16,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=workers,
            worker_type=worker_type,
            device="cpu",
            prefetch=2,
        )
        got = list(loader)
        got2 = list(loader)  # a second epoch reuses the ring
    # exactly one fallback warning (Python may add its own, e.g. about fork in a threaded process)
    assert [w.category for w in caught if issubclass(w.category, UserWarning)] == [GPUFeedWarning]
    _same(got, _reference(dataset))
    assert len(got2) == len(got)
    info = loader.feed_info
    assert info["slots"] == slots and info["ring_bytes"] == slots * 16 * (DIM * 4 + 8)
    assert info["batches"] == 2 * len(got) and info["reallocations"] == 0


def test_thread_workers_read_straight_into_the_ring(dataset: Any) -> None:
    meter = StallMeter()
    loader = _loader(dataset, num_workers=2, worker_type="thread", device="cpu", meter=meter)
    got = list(loader)
    _same(got, _reference(dataset))
    total = sum(b["data"].numel() * 4 + b["label"].numel() * 8 for b in got)
    assert meter.stage_bytes["h2d"] == total
    # the batches dispatched before the ring existed were copied in ("pin"); the rest were not
    assert 0 < meter.stage_bytes["pin"] < total / 2


def test_prefetched_batches_are_not_counted_as_consumed(dataset: Any) -> None:
    loader = _loader(dataset, num_workers=2, worker_type="thread", device="cpu", prefetch=3)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    assert state["batches"] == 4 and state["samples"] == 64
    resumed = _loader(dataset, seed=123, num_workers=2, worker_type="thread", device="cpu")
    resumed.load_state_dict(state)
    _same(first + list(resumed), _reference(dataset))


def test_abandoned_epoch_then_a_full_one(dataset: Any) -> None:
    loader = _loader(dataset, num_workers=2, worker_type="thread", device="cpu")
    for i, _ in enumerate(loader):
        if i == 2:
            break
    ring = loader._feed._ring
    # a new pass (workers of the broken one may still be reading); the same loader and order
    loader.generator.manual_seed(0)
    _same(list(loader), _reference(dataset))
    assert loader.feed_info["batches"] == 3 + len(_reference(dataset))
    assert loader._feed._ring is ring or ring.lent  # a ring is only replaced if slots were lent


class _Failing(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, inner: Any, bad: int) -> None:
        self.inner, self.bad = inner, bad

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.inner[i]

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        if self.bad in list(indices):
            raise ValueError(f"record {self.bad} is corrupt")
        return self.inner.read_batch(indices, out=out)


def test_a_failed_batch_is_raised_in_its_turn(dataset: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        loader = feedpipe.DataLoader(
            _Failing(dataset, bad=37),
            batch_size=16,
            num_workers=2,
            worker_type="thread",
            device="cpu",
            prefetch=2,
        )
    it = iter(loader)
    assert [int(next(it)["label"][0]) for _ in range(2)] == [0, 16 % 7]
    with pytest.raises(ValueError, match="record 37 is corrupt"):
        next(it)  # batch 2 holds record 37, although batches 3 and 4 were already prefetched
    rest = list(it)
    assert [int(b["data"][0, 0]) // DIM for b in rest] == list(range(48, N, 16))


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # torch's, on CPU
def test_pin_memory_without_device_keeps_torch_semantics(dataset: Any) -> None:
    loader = _loader(dataset, pin_memory=True)
    assert loader.feed_info is None
    _same(list(loader), _reference(dataset))


@pytest.mark.gpu
@pytest.mark.parametrize("worker_type", ["thread", "process"])
@pytest.mark.parametrize("direct", [False, True])  # the pinned ring; the DMA path
def test_gpu_loader_every_batch_correct_with_a_slow_consumer(
    dataset: Any, worker_type: str, direct: bool | None
) -> None:
    # garbage that owns CUDA handles (as earlier tests and real programs leave): the loader must
    # keep forked workers from collecting it (a CUDA call in a forked child aborts the child)
    cycle: dict[str, Any] = {"event": torch.cuda.Event(), "tensor": torch.ones(4, device="cuda")}
    cycle["self"] = cycle
    cycle["event"].record()
    del cycle
    meter = StallMeter()
    loader = _loader(
        dataset,
        num_workers=2,
        worker_type=worker_type,
        device="cuda",
        meter=meter,
        prefetch=2,
        direct=direct,
    )
    assert (loader._direct is None) == (not direct)
    reference = torch.utils.data.DataLoader(
        dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    for _ in range(2):  # each epoch against torch's epoch (a new order each time)
        want = list(reference)
        sums = []
        for b in loader:
            assert b["data"].is_cuda and b["label"].is_cuda
            torch.cuda._sleep(2_000_000)
            sums.append(torch.stack([b["data"].double().sum(), b["label"].double().sum()]))
        got = torch.stack(sums).cpu()
        exp = torch.tensor([[w["data"].double().sum(), w["label"].double().sum()] for w in want])
        assert torch.equal(got, exp.to(got.dtype))
    assert loader.feed_info["pinned"] is True and meter.stage_s["h2d"] > 0
