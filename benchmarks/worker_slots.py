"""Unchanged user datasets: feedpipe's process workers (collating into reused shared-memory
slots) against torch's DataLoader, same Dataset, same worker count, in the same run.

The dataset is what a user writes: a per-sample ``__getitem__`` over ``np.memmap`` rows.
With ``--device cuda`` both loaders deliver device batches: torch with ``pin_memory=True`` and
``.to(device, non_blocking=True)``, feedpipe with ``device="cuda"`` (slots page-locked once,
one DMA per batch). On the CPU both deliver unpinned host batches.

    python benchmarks/worker_slots.py [--device cuda] [--records 8192,262144] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

import feedpipe


class MemmapRows(tud.Dataset):  # type: ignore[type-arg]
    """A user's map-style dataset: one row of a .npy file per sample."""

    def __init__(self, path: str, rows: int, record: int) -> None:
        self.path, self.rows, self.record = path, rows, record
        self.mm: np.memmap | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(self.rows, self.record))
        return torch.from_numpy(np.array(self.mm[i]))


def _consume(loader: Any, device: str, epochs: int) -> float:
    """Bytes per second over ``epochs`` passes (after one warm-up pass)."""
    total = 0
    for e in range(epochs + 1):
        if e == 1:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            total = 0
        for batch in loader:
            if device == "cuda" and not batch.is_cuda:
                batch = batch.to(device, non_blocking=True)
            total += batch.numel() * batch.element_size()
    if device == "cuda":
        torch.cuda.synchronize()
    return total / (time.perf_counter() - t0)


def run(record: int, workers: int, device: str, data_mb: int, epochs: int) -> dict[str, float]:
    rows = max(256, data_mb * 2**20 // record)
    batch = max(1, min(64, (8 * 2**20) // record))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rows.bin")
        np.random.default_rng(0).integers(0, 255, rows * record, dtype=np.uint8).tofile(path)
        ds = MemmapRows(path, rows, record)
        kw: dict[str, Any] = {"batch_size": batch, "num_workers": workers, "shuffle": True}
        kw["persistent_workers"] = True
        if device == "cuda":
            torch_loader = tud.DataLoader(ds, pin_memory=True, **kw)
            ours = feedpipe.DataLoader(ds, device="cuda", **kw)
        else:
            torch_loader = tud.DataLoader(ds, **kw)
            ours = feedpipe.DataLoader(ds, **kw)
        theirs = _consume(torch_loader, device, epochs)
        mine = _consume(ours, device, epochs)
        os.environ["FEEDPIPE_WORKER_SLOTS"] = "0"  # the same loader on torch's shared memory
        try:
            off_loader = (
                feedpipe.DataLoader(ds, device="cuda", **kw)
                if device == "cuda"
                else (feedpipe.DataLoader(ds, **kw))
            )
            off = _consume(off_loader, device, epochs)
            del off_loader
        finally:
            del os.environ["FEEDPIPE_WORKER_SLOTS"]
        info = ours.worker_slots or {}
        del torch_loader, ours
    return {
        "torch_GBps": theirs / 1e9,
        "feedpipe_GBps": mine / 1e9,
        "ratio": mine / theirs,
        "off_ratio": off / theirs,
        "in_slots": info.get("batches_in_slots", 0),
        "fallback": info.get("batches_fallback", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--records", default="8192,262144")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--data-mb", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    print(
        f"device={a.device} workers={a.workers} torch={torch.__version__}"
        + (f" gpu={torch.cuda.get_device_name()}" if a.device == "cuda" else "")
    )
    for record in (int(r) for r in a.records.split(",")):
        r = run(record, a.workers, a.device, a.data_mb, a.epochs)
        print(
            f"record {record:>7} B: torch {r['torch_GBps']:.2f} GB/s, feedpipe "
            f"{r['feedpipe_GBps']:.2f} GB/s, ratio {r['ratio']:.2f}x "
            f"(slots off: {r['off_ratio']:.2f}x) "
            f"(batches in slots {r['in_slots']}, fallback {r['fallback']})",
            flush=True,
        )


if __name__ == "__main__":
    main()
