"""The on-disk format (version 1; see docs/ckpt-format.md): data files of raw tensor bytes plus a
JSON manifest with the tree, dtype, shape, file, offset, length and a CRC32C per chunk.

These functions are the storage layer on their own (planning a layout, staging into a buffer,
writing a data file with checksums, writing/reading/validating a manifest, reading a data file
back verified) so that other writers (e.g. a DCP ``StorageWriter``) can reuse them. No pickle.

One concept per module; this package re-exports their public names:

- ``limits``: the format's version, chunk sizes and bounds;
- ``paths``: safe file names and how a checkpoint's files are opened;
- ``entries``: where each leaf's bytes sit in a data file (``plan``, ``stage``, ``load_arrays``);
- ``writer``: writing a data file with its per-chunk CRC32Cs (``write_file``, ``ChunkedWriter``);
- ``reader``: reading a data file back verified (``stream_file``, ``verify_file``);
- ``manifest``: the manifest file (``new_manifest``, ``write_manifest``, ``read_manifest``);
- ``validator``, ``tree``, ``fields``, ``metrics``: the checks a manifest body passes.
"""

from __future__ import annotations

from ckpt.format.entries import load_arrays, plan, stage
from ckpt.format.fields import MAX_NDIM, numpy_dtype, torch_itemsize
from ckpt.format.limits import (
    ALIGN,
    CHUNK_BYTES,
    FORMAT_VERSION,
    IO_BYTES,
    MAX_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_METRICS,
)
from ckpt.format.manifest import MANIFEST, new_manifest, read_manifest, write_manifest
from ckpt.format.metrics import check_metrics
from ckpt.format.paths import inside, open_data, open_regular, safe_relpath
from ckpt.format.reader import Target, check_file, stream_file, verify_file
from ckpt.format.validator import validate_manifest
from ckpt.format.writer import ChunkedWriter, write_file

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "IO_BYTES",
    "MANIFEST",
    "MAX_DEPTH",
    "MAX_MANIFEST_BYTES",
    "MAX_METRICS",
    "MAX_NDIM",
    "ChunkedWriter",
    "Target",
    "check_file",
    "check_metrics",
    "inside",
    "load_arrays",
    "new_manifest",
    "numpy_dtype",
    "open_data",
    "open_regular",
    "plan",
    "read_manifest",
    "safe_relpath",
    "stage",
    "stream_file",
    "torch_itemsize",
    "validate_manifest",
    "verify_file",
    "write_file",
    "write_manifest",
]
