"""The main job: train a small model on a synthetic on-disk dataset through feedpipe.DataLoader.

No arguments, no GPU, no network; runs in well under a minute:

    make demo        # or: .venv/bin/python examples/demo.py

It writes a synthetic classification dataset (a numpy memmap) to a temporary directory, trains
a small MLP for a few hundred steps, and prints the throughput and how long the training loop
waited for data.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import feedpipe

FEATURES, CLASSES, SAMPLES = 32, 10, 16_384
BATCH, EPOCHS, SEED = 128, 3, 0


class MemmapTable(torch.utils.data.Dataset):
    """Fixed-size float32 rows plus int64 labels in two numpy memmaps."""

    def __init__(self, root: Path) -> None:
        self.x = np.load(root / "x.npy", mmap_mode="r")
        self.y = np.load(root / "y.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.array(self.x[i])), torch.tensor(self.y[i])

    def read_batch(self, indices: list[int], out: Any = None) -> list[torch.Tensor]:
        """One gather per batch (numpy releases the GIL); equals default_collate of the samples."""
        idx = np.asarray(indices)
        return [torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx])]


def write_dataset(root: Path) -> None:
    """A learnable synthetic task: labels from a random linear teacher."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)
    np.save(root / "x.npy", x)
    np.save(root / "y.npy", (x @ teacher).argmax(1).astype(np.int64))


def main() -> int:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # a tiny model: leave the other cores to the loader's threads
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_dataset(root)
        loader = feedpipe.DataLoader(
            MemmapTable(root),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            worker_type="thread",
            generator=torch.Generator().manual_seed(SEED),
        )
        model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        steps, samples, start = 0, 0, time.perf_counter()
        for epoch in range(EPOCHS):
            correct = seen = 0
            for x, y in loader:
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                steps, samples = steps + 1, samples + len(y)
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
            print(f"epoch {epoch}: loss {loss.item():.3f}, train accuracy {correct / seen:.1%}")
        elapsed = time.perf_counter() - start
    waited = loader.meter.stall_s
    print(
        f"{steps} steps, {samples} samples in {elapsed:.2f} s: {samples / elapsed:,.0f} samples/s; "
        f"the loop waited {waited:.3f} s for data ({waited / elapsed:.1%} of the time)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
