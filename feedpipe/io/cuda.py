"""The CUDA libraries, for the few calls torch does not expose (host memory registration) or
exposes only with the GIL released: one way to find and load them for feedpipe and ckpt."""

from __future__ import annotations

import ctypes
from functools import cache

__all__ = ["cudart_paths", "libcuda"]


@cache
def libcuda() -> ctypes.CDLL:
    """``libcuda.so.1``, loaded once; ``OSError`` where there is no driver (tried again then)."""
    return ctypes.CDLL("libcuda.so.1")


def cudart_paths() -> list[str]:
    """The paths of every ``libcudart`` this process has mapped (torch's own instance is one of
    them once torch has initialised CUDA), sorted; empty where none is mapped or ``/proc`` is
    unreadable."""
    try:
        with open("/proc/self/maps") as f:
            # the path is the sixth field, and may hold spaces
            return sorted({line.split(maxsplit=5)[5].strip() for line in f if "/libcudart" in line})
    except OSError:
        return []
