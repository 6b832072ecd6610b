"""Fixed-size records moved straight from the page cache to the GPU (no host gather).

A shard's read-only map is registered with CUDA (``cudaHostRegister``: read-only, portable,
mapped) on first use, so the GPU can read it over PCIe. A batch then goes one of two ways, both
asynchronous on the caller's current CUDA stream:

- **copy engines** (records of 64 KiB and more, CUDA 13 drivers): one ``cuMemcpyBatchAsync_v2``
  call over every run of records adjacent both in the file and in the batch. No SM time.
- **a gather kernel** (smaller records, or no batched copy in the driver): the map is viewed as
  a CUDA tensor (zero-copy) and ``index_select`` reads the rows over PCIe into the batch; the
  indices go up in one small pinned copy.

Which of the two serves a batch is decided by record size: the batched copy wins for large
records and the gather kernel for small ones (docs/benchmarks.md, "Direct DMA path: copy
methods", measured with ``benchmarks/diagnostics/probe_batchcopy.py``).
Registration pins the shard's pages (memory that stays resident) until the shard is
closed, so the loader uses this path only for data that fits in memory
(:mod:`feedpipe.device.direct`).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

from feedpipe.device import hostreg
from feedpipe.io.cuda import libcuda

__all__ = [
    "batch_copy_available",
    "copy_records",
    "gather_records",
    "move_records",
    "read_only_supported",
    "register",
    "runs",
    "unlock",
]

_READ_ONLY = 8  # cudaHostRegisterReadOnly
_MAPPED = 2  # cudaHostRegisterMapped
_PORTABLE = 1  # cudaHostRegisterPortable
_ATTR_READ_ONLY_HOST_REGISTER = 113  # CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
_SRC_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order
_COPY_ENGINE_MIN = 64 << 10  # smaller records: the gather kernel (table above)
_DEFAULT_STREAMS = (0, 1, 2)  # NULL, cudaStreamLegacy, cudaStreamPerThread


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
    """The few CUDA driver entry points used here, through ctypes (calls release the GIL)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        if self.batch is not None:
            self.batch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p]
            self.batch.argtypes += [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.get_ctx = lib.cuCtxGetCurrent
        self.set_ctx = lib.cuCtxSetCurrent
        self.set_ctx.argtypes = [ctypes.c_void_p]
        self.host_ptr = lib.cuMemHostGetDevicePointer_v2
        self.host_ptr.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
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

    def call_on(self, device: int, fn: Any, *args: Any) -> int:
        """``fn(*args)`` with ``device``'s context current; the thread's own is restored."""
        want = self.context(device)
        ctx = ctypes.c_void_p()
        _check(self.get_ctx(ctypes.byref(ctx)), "cuCtxGetCurrent")
        before = int(ctx.value or 0)
        if before != want:  # a thread that never touched this device, or another device's thread
            _check(self.set_ctx(want), "cuCtxSetCurrent")
        try:
            return int(fn(*args))
        finally:
            if before not in (0, want):  # leave the caller's current device as it was
                self.set_ctx(before)


@cache
def _driver() -> _Driver | None:
    """libcuda through ctypes, or None (no driver: the loader never gets here then)."""
    try:
        return _Driver(libcuda())
    except (OSError, AttributeError):
        return None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with CUresult {code}")


def batch_copy_available() -> bool:
    """Whether the driver has the batched copy (else small and big records use the kernel)."""
    driver = _driver()
    return driver is not None and driver.batch is not None


def read_only_supported(device: int) -> bool:
    """Whether ``device`` can read read-only registered memory (a read-only file map)."""
    driver = _driver()
    if driver is None:  # assume the common case; a failing registration names itself
        return True
    value = ctypes.c_int()
    code = driver.lib.cuDeviceGetAttribute(
        ctypes.byref(value), _ATTR_READ_ONLY_HOST_REGISTER, device
    )
    return code == 0 and value.value == 1


@dataclass(eq=False)
class _Registration:
    """A shard map registered with CUDA: its host address, per device a tensor view, and the
    :class:`~feedpipe.device.hostreg.Registration` that unregisters it (None: an empty map)."""

    ptr: int
    records: int
    record_bytes: int
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    handle: hostreg.Registration | None = None


class _DeviceArray:
    """A CUDA array interface over mapped host memory, for ``torch.as_tensor`` (no copy)."""

    def __init__(self, ptr: int, shape: tuple[int, int]) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "|u1",
            "data": (ptr, False),  # torch refuses the read-only flag; the kernel only reads
            "version": 2,
        }


_REGISTER_LOCK = threading.Lock()  # loader threads may open the same shard at once


def register(shard: Any, rows: np.ndarray, where: str) -> _Registration:
    """Register ``rows`` (the shard's read-only map, records x bytes) with CUDA, once.

    ``rows`` must be the shard's current map (``shard.rows``): a shard being closed (its
    ``rows`` dropped) is refused, under the same lock as :func:`unlock`, so no registration is
    ever made after the shard's last unlock. The registration holds ``rows``, which keeps the
    map mapped until it is unregistered (:mod:`feedpipe.device.hostreg`, rule 3)."""
    reg: _Registration | None = shard.locked
    if reg is not None:
        return reg
    with _REGISTER_LOCK:
        if shard.locked is not None:
            return shard.locked  # type: ignore[no-any-return]
        if getattr(shard, "rows", rows) is not rows:
            raise ValueError(f"{where}: the shard map is closed")
        handle = None
        if rows.nbytes:
            handle = hostreg.register(
                rows.ctypes.data,
                rows.nbytes,
                _READ_ONLY | _MAPPED | _PORTABLE,
                f"{where} (shard map)",
                anchor=rows,
            )
        reg = _Registration(rows.ctypes.data, rows.shape[0], rows.shape[1], handle=handle)
        if handle is not None:  # a shard dropped without close still unregisters (rule 4)
            hostreg.release_when_collected(reg, handle)
        shard.locked = reg
        shard.unlock = handle
        return reg


def _device_rows(reg: _Registration, device: torch.device) -> torch.Tensor:
    """The registered map as a ``(records, record_bytes)`` uint8 CUDA tensor (zero-copy)."""
    index = device.index or 0
    view = reg.views.get(index)
    if view is None:
        driver = _driver()
        dptr = ctypes.c_uint64(reg.ptr)
        if driver is not None:  # the device address of the mapping (the same under UVA)
            code = driver.call_on(index, driver.host_ptr, ctypes.byref(dptr), reg.ptr, 0)
            _check(code, "cuMemHostGetDevicePointer")
        shape = (reg.records, reg.record_bytes)
        view = torch.as_tensor(_DeviceArray(int(dptr.value), shape), device=device)
        reg.views[index] = view
    return view


def unlock(shard: Any) -> None:
    """Unregister the shard's map (before it is unmapped: the registration holds the map until
    then); waits for the reads in flight first. No registration of it can follow (see
    :func:`register`: the caller drops ``shard.rows`` first)."""
    with _REGISTER_LOCK:
        reg, shard.locked, shard.unlock = shard.locked, None, None
    if reg is not None:
        reg.views.clear()
        if reg.handle is not None:
            reg.handle.release()  # synchronizes, then unregisters even if that raised


def runs(src: np.ndarray, shard: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Split batch rows ``0..n-1`` (row ``p`` read from address ``src[p]`` of shard
    ``shard[p]``) into runs contiguous at both ends: ``(first rows, lengths in bytes)``."""
    n = len(src)
    step = (np.diff(src) != record_bytes) | (np.diff(shard) != 0)
    starts = np.concatenate([[0], np.flatnonzero(step) + 1]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [n]])) * record_bytes
    return starts, lengths


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """Where copies go when the caller's current stream is a default stream."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch


def move_records(
    dest: torch.Tensor, regs: dict[int, _Registration], shard: np.ndarray, local: np.ndarray
) -> None:
    """Fill row ``p`` of ``dest`` (a contiguous CUDA tensor, any dtype) with record
    ``local[p]`` of shard ``shard[p]`` (registered: ``regs``), asynchronously on the current
    stream, by the copy engines or by the gather kernel (module doc)."""
    if len(local) == 0:
        return
    record_bytes = next(iter(regs.values())).record_bytes
    if record_bytes >= _COPY_ENGINE_MIN and batch_copy_available():
        base = np.zeros(int(shard.max()) + 1, np.int64)
        for s, reg in regs.items():
            base[s] = reg.ptr
        copy_records(dest, base[shard] + local * record_bytes, shard, record_bytes)
    else:
        gather_records(dest, regs, shard, local)


def gather_records(
    dest: torch.Tensor, regs: dict[int, _Registration], shard: np.ndarray, local: np.ndarray
) -> None:
    """The gather kernel: ``index_select`` from each shard's zero-copy view into ``dest``."""
    n = len(local)
    rows = dest.view(n, -1).view(torch.uint8)
    order = np.argsort(shard, kind="stable")  # the identity for a batch from one shard
    host = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)  # reuse: torch's host cache
    index = host.numpy()
    index[:n] = local[order]
    index[n:] = order
    on_device = host.to(dest.device, non_blocking=True)
    if len(regs) == 1:
        torch.index_select(
            _device_rows(regs[int(shard[0])], dest.device), 0, on_device[:n], out=rows
        )
        return
    s_sorted = shard[order]
    bounds = [0, *(np.flatnonzero(np.diff(s_sorted)) + 1).tolist(), n]
    gathered = torch.empty_like(rows)  # rows in shard order, then one scatter into the batch
    for a, b in itertools.pairwise(bounds):
        view = _device_rows(regs[int(s_sorted[a])], dest.device)
        torch.index_select(view, 0, on_device[a:b], out=gathered[a:b])
    rows.index_copy_(0, on_device[n:], gathered)


def copy_records(dest: torch.Tensor, src: np.ndarray, shard: np.ndarray, record_bytes: int) -> None:
    """The copy engines: record ``p`` from host address ``src[p]`` (registered memory) to row
    ``p`` of ``dest``; runs adjacent in both (and in one shard) become one copy."""
    driver = _driver()
    if driver is None or driver.batch is None:
        raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync_v2 (CUDA 13 drivers)")
    current = torch.cuda.current_stream(dest.device)
    if current.cuda_stream in _DEFAULT_STREAMS:  # the batched copy refuses the legacy stream
        side = _side_stream(dest.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            copy_records(dest, src, shard, record_bytes)
        current.wait_stream(side)
        return
    starts, lengths = runs(src, shard, record_bytes)
    dsts = (dest.data_ptr() + starts * record_bytes).astype(np.uint64)
    srcs = src[starts].astype(np.uint64)
    sizes = lengths.astype(np.uint64)
    code = driver.call_on(
        dest.device.index or 0,
        driver.batch,
        dsts.ctypes.data,
        srcs.ctypes.data,
        sizes.ctypes.data,
        len(sizes),
        ctypes.byref(driver.attr),
        driver.attr_index,
        1,
        current.cuda_stream,
    )
    _check(code, f"cuMemcpyBatchAsync_v2 ({len(sizes)} copies)")
