"""Datasets on disk: the memmap format (``format``), its typed columns (``columns``), its
reader (``memmap``) and writer (``writer``), token windows over it (``tokens``), Zarr arrays
(``zarr``) and conversion into the memmap format (``convert``).

The public classes are reached as ``feedpipe.MemmapDataset``, ``feedpipe.MemmapWriter``,
``feedpipe.TokenWindows``, ``feedpipe.ZarrDataset`` and ``feedpipe.convert``; this package
imports nothing at import time.
"""
