"""Diagnostic: ways to issue a shuffled batch of page-cache records as DMA copies to the GPU.

A file in /dev/shm is mapped and registered with CUDA (read-only), then each way copies random
batches of ``--batch-mb`` to one device buffer on one side stream, for each record size:

- torch ``copy_(non_blocking=True)`` per record (what a Python gather would do);
- the driver's ``cuMemcpyAsync`` per record, through ctypes;
- the driver's ``cuMemcpyBatchAsync_v2`` (CUDA 13 drivers), one call per batch (what
  ``feedpipe.device.dma`` uses for records of 64 KiB and more);
- a gather kernel (``index_select``) over the map viewed as a CUDA tensor, zero-copy (what it
  uses for smaller records). Both results are checked against the map.

    python benchmarks/probe_batchcopy.py          # H200 machine; prints, writes nothing
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from feedpipe.device import dma as _memmap_dma


def _bench(
    name: str, fn: Callable[[np.ndarray], None], n: int, bs: int, *, rb: int, s: Any
) -> None:
    rng = np.random.default_rng(1)
    fn(rng.integers(0, n, bs))
    s.synchronize()
    k, issue, t0 = 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < 1.5:
        idx = rng.integers(0, n, bs)
        a = time.perf_counter()
        fn(idx)
        issue += time.perf_counter() - a
        k += 1
    s.synchronize()
    dt = time.perf_counter() - t0
    print(f"  {name}: {k * bs * rb / dt / 1e9:.2f} GB/s, {issue / k / bs * 1e6:.2f} us/record")


def probe(rb: int, batch_bytes: int, total: int) -> None:
    bs, n = batch_bytes // rb, total // rb
    path = f"/dev/shm/probe_batchcopy_{os.getpid()}.bin"
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(total // len(block)):
            f.write(block)
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r").reshape(n, rb)
        base = mm.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(base, mm.nbytes, 8 | 2 | 1)
        assert int(err) == 0, err
        out = torch.empty((bs, rb), dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        rows = np.ctypeslib.as_array((ctypes.c_uint8 * mm.nbytes).from_address(base))
        host = torch.from_numpy(rows).view(n, rb)
        lib = ctypes.CDLL("libcuda.so.1")
        one = lib.cuMemcpyAsync
        one.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

        def torch_copy(idx: np.ndarray) -> None:
            with torch.cuda.stream(s):
                for p, q in enumerate(idx.tolist()):
                    out[p].copy_(host[q], non_blocking=True)

        def driver_one(idx: np.ndarray) -> None:
            d0 = out.data_ptr()
            for p, q in enumerate(idx.tolist()):
                assert one(d0 + p * rb, base + q * rb, rb, s.cuda_stream) == 0

        reg = _memmap_dma._Registration(base, n, rb)

        def gather(idx: np.ndarray) -> None:
            with torch.cuda.stream(s):
                _memmap_dma.gather_records(out, {0: reg}, np.zeros(len(idx), np.int64), idx)

        def driver_batch(idx: np.ndarray) -> None:
            with torch.cuda.stream(s):
                src = base + idx.astype(np.int64) * rb
                _memmap_dma.copy_records(out, src, np.zeros(len(idx), np.int64), rb)

        print(f"--- records of {rb >> 10} KiB, batches of {bs}")
        if rb >= 64 << 10:  # about 8 us per call: hopeless for small records
            _bench("torch copy_ per record", torch_copy, n, bs, rb=rb, s=s)
        if rb >= 8 << 10:
            _bench("cuMemcpyAsync per record", driver_one, n, bs, rb=rb, s=s)
        for name, fn in (("gather kernel", gather), ("batched copy", driver_batch)):
            if name == "batched copy" and not _memmap_dma.batch_copy_available():
                print("  this driver has no cuMemcpyBatchAsync_v2")
                continue
            idx = np.random.default_rng(7).integers(0, n, bs)
            fn(idx)
            s.synchronize()
            assert torch.equal(out.cpu(), torch.from_numpy(np.asarray(mm[idx]))), name
            _bench(name, fn, n, bs, rb=rb, s=s)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(base)
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", default="262144,65536,8192,512", help="record sizes in bytes")
    p.add_argument("--batch-mb", type=float, default=16.0)
    p.add_argument("--gb", type=float, default=2.0, help="file size")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    for rb in (int(x) for x in args.records.split(",")):
        probe(rb, int(args.batch_mb * 2**20), int(args.gb * 1e9) // (64 << 20) * (64 << 20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
