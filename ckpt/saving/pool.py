"""The staging pool: page-locked (when CUDA is present) host buffers, allocated once and reused.

A save stages the whole state into one buffer. With ``buffers=2`` (double buffering) one save can
stage while the previous one persists; a third save waits for a buffer to come back
(back-pressure) and the wait is reported. Allocation is bounded by ``budget_bytes``.

Page-locking is the slow part of allocating: the kernel faults in and zeroes every page, the
driver pins and maps it. A pinned buffer is therefore anonymous memory (transparent huge pages
requested) that several threads fault in at once before one ``cuMemHostRegister`` call
(portable, through ctypes) registers it, the way torch's ``pinned_use_cuda_host_register``
allocator works; where that is not possible it falls back to ``torch.empty(pin_memory=True)``.

``reserve`` allocates that way, before any save. A buffer that a save itself must allocate (the
first save without ``reserve``) is made by ``Pinning`` instead, so that allocating overlaps
copying: background threads (one per core) fault in and register the buffer ``REGISTER_BYTES``
at a time, each piece registered on its own, in order, and the save copies into each piece as
soon as it is registered (``Buffer.wait``), never across two pieces (``Buffer.pieces``). A piece
whose registration fails stays pageable memory: copies into it are synchronous but correct, and
the failure is logged with its ``CUresult``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from ckpt.errors import CheckpointError
from feedpipe.io.cuda import libcuda

__all__ = [
    "REGISTER_BYTES",
    "SLICE_BYTES",
    "Buffer",
    "PinnedPool",
    "Pinning",
    "PoolOptions",
    "pinned_empty",
]

log = logging.getLogger("ckpt")

_ROUND = 2 << 20  # buffer sizes are rounded up to 2 MiB
SLICE_BYTES = 64 << 20
"""The piece of a pinned buffer one thread faults in at a time."""
_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: pinned for every context
REGISTER_BYTES = 32 << 20
"""The piece of a buffer made by ``Pinning`` that is registered (and copied into) on its own."""
PIECE_TIMEOUT_S = 300.0
"""How long a copy waits for its piece of a buffer to be faulted in and registered."""


class _Driver:
    """``cuMemHostRegister`` / ``cuMemHostUnregister`` through ctypes (calls release the GIL)."""

    def __init__(self, lib: Any) -> None:
        self.register = lib.cuMemHostRegister_v2
        self.register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.unregister = lib.cuMemHostUnregister
        self.unregister.argtypes = [ctypes.c_void_p]
        self.set_ctx = lib.cuCtxSetCurrent
        self.set_ctx.argtypes = [ctypes.c_void_p]
        self.get_ctx = lib.cuCtxGetCurrent
        self.retain = lib.cuDevicePrimaryCtxRetain
        self.retain.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.ctx: int | None = None

    def context(self) -> int:
        """The primary context of the current torch device (the one torch uses)."""
        if self.ctx is None:
            handle = ctypes.c_void_p()
            code = self.retain(ctypes.byref(handle), torch.cuda.current_device())
            if code != 0:
                raise RuntimeError(f"cuDevicePrimaryCtxRetain failed with CUresult {code}")
            self.ctx = int(handle.value or 0)
        return self.ctx

    def call(self, ctx: int, fn: Any, *args: Any) -> int:
        """``fn(*args)`` with ``ctx`` current; the thread's own context is put back after (a
        finalizer may run on any thread)."""
        before = ctypes.c_void_p()
        self.get_ctx(ctypes.byref(before))
        self.set_ctx(ctx)
        try:
            return int(fn(*args))
        finally:
            if before.value and before.value != ctx:
                self.set_ctx(before.value)


@cache
def _driver() -> _Driver | None:
    try:
        return _Driver(libcuda())
    except (OSError, AttributeError):
        return None


_STUCK: list[Any] = []  # areas whose unregister failed: never unmapped while registered
_NOT_REGISTERED = 713  # CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED


def _unregister_all(driver: _Driver, ctx: int, ptrs: list[int], area: Any = None) -> None:
    """Unregister each range of ``area`` (a finalizer, which holds ``area`` mapped until it has
    run); a failure is logged (the driver API leaves no "last error" behind) and keeps ``area``
    mapped for good: the kernel must never reuse addresses CUDA still counts as registered."""
    for ptr in ptrs:
        code = driver.call(ctx, driver.unregister, ptr)
        if code != 0:
            log.warning("ckpt: cuMemHostUnregister at 0x%x failed with CUresult %d", ptr, code)
            if code != _NOT_REGISTERED and area is not None:
                _STUCK.append(area)
                area = None


def pinned_empty(nbytes: int, threads: int = 8) -> tuple[torch.Tensor, Any]:
    """A page-locked uint8 tensor of ``nbytes``; returns it and an object that keeps it
    registered (the memory is unregistered when that object is collected). The pages are
    faulted in by ``threads`` threads at once, then registered in one call (one registration:
    a copy may use any range of it), as torch's ``pinned_use_cuda_host_register`` does. Falls
    back to ``torch.empty(pin_memory=True)`` where the driver cannot be reached."""
    driver = _driver() if nbytes >= SLICE_BYTES else None
    if driver is None:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    try:
        ctx = driver.context()
    except RuntimeError:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    tensor = torch.frombuffer(area, dtype=torch.uint8)
    base = tensor.data_ptr()
    starts = list(range(0, nbytes, SLICE_BYTES))

    def fault(start: int) -> None:  # ctypes releases the GIL: the threads run at once
        ctypes.memset(base + start, 0, min(SLICE_BYTES, nbytes - start))

    with ThreadPoolExecutor(max(1, min(threads, len(starts)))) as pool:
        list(pool.map(fault, starts))
    keep = _Registered(tensor, area)  # before registering: nothing can fail in between
    code = driver.call(ctx, driver.register, base, nbytes, _PORTABLE)
    if code != 0:
        raise RuntimeError(f"cuMemHostRegister of {nbytes} bytes failed with CUresult {code}")
    weakref.finalize(keep, _unregister_all, driver, ctx, [base], area).atexit = False
    return tensor, keep


class Pinning:
    """A page-locked area of ``nbytes`` made in the background (see the module docstring):
    ``threads`` threads fault in and register ``REGISTER_BYTES`` pieces in order; ``wait``
    returns once the pieces covering a byte range are ready. ``register(ptr, nbytes)`` returns
    a ``CUresult`` (default: ``cuMemHostRegister`` in torch's current context). The area stays
    mapped, and registered pieces are unregistered, when the last of ``keep`` and the threads
    lets go of it."""

    def __init__(
        self, nbytes: int, threads: int, register: Callable[[int, int], int] | None = None
    ) -> None:
        self.nbytes = nbytes
        unregister: Callable[[list[int], Any], None] = lambda ptrs, area: None  # noqa: E731
        if register is None:
            driver = _driver()
            if driver is None:
                raise RuntimeError("the CUDA driver (libcuda.so.1) cannot be loaded")
            ctx = driver.context()

            def register(ptr: int, size: int) -> int:
                return driver.call(ctx, driver.register, ptr, size, _PORTABLE)

            def unregister(ptrs: list[int], area: Any) -> None:
                _unregister_all(driver, ctx, ptrs, area)

        self._register = register
        self.area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.area.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.tensor = torch.frombuffer(self.area, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        self.piece = REGISTER_BYTES
        self.starts = list(range(0, nbytes, self.piece))
        self.ready = [threading.Event() for _ in self.starts]
        self.failures: list[str] = []
        self.registered: list[int] = []
        self.keep = _Registered(self.tensor, self.area)
        # unregistered when the last holder lets go; the process's exit frees them otherwise
        weakref.finalize(self.keep, unregister, self.registered, self.area).atexit = False
        pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-pin")
        for k in range(len(self.starts)):
            pool.submit(self._pin, k, self.keep)
        pool.shutdown(wait=False)  # the threads finish the pieces, then exit

    def _pin(self, k: int, keep: _Registered) -> None:
        """Fault in and register piece ``k`` (``keep`` holds the area while this runs)."""
        start = self.starts[k]
        size = min(self.piece, self.nbytes - start)
        try:
            ctypes.memset(self.base + start, 0, size)  # releases the GIL
            code = self._register(self.base + start, size)
            if code != 0:
                self.failures.append(
                    f"cuMemHostRegister of bytes {start}-{start + size} failed with CUresult "
                    f"{code}; that piece stays pageable (slower copies)"
                )
            else:
                self.registered.append(self.base + start)
        except BaseException as exc:  # never leave a waiter hanging
            self.failures.append(f"pinning bytes {start}-{start + size} failed: {exc!r}")
        finally:
            self.ready[k].set()

    def wait(self, start: int, end: int, timeout: float = PIECE_TIMEOUT_S) -> None:
        """Return once the pieces holding bytes ``[start, end)`` are faulted in (and, unless
        their registration failed, registered)."""
        if end <= start:
            return
        for k in range(start // self.piece, (end - 1) // self.piece + 1):
            if not self.ready[k].wait(timeout):
                raise CheckpointError(
                    f"staging buffer: bytes {self.starts[k]}- were not faulted in and registered "
                    f"within {timeout:.0f} s"
                )


class _Registered:
    """Holds a registered area alive; collecting it unregisters the area (weakref.finalize)."""

    def __init__(self, tensor: torch.Tensor, area: mmap.mmap) -> None:
        self.tensor, self.area = tensor, area


@dataclass(frozen=True)
class PoolOptions:
    """How the staging pool is sized.

    ``budget_bytes``: the most host memory the pool may hold (``None``: grow to fit the state, one
    buffer size for all). ``buffers``: 2 = double buffering, 1 = each save waits for the previous
    one to persist. ``pin``: page-locked memory (``None``: when CUDA is available).
    ``wait_timeout_s``: how long a save may wait for a free buffer before failing.
    """

    budget_bytes: int | None = None
    buffers: int = 2
    pin: bool | None = None
    wait_timeout_s: float = 600.0


class Buffer:
    """One staging buffer: a flat uint8 tensor and a numpy view of the same memory.

    ``background=True`` (with ``pin``) makes it with ``Pinning``: it returns at once, a copy
    into it calls ``wait`` for its bytes first and stays within one of its ``pieces``-byte
    pieces; ``wait_all`` waits for the whole buffer (before writes from the host)."""

    def __init__(
        self,
        nbytes: int,
        pin: bool,
        background: bool = False,
        register: Callable[[int, int], int] | None = None,
    ) -> None:
        """``register``: passed to ``Pinning`` (tests)."""
        self._keep: Any = None
        self._pinning: Pinning | None = None
        self.pieces: int | None = None  # separately registered pieces: copies stay inside one
        self.zeroed_for: Any = None  # ckpt.saving.plan: the plan whose padding is zero here (weak)
        if pin and background and nbytes >= REGISTER_BYTES:
            try:
                self._pinning = Pinning(nbytes, _threads(), register)
            except (RuntimeError, OSError):  # no driver here: made at once below
                self._pinning = None
        if self._pinning is not None:
            self.tensor, self._keep = self._pinning.tensor, self._pinning.keep
            self.pieces = self._pinning.piece
        elif pin:
            try:
                self.tensor, self._keep = pinned_empty(nbytes, _threads())
            except (RuntimeError, OSError):  # not registrable here: torch's own pinned memory
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.array: np.ndarray = self.tensor.numpy()
        self.nbytes = nbytes

    def wait(self, start: int, end: int) -> None:
        """Return once bytes ``[start, end)`` may be written (see ``Pinning.wait``)."""
        if self._pinning is not None:
            self._pinning.wait(start, end)

    def wait_all(self) -> None:
        """Return once the whole buffer may be written; logs pieces left pageable."""
        pinning = self._pinning
        if pinning is not None:
            pinning.wait(0, self.nbytes)
            self._pinning = None
            for failure in pinning.failures:
                log.warning("ckpt: staging buffer: %s", failure)

    def view(self) -> memoryview:
        """A writable memoryview of the whole buffer (for os.pwrite / readinto)."""
        return self.array.data.cast("B")


def _threads() -> int:
    """Threads that fault in a pinned buffer: one per core, at most 16."""
    return max(1, min(16, os.cpu_count() or 2))


class PinnedPool:
    """A bounded set of reusable staging buffers (see module docstring)."""

    def __init__(self, options: PoolOptions | None = None) -> None:
        self.options = options or PoolOptions()
        if self.options.buffers < 1:
            raise ValueError("PoolOptions.buffers must be >= 1")
        pin = self.options.pin
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._cond = threading.Condition()
        self._free: list[Buffer] = []
        self._count = 0  # buffers allocated (free + leased)
        self._size = 0  # current buffer size
        if self.options.budget_bytes is not None:
            self._size = self.options.budget_bytes // self.options.buffers
        self.allocated_bytes = 0
        self.waits = 0
        self.wait_s = 0.0

    @property
    def buffer_bytes(self) -> int:
        """The size of each buffer (0 until the first reserve/acquire without a budget)."""
        return self._size

    def _fit(self, nbytes: int) -> None:
        budget = self.options.budget_bytes
        if budget is not None:
            if nbytes > self._size:
                raise CheckpointError(
                    f"state of {nbytes} bytes does not fit a pool buffer of {self._size} bytes "
                    f"(budget {budget} bytes / {self.options.buffers} buffers); raise "
                    "PoolOptions.budget_bytes or lower PoolOptions.buffers"
                )
            return
        if nbytes > self._size:  # grow: new size for all buffers; too-small free ones are dropped
            self._size = -(-nbytes // _ROUND) * _ROUND
            for buf in self._free:
                self.allocated_bytes -= buf.nbytes
            self._count -= len(self._free)
            self._free.clear()

    def _allocate(self, prefault: bool) -> Buffer:
        try:
            buf = Buffer(self._size, self._pin, background=not prefault)
        except (RuntimeError, MemoryError, OSError) as exc:  # out of (lockable) memory: say so
            raise CheckpointError(
                f"cannot allocate a {'pinned ' if self._pin else ''}staging buffer of "
                f"{self._size} bytes (the pool holds {self.allocated_bytes} bytes in "
                f"{self._count} buffers): {exc}; nothing was staged"
            ) from exc
        if prefault and not self._pin:
            buf.tensor.zero_()  # fault the pages in now, not during the first (timed) copy
        self._count += 1
        self.allocated_bytes += buf.nbytes
        return buf

    def reserve(self, nbytes: int) -> None:
        """Allocate every buffer now, for ``nbytes`` each (keeps allocation out of saves)."""
        with self._cond:
            self._fit(nbytes)
            while self._count < self.options.buffers:
                self._free.append(self._allocate(prefault=True))

    def acquire(self, nbytes: int) -> tuple[Buffer, float]:
        """Lease a buffer of at least ``nbytes``; returns it and the seconds spent waiting."""
        start = time.perf_counter()
        deadline = start + self.options.wait_timeout_s
        waited = False
        with self._cond:
            self._fit(nbytes)
            while True:
                for i, buf in enumerate(self._free):
                    if buf.nbytes >= nbytes:
                        del self._free[i]
                        return buf, self._account(start, waited)
                if self._count < self.options.buffers:
                    return self._allocate(prefault=False), self._account(start, waited)
                waited = True
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise CheckpointError(
                        f"no staging buffer came back within {self.options.wait_timeout_s:.0f} s "
                        "(the background write is stuck or too slow)"
                    )
                self._cond.wait(min(left, 0.1))  # short waits keep Ctrl-C responsive

    def _account(self, start: float, waited: bool) -> float:
        elapsed = time.perf_counter() - start if waited else 0.0
        if waited:
            self.waits += 1
            self.wait_s += elapsed
        return elapsed

    def release(self, buf: Buffer) -> None:
        """Return a leased buffer; buffers smaller than the current size are freed."""
        with self._cond:
            if buf.nbytes >= self._size:
                self._free.append(buf)
            else:
                self._count -= 1
                self.allocated_bytes -= buf.nbytes
            self._cond.notify_all()
