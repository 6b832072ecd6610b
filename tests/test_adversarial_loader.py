"""Adversarial review of issue 16 points 3-5: torch-doc idioms that tried to break the loader.

Each test is an attack that broke a promise of docs/migration.md (thread workers) before its fix:
the ``get_worker_info()`` patch leaking into torch's own process workers, and the global-RNG
warnings blaming the dataset or ``worker_init_fn`` for draws made by the training loop, the
sampler, or another ``iter()``.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset

from feedpipe import DataLoader

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------ get_worker_info() patch leaks
class _WhoAmI(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        info = tud.get_worker_info()
        return torch.tensor([info.id, info.num_workers])


class _RunsATorchLoader(Dataset):  # type: ignore[type-arg]
    """A dataset that runs a plain torch process-worker loader in each of its items."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        inner = tud.DataLoader(
            _WhoAmI(), batch_size=None, num_workers=3, multiprocessing_context="fork"
        )
        return torch.stack(list(inner))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
def test_torch_process_workers_forked_from_a_thread_worker_see_their_own_info() -> None:
    """A process forked from a feedpipe worker thread must not inherit the thread's info."""
    loader = DataLoader(_RunsATorchLoader(), batch_size=None, num_workers=2, worker_type="thread")
    for got in loader:
        assert got.tolist() == [[0, 3], [1, 3], [2, 3]]
