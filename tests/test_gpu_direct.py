"""The GPU feed's direct path: ``MemmapDataset`` records go by DMA from the page cache to the GPU.

CPU tests cover the choice (``feedpipe.device.direct.blocker``, ``DataLoader(direct=...)``) and the
run splitting; ``gpu`` tests check every batch against torch's DataLoader, with side fields,
short last batches, shards crossed inside a batch, resume, and a slow consumer.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe.device import direct as _direct
from feedpipe.device import dma as _memmap_dma
from feedpipe.device.feed import GPUFeedWarning
from feedpipe.stall import StallMeter

N, DIM = 301, 40  # 160 B records, 7 shards (the last one short), 301 = a short last batch
CUDA = torch.device("cuda", 0)


def _write(root: Path, fields: bool = True) -> Path:
    path = root / ("fields" if fields else "plain")
    data = np.arange(N * DIM, dtype=np.float32).reshape(N, DIM)
    with feedpipe.MemmapWriter(
        path,
        shape=(DIM,),
        dtype="float32",
        shard_bytes=50 * DIM * 4,
        fields={"label": "int64"} if fields else None,
    ) as w:
        if fields:
            w.append_batch(data, label=np.arange(N) % 7)
        else:
            w.append_batch(data)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(tmp_path_factory.mktemp("direct"))
    _write(root, True)
    _write(root, False)
    with feedpipe.MemmapWriter(root / "bytes") as w:
        w.append(b"abc")
    return root


# --------------------------------------------------------------------------------- the choice
def test_blocker_names_why(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = feedpipe.MemmapDataset(root / "fields")
    assert _direct.blocker(fixed, torch.device("cpu"), auto=True) == (
        "the feed is not on a CUDA device"
    )
    assert "bytes layout" in str(
        _direct.blocker(feedpipe.MemmapDataset(root / "bytes"), CUDA, auto=False)
    )
    assert "read='pread'" in str(
        _direct.blocker(feedpipe.MemmapDataset(root / "fields", read="pread"), CUDA, auto=False)
    )
    assert "list has no DMA read" in str(_direct.blocker([1, 2], CUDA, auto=False))
    monkeypatch.setattr(_memmap_dma, "read_only_supported", lambda device: True)
    monkeypatch.setattr(_memmap_dma, "batch_copy_available", lambda: True)
    assert "records of 160 B (below 2048 B the pinned ring is the default)" in str(
        _direct.blocker(fixed, CUDA, auto=True)
    )
    monkeypatch.setattr(_direct, "_AUTO_MIN", 0)
    assert _direct.blocker(fixed, CUDA, auto=False) is None
    monkeypatch.setattr(_direct, "_available_bytes", lambda: 2 * fixed._record_bytes * N - 2)
    assert "more than half the available memory" in str(_direct.blocker(fixed, CUDA, auto=True))
    assert _direct.blocker(fixed, CUDA, auto=False) is None  # direct=True: the user's call
    monkeypatch.setattr(_direct, "_available_bytes", lambda: 1 << 40)
    assert _direct.blocker(fixed, CUDA, auto=True) is None


def test_direct_needs_a_device(root: Path) -> None:
    ds = feedpipe.MemmapDataset(root / "fields")
    with pytest.raises(ValueError, match=r"direct=True needs device='cuda'"):
        feedpipe.DataLoader(ds, batch_size=4, direct=True)
    if not torch.cuda.is_available():  # the CPU fallback ignores it, after its one warning
        with pytest.warns(GPUFeedWarning):
            loader = feedpipe.DataLoader(ds, batch_size=4, device="cuda", direct=True)
        assert loader._direct is None and len(list(loader)) == len(loader)


def test_runs_merge_rows_adjacent_in_file_and_batch() -> None:
    rb = 10
    src = np.array([100, 110, 120, 500, 130, 140, 150], dtype=np.int64)
    shard = np.array([0, 0, 0, 0, 0, 0, 1])  # 150 follows 140 in memory but not in one shard
    starts, lengths = _memmap_dma.runs(src, shard, rb)
    assert starts.tolist() == [0, 3, 4, 6] and lengths.tolist() == [30, 10, 20, 10]


# --------------------------------------------------------------------------------- on the GPU
def _loader(ds: Any, seed: int = 0, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return feedpipe.DataLoader(
            ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw
        )


def _torch(ds: Any, seed: int = 0) -> Any:
    return torch.utils.data.DataLoader(
        ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def _same(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert got["data"].is_cuda and got["label"].is_cuda
        assert torch.equal(got["data"].cpu(), want["data"])
        assert torch.equal(got["label"].cpu(), want["label"])
    else:
        assert got.is_cuda and torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [True, False])
@pytest.mark.parametrize(("worker_type", "workers"), [("thread", 0), ("thread", 2), ("process", 2)])
def test_direct_loader_matches_torch(
    root: Path, fields: bool, worker_type: str, workers: int
) -> None:
    ds = feedpipe.MemmapDataset(root / ("fields" if fields else "plain"))
    meter = StallMeter()
    loader = _loader(
        ds, num_workers=workers, worker_type=worker_type, device="cuda", meter=meter, direct=True
    )
    assert loader._direct is not None  # process workers become (one) thread
    reference = _torch(ds)
    for _ in range(2):  # two epochs, each against torch's (a new order each time)
        want = list(reference)
        got = list(loader)
        assert len(got) == len(want) == 10  # the last batch is short (301 = 9 x 32 + 13)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    assert meter.stage_s["h2d"] > 0
    assert torch.cuda.current_device() == 0
    ds.close()  # unregisters the maps (after the copies in flight)


@pytest.mark.gpu
def test_direct_every_batch_correct_with_a_slow_consumer(root: Path) -> None:
    ds = feedpipe.MemmapDataset(root / "fields")
    loader = _loader(
        ds, num_workers=2, worker_type="thread", device="cuda", prefetch=3, direct=True
    )
    assert loader._direct is not None
    reference = _torch(ds, seed=5)
    loader.generator.manual_seed(5)
    for _ in range(3):
        want = list(reference)
        sums = []
        for b in loader:
            torch.cuda._sleep(3_000_000)  # the consumer is slow; copies run far ahead
            sums.append(torch.stack([b["data"].double().sum(), b["label"].double().sum()]))
            del b  # freed memory goes back to the allocator while the copies go on
        got = torch.stack(sums).cpu()
        exp = torch.tensor([[w["data"].double().sum(), w["label"].double().sum()] for w in want])
        assert torch.equal(got, exp.to(got.dtype))


@pytest.mark.gpu
def test_direct_resume_mid_epoch(root: Path) -> None:
    ds = feedpipe.MemmapDataset(root / "fields")
    loader = _loader(ds, seed=3, num_workers=2, worker_type="thread", device="cuda", direct=True)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    rest = list(it)
    again = _loader(ds, seed=99, num_workers=1, worker_type="thread", device="cuda", direct=True)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest) == 6
    for g, w in zip(resumed, rest, strict=True):
        assert torch.equal(g["data"], w["data"]) and torch.equal(g["label"], w["label"])


@pytest.mark.gpu
def test_direct_true_refuses_what_it_cannot_read(root: Path) -> None:
    with pytest.raises(ValueError, match=r"direct=True, but .*read='pread'"):
        _loader(feedpipe.MemmapDataset(root / "fields", read="pread"), device="cuda", direct=True)
    with pytest.raises(ValueError, match=r"direct=True, but .*bytes layout"):
        _loader(feedpipe.MemmapDataset(root / "bytes"), device="cuda", direct=True)
    off = _loader(feedpipe.MemmapDataset(root / "fields"), device="cuda", direct=False)
    assert off.feed_info["path"] == "ring" and off.feed_info["pinned"] is True
    auto = _loader(feedpipe.MemmapDataset(root / "fields"), device="cuda")
    assert auto._direct is None  # 160 B records: the ring is faster


@pytest.mark.gpu
def test_direct_is_automatic_for_big_records(tmp_path: Path) -> None:
    rec = 64 << 10
    x = np.random.default_rng(0).integers(0, 256, (40, rec), dtype=np.uint8)
    with feedpipe.MemmapWriter(tmp_path / "big", shape=(rec,), dtype="uint8") as w:
        w.append_batch(x)
    ds = feedpipe.MemmapDataset(tmp_path / "big")
    loader = feedpipe.DataLoader(ds, batch_size=8, num_workers=4, device="cuda")
    assert loader.feed_info["path"] == "direct"
    got = torch.cat([b.cpu() for b in loader])
    assert torch.equal(got, torch.from_numpy(x))
    ds.close()


@pytest.mark.gpu
def test_direct_names_a_shard_truncated_while_open(tmp_path: Path) -> None:
    path = _write(tmp_path, fields=False)
    ds = feedpipe.MemmapDataset(path)
    loader = _loader(ds, num_workers=1, worker_type="thread", device="cuda", direct=True)
    assert len(list(loader)) == 10  # every shard is open (and registered) now
    shard = path / ds.index.shards[2].files["data"].path
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(feedpipe.DatasetError, match=r"shard-00002\.data: shard 2 file is now 100"):
        list(loader)
    ds.close()
