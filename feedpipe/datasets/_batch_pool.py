"""Arrays for new batches, reused once nothing refers to them any more (:class:`BatchPool`).

A batch of a few MiB read into fresh memory costs the kernel a page fault and the zeroing of
every page before the gather writes it: in a training loop, where the previous batch is still
alive while the next one is read, the allocator hands out fresh pages every time, and that
costs as much as the gather (8 MiB batches: 0.3-0.5 ms each on a 2-core VM). The pool keeps a
few batch arrays per thread and hands one out again only when nothing else refers to it: no
tensor, view or array of it is alive (its reference count is the pool's own). A batch returned
is never changed afterwards: each batch is still memory of its own while anyone holds it.

What "the pool's own" count is depends on the interpreter (Python 3.14 borrows references it
used to count on the stack): it is measured, on first use, by the very function that later
checks the pool (:func:`_counts`), on an array only a list holds, and must then rise by one for
one more reference; where it does not (or on a free-threaded build, where counts are split
across threads) the pool is off and every batch is a fresh array.

A pooled batch starts on a page, a fresh one of ``ALIGN_MIN`` bytes or more on a cache line:
``malloc`` aligns to 16 bytes only, and copying large records into rows that start 16 bytes
past a 32-byte boundary is much slower than into aligned ones (a pooled array so placed made
every batch of a process slower, at random per process and thread; see
``tests/test_memmap_batch_read.py``).
"""

from __future__ import annotations

import math
import sys
import sysconfig
import threading
from typing import Any

import numpy as np

__all__ = ["BatchPool", "aligned_empty"]

LINE = 64  # a fresh batch of ALIGN_MIN bytes or more starts at a multiple of this many bytes
PAGE = 4096  # a pooled one at a multiple of this
ALIGN_MIN = 256 << 10  # smaller fresh batches are plain np.empty (aligning costs more there)
_U8 = np.dtype(np.uint8)


def _skip(base: np.ndarray, align: int) -> int:
    """Bytes from ``base``'s start to its first ``align``-aligned byte."""
    return int(-base.__array_interface__["data"][0] % align)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any], align: int = LINE) -> np.ndarray:
    """``np.empty(shape, dtype)`` starting at a multiple of ``align`` bytes (its base is the
    array allocated: numpy's views name the owner of their memory as their base)."""
    nbytes = dtype.itemsize * math.prod(shape)
    base = np.empty(nbytes + align, _U8)
    skip = _skip(base, align)
    return base[skip : skip + nbytes].view(dtype).reshape(shape)


def _counts(pool: list[np.ndarray]) -> list[int]:
    """The reference count of each array of ``pool``, as seen from here (measured and compared
    by this one function, so the interpreter's own references are the same in both)."""
    return [sys.getrefcount(base) for base in pool]


def _unused_count() -> int | None:
    """What :func:`_counts` says of an array only its list holds; None where a reference more
    does not show as one more (then no count can tell that a batch is released)."""
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    probe = [np.empty(1, np.uint8)]
    alone = _counts(probe)[0]
    view = probe[0][:]
    held = _counts(probe)[0]
    del view
    return alone if held == alone + 1 and _counts(probe)[0] == alone else None


class BatchPool:
    """Per thread, up to ``keep`` arrays (at most ``max_bytes`` in all) of batches of at least
    ``min_bytes`` (smaller ones come from ``np.empty``: the allocator reuses those well)."""

    def __init__(self, keep: int = 6, min_bytes: int = 1 << 20, max_bytes: int = 256 << 20) -> None:
        self.keep, self.min_bytes, self.max_bytes = keep, min_bytes, max_bytes
        self._tls = threading.local()
        self._unused: int | bool | None = False  # False: not measured yet

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep, "min_bytes": self.min_bytes, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tls = threading.local()
        self._unused = False

    def held(self) -> int:
        """Bytes of batch arrays this thread's pool keeps (in use or free)."""
        return sum(a.nbytes - PAGE for a in getattr(self._tls, "arrays", ()))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` that nothing else refers to."""
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            if nbytes < ALIGN_MIN:
                return np.empty(shape, dtype)
            return aligned_empty(shape, dtype)
        if self._unused is False:
            self._unused = _unused_count()
        unused = self._unused
        if unused is None:
            return aligned_empty(shape, dtype)
        tls = self._tls
        pool: list[np.ndarray] | None = getattr(tls, "arrays", None)
        if pool is None:
            pool = tls.arrays = []
            tls.skips = []
        size = nbytes + PAGE  # each array is a page over: its batch starts on a page
        counts = _counts(pool)
        for i, base in enumerate(pool):
            if counts[i] == unused and base.nbytes == size:
                skip = tls.skips[i]
                break
        else:
            base = np.empty(size, _U8)
            skip = _skip(base, PAGE)
            pool.insert(0, base)
            tls.skips.insert(0, skip)
            while len(pool) > self.keep or sum(a.nbytes - PAGE for a in pool) > self.max_bytes:
                pool.pop()  # the oldest: freed once its batch is
                tls.skips.pop()
        return base[skip : skip + nbytes].view(dtype).reshape(shape)
