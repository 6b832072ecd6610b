"""The engine that reads a :class:`~feedpipe.ZarrDataset`'s arrays in this process.

:class:`ZarrEngine` opens each array once per process, through TensorStore (the default: GIL
released, one batched read per array, ``fill_missing_data_reads=False``) or zarr-python over
the strict store of :mod:`._zarr_strict` (local folders and fsspec URLs); on both a missing
chunk is a :class:`~feedpipe.errors.DatasetError`, never fill values. TensorStore aborts a
forked child that uses it after its parent did, so such a child reads through zarr-python
instead, with a warning. Handles stay behind when the engine is pickled.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from feedpipe.datasets._zarr_store import ZarrTree
from feedpipe.errors import DatasetError, require

__all__ = ["ZarrEngine"]

# pid of the process that started TensorStore's threads (see the module docstring)
_TS_STARTED_IN: int | None = None


class ZarrEngine:
    """Arrays ``names`` of ``tree`` read with ``backend`` (``"tensorstore"`` or ``"zarr"``)."""

    def __init__(self, tree: ZarrTree, names: list[str], backend: str) -> None:
        self.tree, self.names, self.backend = tree, names, backend
        self.backend_here = backend  # what this process reads with (see the module docstring)
        self._handles: dict[str, Any] | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": None, "_pid": -1}

    def handles(self) -> dict[str, Any]:
        """This process's open arrays by name."""
        if self._handles is not None and self._pid == os.getpid():
            return self._handles
        self.backend_here = self.backend
        if self.backend == "tensorstore" and _TS_STARTED_IN not in (None, os.getpid()):
            warnings.warn(
                f"{self.tree.where()}: this process was forked after TensorStore ran in its "
                "parent, which TensorStore does not allow; reading with zarr-python here instead "
                "(missing chunks are still errors; use the "
                "'forkserver' or 'spawn' start method, or thread workers, to keep TensorStore)",
                RuntimeWarning,
                stacklevel=4,
            )
            self.backend_here = "zarr"
        opened = self._tensorstore() if self.backend_here == "tensorstore" else self._zarr()
        self._handles, self._pid = opened, os.getpid()
        return opened

    def _tensorstore(self) -> dict[str, Any]:
        global _TS_STARTED_IN
        _TS_STARTED_IN = os.getpid()
        ts: Any = require("tensorstore", "zarr")
        handles: dict[str, Any] = {}
        for name in self.names:
            path = os.path.abspath(os.path.join(self.tree.path, name))
            spec = {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": path},
                "fill_missing_data_reads": False,  # a missing chunk is an error, not zeros
            }
            try:
                handles[name] = ts.open(spec, read=True).result()
            except Exception as exc:
                where = self.tree.where(name)
                raise DatasetError(f"{where}: TensorStore cannot open it: {exc}") from None
        return handles

    def _zarr(self) -> dict[str, Any]:
        zarr: Any = require("zarr", "zarr")
        from feedpipe.datasets._zarr_strict import strict_store

        tree, handles = self.tree, {}
        for name in self.names:
            where = tree.where(name)
            meta = tree.meta(name)
            try:
                if tree.remote:
                    store = zarr.storage.FsspecStore.from_url(
                        where, storage_options=tree.storage_options, read_only=True
                    )
                else:
                    store = zarr.storage.LocalStore(where, read_only=True)
            except Exception as exc:
                raise DatasetError(f"{where}: zarr cannot open it: {exc}") from None
            strict = strict_store(store, meta, where)  # missing chunks raise
            try:
                handles[name] = zarr.open_array(strict, mode="r")
            except Exception as exc:
                raise DatasetError(f"{where}: zarr cannot open it: {exc}") from None
        return handles

    def read(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Records ``idx`` of array ``name``, one batched read."""
        h = self.handles()[name]
        try:
            if self.backend_here == "tensorstore":
                return np.asarray(h[idx].read().result())
            return np.asarray(h.oindex[idx])
        except Exception as exc:
            rows = idx.tolist()
            shown = rows if len(rows) <= 8 else [*rows[:8], "..."]
            raise DatasetError(
                f"{self.tree.where(name)}: reading records {shown} failed: {exc}"
            ) from None

    def dtype(self, name: str) -> np.dtype[Any]:
        """Array ``name``'s numpy dtype as the backend reads it."""
        h = self.handles()[name]
        dtype: np.dtype[Any] = np.dtype(
            h.dtype.numpy_dtype if self.backend_here == "tensorstore" else h.dtype
        )
        return dtype
