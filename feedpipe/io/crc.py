"""CRC32C checksums through the maintained ``crc32c`` package (hardware-accelerated, GIL released).

Shared by feedpipe (dataset index checksums) and ckpt (per-chunk manifest checksums), so it
lives in :mod:`feedpipe.io`.
Checksums are stored as 8-digit lowercase hex strings.
"""

from __future__ import annotations

import os
from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c", "crc32c_file", "to_hex"]

_FILE_CHUNK = 8 << 20


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a C-contiguous buffer (bytes, memoryview, ndarray), continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def crc32c_file(path: str | os.PathLike[str], chunk: int = _FILE_CHUNK) -> tuple[int, int]:
    """Return ``(crc32c, size)`` of a file, read in chunks."""
    value, size = 0, 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            value = crc32c(view[:n], value)
            size += n
    return value, size


def to_hex(value: int) -> str:
    """Format a checksum the way indexes and manifests store it."""
    return f"{value:08x}"
