"""A short run to profile with Nsight Systems: the loader's and ckpt's NVTX ranges on a timeline.

A MemmapDataset of 256 KiB records goes to the GPU through ``feedpipe.DataLoader(device="cuda")``
with one thread worker; each step is a synthetic GPU kernel (``torch.cuda._sleep``) shorter than
the input's delivery time, so the GPU idles for input and ``feedpipe/wait`` ranges line up with
the idle gaps. One checkpoint is saved at the end (``ckpt/*`` ranges). See
docs/guides/nsight.md:

    nsys profile -t cuda,nvtx,osrt -o feedpipe python benchmarks/nsight_demo.py
    nsys stats -r nvtx_sum feedpipe.nsys-rep
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ckpt
import feedpipe
from feedpipe.io import trace


def main() -> None:
    print("NVTX ranges:", type(trace.recorder()).__name__, "| NVTX_INJECTION64_PATH set:",
          bool(os.environ.get("NVTX_INJECTION64_PATH")))  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "data")
        rows = np.random.default_rng(0).integers(0, 255, (2048, 256 << 10), dtype=np.uint8)
        with feedpipe.MemmapWriter(path, shape=(256 << 10,), dtype="uint8") as w:
            w.append_batch(rows)
        loader = feedpipe.DataLoader(
            feedpipe.MemmapDataset(path),
            batch_size=32,
            shuffle=True,
            num_workers=1,
            worker_type="thread",
            device="cuda",
        )
        for batch in loader:
            torch.cuda._sleep(200_000)  # the "training step": a short GPU kernel
            batch.view(-1)[:1].float().sum()
        torch.cuda.synchronize()
        print(loader.meter.report())
        with ckpt.CheckpointManager(os.path.join(d, "ckpt")) as mgr:
            mgr.save(1, {"w": torch.randn(1 << 22, device="cuda")})
            mgr.wait()


if __name__ == "__main__":
    main()
