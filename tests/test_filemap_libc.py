"""The C library is found without running a subprocess: ``ctypes.util.find_library`` runs
``ldconfig -p`` and reads its pipe to EOF, which never comes while a child that another thread
forked meanwhile holds the pipe open (a worker started during a dataset's first read)."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import ctypes.util, mmap
def refuse(name):
    raise AssertionError(f"find_library({name!r}) was called")
ctypes.util.find_library = refuse
from feedpipe.datasets import _filemap
lib = _filemap.libc()
addr = lib.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), addr
assert lib.munmap(addr, mmap.PAGESIZE) == 0
print("ok")
"""


def test_libc_is_loaded_without_find_library() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
