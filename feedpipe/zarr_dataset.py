"""Moved to :mod:`feedpipe.datasets.zarr`; this public path re-exports it."""

from feedpipe.datasets.zarr import ZarrDataset

__all__ = ["ZarrDataset"]
