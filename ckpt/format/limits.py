"""The format's numbers: its version, chunk and read sizes, and the bounds a manifest must keep.

Every module of ``ckpt.format`` takes its constants from here, so a bound is spelled once.
"""

from __future__ import annotations

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "IO_BYTES",
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_MANIFEST_BYTES",
    "MAX_METRICS",
    "MAX_NDIM",
]

FORMAT_VERSION = 1
ALIGN = 64  # every entry starts at a multiple of 64 bytes (any dtype can be viewed in place)
MAX_DEPTH = 100
"""How deeply a state may nest (the root is depth 0); deeper trees are refused on save and load."""
CHUNK_BYTES = 16 << 20  # one CRC32C per 16 MiB of each data file
IO_BYTES = 16 << 20  # the largest single read of a restore: its buffer per reader thread
MAX_MANIFEST_BYTES = 1 << 30  # a manifest is read whole: bounded, whatever its file claims
MAX_METRICS = 256  # the most metrics one step may carry
MAX_NDIM = 64  # the most dimensions of a shape
MAX_BYTES = 1 << 62  # sizes and offsets beyond this are refused (no real file is that large)
