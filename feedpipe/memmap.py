"""Moved to :mod:`feedpipe.datasets.memmap`; this public path re-exports it."""

from feedpipe.datasets.memmap import MemmapDataset, MemmapWriter, verify_files

__all__ = ["MemmapDataset", "MemmapWriter", "verify_files"]
