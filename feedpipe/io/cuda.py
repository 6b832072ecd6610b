"""The CUDA driver library, for the few driver calls torch does not expose (host memory
registration): one way to load it for feedpipe and ckpt."""

from __future__ import annotations

import ctypes
from functools import cache

__all__ = ["libcuda"]


@cache
def libcuda() -> ctypes.CDLL:
    """``libcuda.so.1``, loaded once; ``OSError`` where there is no driver (tried again then)."""
    return ctypes.CDLL("libcuda.so.1")
