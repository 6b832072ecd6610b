"""Moved to :mod:`feedpipe.io.crc`; this path re-exports it."""

from feedpipe.io.crc import crc32c, crc32c_file, to_hex

__all__ = ["crc32c", "crc32c_file", "to_hex"]
