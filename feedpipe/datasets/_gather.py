"""Gather helpers shared by the datasets' batched reads (``MemmapDataset``, ``ZarrDataset``).

A batch that spans several shards is gathered in file order into a scratch buffer, then put
back in the caller's order by one more gather through the inverse permutation (``np.take``
copies whole rows; a fancy setitem does not). Records of at least :data:`ROW_COPY_MIN` bytes
skip the scratch: each is copied once, straight to its row.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["ROW_COPY_MIN", "inverse", "scratch"]

ROW_COPY_MIN = 64 << 10  # records this large are copied one by one (no scratch + scatter)


def scratch(tls: threading.local, like: np.ndarray) -> np.ndarray:
    """A per-thread buffer shaped like ``like``, reused across batches (a fresh one per batch
    is faulted in page by page, which costs more than the gather itself)."""
    buf = getattr(tls, "buf", None)
    if buf is None or buf.nbytes < like.nbytes:
        buf = tls.buf = np.empty(like.nbytes, np.uint8)
    return buf[: like.nbytes].view(like.dtype).reshape(like.shape)


def inverse(order: np.ndarray) -> np.ndarray:
    """The inverse permutation of ``order``: ``inverse(order)[order] == arange(len(order))``."""
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    return inv
