"""Datasets on disk: the memmap format (``format``), its reader (``memmap``) and writer
(``writer``), Zarr arrays (``zarr``) and conversion into the memmap format (``convert``).

The public classes are reached as ``feedpipe.MemmapDataset``, ``feedpipe.MemmapWriter``,
``feedpipe.ZarrDataset`` and ``feedpipe.convert``; this package imports nothing at import time.
"""
