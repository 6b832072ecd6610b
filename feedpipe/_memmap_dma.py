"""Fixed-size records copied by DMA straight from the page cache to the GPU (no host gather).

A shard's read-only map is registered with CUDA as page-locked memory (``cudaHostRegister``
with the read-only and portable flags) on first use. A batch is then issued on the caller's
current CUDA stream as one ``cuMemcpyBatchAsync`` call (the driver's batched copy, CUDA 13
drivers: ``cuMemcpyBatchAsync_v2``) over every run of records adjacent both in the file and in
the batch; without it, as one ``copy_(non_blocking=True)`` per run.

Measured on the H200 host (``benchmarks/probe_batchcopy.py``, 2 GB in /dev/shm, shuffled, one
thread, 16 MiB batches): the batched call moved 54.7 GB/s of 256 KiB and of 64 KiB records (the
pinned host-to-device ceiling is 55) and 18.2 GB/s of 8 KiB records; per-record ``copy_`` 30.1
and 9.2 GB/s (8.5 and 7.1 us per call). A CPU gather from the map into pinned memory reached
13.6-19.7 GB/s on 16 threads: reading the page cache with the CPU costs 5-9 GB/s per core, the
copy engine reads it at PCIe speed.

Registration pins the shard's pages (memory that stays resident) until the shard is closed,
so the loader uses this path only for data that fits in memory (:mod:`feedpipe._direct`).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from functools import cache
from typing import Any

import numpy as np
import torch

__all__ = [
    "batch_copy_available",
    "copy_records",
    "locked_rows",
    "read_only_supported",
    "runs",
    "unlock",
]

_READ_ONLY = 8  # cudaHostRegisterReadOnly
_PORTABLE = 1  # cudaHostRegisterPortable
_ATTR_READ_ONLY_HOST_REGISTER = 113  # CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
_SRC_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order


class _CopyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: access order, source and destination location hints, flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class _Driver:
    """The few CUDA driver entry points used here, through ctypes (the call releases the GIL)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.batch = lib.cuMemcpyBatchAsync_v2
        self.batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t] + [ctypes.c_void_p] * 2
        self.batch.argtypes += [ctypes.c_size_t, ctypes.c_void_p]
        self.get_ctx = lib.cuCtxGetCurrent
        self.set_ctx = lib.cuCtxSetCurrent
        self.set_ctx.argtypes = [ctypes.c_void_p]
        self.attr = _CopyAttributes(_SRC_ORDER_STREAM, 0, 0, 0, 0, 0)
        self.attr_index = (ctypes.c_size_t * 1)(0)
        self.primary: dict[int, int] = {}
        self.lock = threading.Lock()

    def context(self, device: int) -> int:
        """The device's primary context (the one torch uses), retained once per process."""
        ctx = self.primary.get(device)
        if ctx is None:
            with self.lock:
                handle = ctypes.c_void_p()
                _check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "retain")
                ctx = self.primary[device] = int(handle.value or 0)
        return ctx


@cache
def _driver() -> _Driver | None:
    """libcuda's batched copy (CUDA 13 drivers), or None (older driver, no driver at all)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return _Driver(lib) if hasattr(lib, "cuMemcpyBatchAsync_v2") else None
    except OSError:
        return None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with CUresult {code}")


def batch_copy_available() -> bool:
    """Whether the driver has the batched copy (else one ``copy_`` per run of records)."""
    return _driver() is not None


def read_only_supported(device: int) -> bool:
    """Whether ``device`` can DMA from read-only registered memory (a read-only file map)."""
    driver = _driver()
    if driver is None:  # assume the common case; a failing registration names itself
        return True
    value = ctypes.c_int()
    code = driver.lib.cuDeviceGetAttribute(
        ctypes.byref(value), _ATTR_READ_ONLY_HOST_REGISTER, device
    )
    return code == 0 and value.value == 1


_REGISTER_LOCK = threading.Lock()  # loader threads may open the same shard at once


def locked_rows(shard: Any, rows: np.ndarray, where: str) -> torch.Tensor:
    """``rows`` (the shard's map) as a CPU tensor over page-locked memory; registered once."""
    locked = shard.locked
    if locked is not None:
        return locked
    with _REGISTER_LOCK:
        if shard.locked is not None:
            return shard.locked
        with warnings.catch_warnings():  # the map is read-only; the tensor is only copied from
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(rows)
        if rows.nbytes:
            err = torch.cuda.cudart().cudaHostRegister(
                rows.ctypes.data, rows.nbytes, _READ_ONLY | _PORTABLE
            )
            if int(err) != 0:
                raise RuntimeError(
                    f"{where}: cudaHostRegister of the shard map failed (cudaError {int(err)})"
                )
            shard.unlock = rows.ctypes.data
        shard.locked = tensor
        return tensor


def unlock(shard: Any) -> None:
    """Unregister the shard's map (before it is unmapped); waits for copies in flight."""
    ptr = shard.unlock
    shard.locked = shard.unlock = None
    if ptr is not None:
        torch.cuda.synchronize()  # a DMA may still read the pages
        torch.cuda.cudart().cudaHostUnregister(ptr)


def runs(src: np.ndarray, shard: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Split batch rows ``0..n-1`` (row ``p`` read from address ``src[p]`` of shard
    ``shard[p]``) into runs contiguous at both ends: ``(first rows, lengths in bytes)``."""
    n = len(src)
    step = (np.diff(src) != record_bytes) | (np.diff(shard) != 0)
    starts = np.concatenate([[0], np.flatnonzero(step) + 1]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [n]])) * record_bytes
    return starts, lengths


_DEFAULT_STREAMS = (0, 1, 2)  # NULL, cudaStreamLegacy, cudaStreamPerThread


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """Where copies go when the caller's current stream is a default stream."""
    return torch.cuda.Stream(device)


def copy_records(dest: torch.Tensor, src: np.ndarray, shard: np.ndarray, record_bytes: int) -> None:
    """Copy record ``p`` from host address ``src[p]`` (registered memory) to row ``p`` of
    ``dest`` (a contiguous CUDA tensor), asynchronously on the current stream. Runs adjacent in
    both (and in one shard: ``shard[p]``) become one copy."""
    if len(src) == 0:
        return
    starts, lengths = runs(src, shard, record_bytes)
    driver = _driver()
    if driver is None:
        flat = dest.view(-1).view(torch.uint8)
        for a, size in zip(starts.tolist(), lengths.tolist(), strict=True):
            host = torch.from_numpy(
                np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(int(src[a])))
            )
            flat[a * record_bytes : a * record_bytes + size].copy_(host, non_blocking=True)
        return
    current = torch.cuda.current_stream(dest.device)
    if current.cuda_stream in _DEFAULT_STREAMS:  # the batched copy refuses the legacy stream
        side = _side_stream(dest.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            copy_records(dest, src, shard, record_bytes)
        current.wait_stream(side)
        return
    dsts = (dest.data_ptr() + starts * record_bytes).astype(np.uint64)
    srcs = src[starts].astype(np.uint64)
    sizes = lengths.astype(np.uint64)
    stream = current.cuda_stream
    want = driver.context(dest.device.index or 0)
    ctx = ctypes.c_void_p()
    _check(driver.get_ctx(ctypes.byref(ctx)), "cuCtxGetCurrent")
    before = int(ctx.value or 0)
    if before != want:  # a thread that never touched this device, or another device's thread
        _check(driver.set_ctx(want), "cuCtxSetCurrent")
    try:
        code = driver.batch(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            ctypes.byref(driver.attr),
            driver.attr_index,
            1,
            stream,
        )
    finally:
        if before not in (0, want):  # leave the caller's current device as it was
            driver.set_ctx(before)
    _check(code, f"cuMemcpyBatchAsync_v2 ({len(sizes)} copies)")
