"""Files mapped read-only without keeping a descriptor (:func:`map_file`), the C library
calls behind every map the datasets make (:func:`libc`), and the one quiet close of a
descriptor they own (:func:`close_fd`)."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

__all__ = ["close_fd", "libc", "map_file"]

_PROT_READ, _MAP_SHARED = 1, 0x01
_libc: Any = None


def libc() -> Any:
    """The C library, with ``mmap``/``munmap`` typed (loaded on first use)."""
    global _libc
    if _libc is None:
        # the process's own symbols (libc among them): ctypes.util.find_library would run
        # ``ldconfig -p`` and read its pipe to EOF, which never comes while a child forked
        # meanwhile by another thread (a worker) holds the pipe open
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def close_fd(fd: int) -> int:
    """Close descriptor ``fd`` if it is open (``>= 0``), ignoring an error (it is gone either
    way); returns -1, the value of a closed descriptor, for the caller to store."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    return -1


def map_file(fd: int, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of the file open as ``fd``, mapped read-only (shared), as a flat
    uint8 array. Unlike :class:`mmap.mmap`, which keeps a duplicate descriptor per map, the map
    holds no descriptor: ``fd`` may be closed at once. It is unmapped when the last array over
    it is gone (never under a live view)."""
    if nbytes <= 0:
        return np.empty(0, np.uint8)
    return np.asarray(_FileMap(fd, nbytes))


class _FileMap:
    """One file map behind :func:`map_file`'s arrays (their ``base``); unmapped when collected."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self._addr = 0
        got = libc().mmap(None, nbytes, _PROT_READ, _MAP_SHARED, fd, 0)
        if got is None or got == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {nbytes} bytes: {os.strerror(err)}")
        self._addr, self._nbytes = int(got), nbytes
        self.__array_interface__ = {
            "data": (self._addr, True),  # read-only
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        if self._addr:
            libc().munmap(self._addr, self._nbytes)
            self._addr = 0
