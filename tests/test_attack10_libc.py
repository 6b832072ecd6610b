"""Attack on ``CDLL(None)`` (feedpipe.datasets._filemap.libc): the ``mmap``/``munmap`` it
resolves are the C library's own, the very functions ``find_library("c")`` names (run once
here, in a subprocess with no other thread, where ``ldconfig`` cannot hang), torch's
libraries loaded before it."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import ctypes, ctypes.util
import torch  # its libraries loaded first (libtorch_global_deps is RTLD_GLOBAL): none wins
name = ctypes.util.find_library("c")  # the slow lookup, once, before anything forks
assert name, "no C library found"
from feedpipe.datasets import _filemap
ours, theirs = _filemap.libc(), ctypes.CDLL(name)
for fn in ("mmap", "munmap"):
    a = ctypes.cast(getattr(ours, fn), ctypes.c_void_p).value
    b = ctypes.cast(getattr(theirs, fn), ctypes.c_void_p).value
    assert a == b, f"{fn}: CDLL(None) resolves {a:#x}, the C library's is {b:#x}"
assert ours.mmap.restype is ctypes.c_void_p  # a 64-bit address never truncated to an int
print("ok")
"""


def test_libc_symbols_are_the_c_librarys() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
