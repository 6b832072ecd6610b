"""A loader whose ``device`` is the host (``"cpu"``, or ``"cuda"`` where CUDA is not available)
gives the batches of a loader without ``device``, by the same path: no ring, no extra copy, no
pin or h2d stage (the idiom ``device = "cuda" if torch.cuda.is_available() else "cpu"`` must not
make a CPU run slower). ``FEEDPIPE_HOST_RING=1`` runs the feed's ring in host memory instead
(tests/test_gpu_feed_loader.py runs the device path's host side that way)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe.device.feed import GPUFeedWarning
from feedpipe.testing import assert_batches_equal

N, DIM = 96, 8
HOST_DEVICES: list[Any] = ["cpu", torch.device("cpu")]
if not torch.cuda.is_available():
    HOST_DEVICES += ["cuda", "cuda:0", 0]  # CUDA asked for, none here: host batches, warned
WORKERS = [(0, "thread"), (2, "thread"), (2, "process")]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = Path(tmp_path_factory.mktemp("host_device")) / "ds"
    data = np.arange(N * DIM, dtype=np.float32).reshape(N, DIM)
    with feedpipe.MemmapWriter(path, shape=(DIM,), dtype="float32", fields={"label": "int64"}) as w:
        w.append_batch(data, label=np.arange(N) % 5)
    ds = feedpipe.MemmapDataset(path)
    yield ds
    ds.close()


@pytest.fixture(autouse=True)
def _no_host_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEEDPIPE_HOST_RING", raising=False)


def _loader(ds: Any, workers: int, kind: str, **kw: Any) -> Any:
    return feedpipe.DataLoader(
        ds,
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=workers,
        worker_type=kind,
        **kw,
    )


def _cuda_asked(device: Any) -> bool:
    return isinstance(device, int) or torch.device(device).type == "cuda"


@pytest.mark.parametrize("device", HOST_DEVICES, ids=str)
@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_host_device_is_the_loader_without_one(
    dataset: Any, device: Any, workers: int, kind: str
) -> None:
    want = list(_loader(dataset, workers, kind))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = _loader(dataset, workers, kind, device=device)
        got, again = list(loader), list(loader)
    feed_warnings = [w for w in caught if issubclass(w.category, GPUFeedWarning)]
    # "cpu" is honoured as asked (no warning); CUDA asked for where there is none: one warning
    assert len(feed_warnings) == (1 if _cuda_asked(device) else 0), [
        str(w.message) for w in feed_warnings
    ]
    assert loader.feed_info is None  # no ring, no feed
    assert len(got) == len(want) == len(again)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_batches_equal(g, w, f"batch {i}")
        assert g["data"].device.type == "cpu"
    assert not {"pin", "h2d"} & set(loader.stats.stages), loader.stats.stages
    # process workers' shared slots as well (their settings: the counts are per pass)
    plain, slots = _loader(dataset, workers, kind).worker_slots, loader.worker_slots
    assert (plain is None) == (slots is None), (plain, slots)
    if slots is not None and plain is not None:
        assert slots["slots_per_worker"] == plain["slots_per_worker"] > 0
        assert slots["pinned"] is plain["pinned"] is False
        assert slots["batches_in_slots"] > 0, slots  # the batches did go through them


@pytest.mark.parametrize(("workers", "kind"), WORKERS)
def test_host_device_resumes_exactly(dataset: Any, workers: int, kind: str) -> None:
    whole = [b["label"] for b in _loader(dataset, workers, kind, device="cpu")]
    first = _loader(dataset, workers, kind, device="cpu")
    it = iter(first)
    head = [next(it)["label"] for _ in range(2)]
    state = first.state_dict()
    del it
    resumed = _loader(dataset, workers, kind, device="cpu")
    resumed.load_state_dict(state)
    tail = [b["label"] for b in resumed]
    assert [t.tolist() for t in head + tail] == [t.tolist() for t in whole]


def test_direct_is_ignored_on_the_host_and_refused_without_a_device(dataset: Any) -> None:
    loader = _loader(dataset, 0, "thread", device="cpu", direct=True)
    assert len(list(loader)) == N // 16 and loader.feed_info is None
    with pytest.raises(ValueError, match=r"direct=True needs device='cuda'"):
        _loader(dataset, 0, "thread", direct=True)


class _Batched(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Batched reads (``read_batch``), no DMA read."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), i)

    def read_batch(self, indices: Any) -> torch.Tensor:
        return torch.stack([self[int(i)] for i in indices])


def test_direct_on_the_host_refuses_what_a_gpu_would(dataset: Any, tmp_path: Path) -> None:
    """Every reason that does not depend on the device fails on the laptop too."""
    cannot = "direct=True, but the direct DMA path cannot be used"
    with pytest.raises(ValueError, match=rf"{cannot}: _Batched has no DMA read"):
        _loader(_Batched(), 0, "thread", device="cpu", direct=True)
    with pytest.raises(ValueError, match=rf"{cannot}: batches are not read by the dataset's"):
        _loader(list(range(32)), 0, "thread", device="cpu", direct=True)
    with pytest.raises(ValueError, match=rf"{cannot}: batches are not read by the dataset's"):
        _loader(dataset, 0, "thread", device="cpu", direct=True, collate_fn=lambda b: b)
    pread = feedpipe.MemmapDataset(dataset.path, read="pread")
    with pytest.raises(ValueError, match=cannot):
        _loader(pread, 0, "thread", device="cpu", direct=True)
    pread.close()


def test_host_ring_runs_the_ring_in_host_memory(
    dataset: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEEDPIPE_HOST_RING", "1")
    want = list(_loader(dataset, 2, "thread"))
    with pytest.warns(GPUFeedWarning, match="host memory"):
        loader = _loader(dataset, 2, "thread", device="cpu")
    got = list(loader)
    info = loader.feed_info
    assert info is not None and info["path"] == "ring", info
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_batches_equal(g, w, f"batch {i}")
    assert {"pin", "h2d"} <= set(loader.stats.stages), loader.stats.stages


@pytest.mark.parametrize("value", ["maybe", "2", "on please"])
def test_host_ring_switch_refuses_what_it_cannot_read(
    dataset: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FEEDPIPE_HOST_RING", value)
    with pytest.raises(ValueError, match=rf"FEEDPIPE_HOST_RING={value!r}: expected one of"):
        _loader(dataset, 0, "thread", device="cpu")
    monkeypatch.setenv("FEEDPIPE_HOST_RING", "0")
    assert _loader(dataset, 0, "thread", device="cpu").feed_info is None


def test_an_unknown_device_is_still_an_error(dataset: Any) -> None:
    with pytest.raises(ValueError, match=r"device must be 'cuda', 'cuda:N' or 'cpu'"):
        _loader(dataset, 0, "thread", device="meta")
