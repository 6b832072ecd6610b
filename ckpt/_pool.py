"""The staging pool: page-locked (when CUDA is present) host buffers, allocated once and reused.

A save stages the whole state into one buffer. With ``buffers=2`` (double buffering) one save can
stage while the previous one persists; a third save waits for a buffer to come back
(back-pressure) and the wait is reported. Allocation is bounded by ``budget_bytes``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ckpt.errors import CheckpointError

__all__ = ["Buffer", "PinnedPool", "PoolOptions"]

_ROUND = 2 << 20  # buffer sizes are rounded up to 2 MiB


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
    """One staging buffer: a flat uint8 tensor and a numpy view of the same memory."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.array: np.ndarray = self.tensor.numpy()
        self.nbytes = nbytes

    def view(self) -> memoryview:
        """A writable memoryview of the whole buffer (for os.pwrite / readinto)."""
        return self.array.data.cast("B")


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
        buf = Buffer(self._size, self._pin)
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
