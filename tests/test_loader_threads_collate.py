"""Thread workers collate in plain memory (issue 28 item 4).

torch's ``default_collate`` stacks a batch into a new shared-memory block whenever
``torch.utils.data.get_worker_info()`` is not None, for shipping it to the main process. Since
thread workers answer ``get_worker_info()`` (feedpipe.loader._torch_compat's shim), every batch
paid ``shm_open`` + ``mmap`` + a page fault per 4 KiB for no reader in another process: thread
workers fell from 1.6x to 1.05x torch (benchmarks/diagnostics/thread_regress.py). The shim now
shows no worker info to torch's collate only; the user's code still sees the thread's.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import default_collate

import feedpipe
from feedpipe.loader import _torch_compat as compat


class _Rows(tud.Dataset):  # type: ignore[type-arg]
    """Per-sample tensors; records which worker info torch's ``get_worker_info()`` showed."""

    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        info = tud.get_worker_info()
        self.seen.append(None if info is None else info.id)
        return torch.full((64,), i, dtype=torch.int32)


def _thread_loader(dataset: Any, **kw: Any) -> feedpipe.DataLoader:
    return feedpipe.DataLoader(dataset, batch_size=4, num_workers=2, worker_type="thread", **kw)


def test_default_collate_in_thread_workers_is_not_shared_memory() -> None:
    ds = _Rows()
    batches = list(_thread_loader(ds))
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                   [12, 13, 14, 15]]  # fmt: skip
    assert [b.is_shared() for b in batches] == [False] * 4
    assert set(ds.seen) == {0, 1}  # the dataset still sees each thread's own info


def test_user_collate_sees_worker_info_and_default_collate_inside_it_does_not_share() -> None:
    seen: list[int | None] = []

    def collate(samples: list[torch.Tensor]) -> torch.Tensor:
        info = tud.get_worker_info()
        seen.append(None if info is None else info.id)
        batch: torch.Tensor = default_collate(samples)  # a user's collate built on torch's
        return batch

    batches = list(_thread_loader(_Rows(), collate_fn=collate))
    assert len(batches) == 4 and not any(b.is_shared() for b in batches)
    assert len(seen) == 4 and set(seen) == {0, 1}


def test_shim_hides_the_thread_info_from_torchs_collate_only() -> None:
    """Below the loader: in a thread that holds worker info, torch's collate stacks into plain
    memory while a call from any other module gets the thread's info."""
    assert compat.install_worker_info_shim()  # torch 2.11-2.13: the plain global read
    info = compat.make_worker_info(0, 1, 7, dataset=None)
    out: dict[str, Any] = {}

    def body() -> None:
        compat.set_thread_worker_info(info)
        try:
            out["info"] = tud.get_worker_info()
            out["batch"] = default_collate([torch.zeros(8), torch.ones(8)])
        finally:
            compat.set_thread_worker_info(None)

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert out["info"] is info
    assert out["batch"].tolist() == [[0.0] * 8, [1.0] * 8]
    assert not out["batch"].is_shared()
    assert tud.get_worker_info() is None  # the main thread: torch's own answer


@pytest.mark.gpu
def test_thread_workers_to_cuda_over_per_sample_tensors_give_every_batch() -> None:
    """The benchmark's path (device="cuda", per-sample tensors, default_collate in the threads
    and the pinned ring after them): every batch arrives, on the device, in order."""
    ds = _Rows()
    loader = _thread_loader(ds, device="cuda", persistent_workers=True)
    for _ in range(2):  # persistent threads: the second pass too
        batches = list(loader)
        assert [b.device.type for b in batches] == ["cuda"] * 4
        assert [b[:, 0].tolist() for b in batches] == [list(range(i, i + 4)) for i in (0, 4, 8, 12)]
        assert all(bool((b == b[:, :1]).all()) for b in batches)
