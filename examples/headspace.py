"""Headspace: how much of each training step goes to waiting for input?

``feedpipe.headspace`` runs the training step on a few batches cached in memory (instant input),
then on the live loader, for the same number of steps, and reports the difference as the share of
step time the input costs, with the loader's stall counters naming the slowest stage.

    python examples/headspace.py                       # the Python API, 0 then 2 thread workers
    feedpipe bench --headspace examples/headspace.py:make --batches 30 --warmup 3   # the CLI

:func:`make` is the ``SCRIPT:FN`` the command calls: it takes no arguments and returns
``(step_fn, loader)``. The dataset here waits ``READ_MS`` per sample (a stand-in for a disk or
network read that releases the GIL) and the step trains a small MLP on the CPU. No GPU, no
network, a few seconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import feedpipe

FEATURES, HIDDEN, CLASSES, SAMPLES, BATCH = 512, 2048, 10, 1024, 32
READ_MS = 0.2


class SlowReads(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Random features and labels; each read waits ``read_ms`` first (I/O: no GIL held)."""

    def __init__(self, n: int = SAMPLES, read_ms: float = READ_MS) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.read_s = read_ms / 1e3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.read_s)
        return self.x[i], int(self.y[i])


def make(workers: int = 0) -> tuple[Callable[[Any], None], feedpipe.DataLoader]:
    """The training step and its loader (``feedpipe bench --headspace`` calls ``make()``)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small model: one thread, no pool woken after each wait
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = feedpipe.DataLoader(
        SlowReads(), batch_size=BATCH, shuffle=True, num_workers=workers, worker_type="thread"
    )

    def train_step(batch: Any) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return train_step, loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="0,2", help="comma-separated thread worker counts")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    for workers in (int(w) for w in args.workers.split(",")):
        step, loader = make(workers)
        result = feedpipe.headspace(step, loader, steps=args.steps, warmup=args.warmup)
        print(f"--- {workers} thread workers")
        print(result)
        # the loader is where it stood: a full epoch follows as if nothing had run
        print(f"next epoch: {sum(1 for _ in loader)} batches of {len(loader)}")


if __name__ == "__main__":
    main()
