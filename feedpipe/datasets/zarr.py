"""``ZarrDataset``: a map-style torch dataset over a Zarr v3 array (or a group of aligned arrays).

The first axis is the sample axis. Reads go through TensorStore by default (GIL released, one
batched read per array) or through zarr-python with ``backend="zarr"``. On every path a missing
chunk is a :class:`DatasetError`, never fill values (zarr-python through
:mod:`feedpipe.datasets._zarr_strict`). Any codec zarr supports works, including the v3 sharding
codec with zstd. Remote fsspec URLs (``s3://``...) are read with zarr-python's fsspec store.

The dataset owns three objects: the store's metadata (:class:`~._zarr_store.ZarrTree`), the
engine that reads arrays in this process (:class:`~._zarr_engine.ZarrEngine`) and, for
uncompressed local arrays whose chunks hold whole records, a byte-range reader per array
(:class:`~._zarr_preadv.PreadvReader`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._gather import indices_array
from feedpipe.datasets._zarr_engine import ZarrEngine
from feedpipe.datasets._zarr_preadv import PreadvReader
from feedpipe.datasets._zarr_store import ZarrTree, array_meta
from feedpipe.errors import DatasetError

__all__ = ["ZarrDataset"]

_BACKENDS = ("tensorstore", "zarr")


def _preadv_flag(preadv: bool, direct: bool | None) -> bool:
    """``preadv=``, or the deprecated ``direct=`` it replaces (with a warning)."""
    if direct is None:
        return preadv
    if preadv is not True:
        raise TypeError("ZarrDataset: pass preadv= only (direct= is its deprecated name)")
    warnings.warn(
        "ZarrDataset(direct=) is deprecated; use ZarrDataset(preadv=)",
        DeprecationWarning,
        stacklevel=3,
    )
    return direct


class ZarrDataset(torch.utils.data.Dataset[Any]):
    """Samples along the first axis of a Zarr v3 array, or of aligned arrays in a group.

    For a group, ``arrays`` picks the member arrays (default: every array member) and samples are
    dicts ``{name: tensor}``; for a single array, samples are tensors. ``preadv`` (default True)
    reads uncompressed local arrays whose chunks hold whole records with ``os.preadv`` at
    addresses from the shard index, instead of through the engine (see
    :class:`~._zarr_preadv.PreadvReader`).
    ``direct`` is the deprecated name of ``preadv`` (it warns; "direct" now names only the GPU
    feed's direct path, see the glossary).
    """

    #: ``read_batch`` takes numpy index arrays (:class:`feedpipe.protocols.IndexArrayDataset`).
    takes_index_arrays = True

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        arrays: Sequence[str] | None = None,
        backend: str = "tensorstore",
        storage_options: dict[str, Any] | None = None,
        preadv: bool = True,
        direct: bool | None = None,
    ) -> None:
        preadv = _preadv_flag(preadv, direct)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        tree = self._tree = ZarrTree(path_or_url, storage_options)
        self.path, self.storage_options, self.remote = tree.path, tree.storage_options, tree.remote
        # TensorStore is given local paths; remote URLs use zarr-python over fsspec
        self.backend = "zarr" if self.remote else backend
        self.names, self.is_group = tree.arrays(arrays)
        metas = {n: tree.meta(n) for n in self.names}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, np.dtype[Any]] = {}
        for name, meta in metas.items():
            shape, dtype = array_meta(meta, f"{tree.where(name)}/zarr.json")
            self.shapes[name] = shape
            if dtype is not None:
                self._dtypes[name] = dtype
        self._preadv: dict[str, PreadvReader] = {}
        if preadv and not self.remote:
            for name, meta in metas.items():
                plan = PreadvReader.plan(os.path.join(self.path, name), meta, self.shapes[name])
                if plan is not None:
                    self._preadv[name] = plan
        lengths = {n: s[0] for n, s in self.shapes.items()}
        self._len = next(iter(lengths.values()))
        if len(set(lengths.values())) != 1:
            raise DatasetError(
                f"{self.path}: arrays are not aligned on the sample axis (lengths {lengths})"
            )
        self._engine = ZarrEngine(tree, self.names, self.backend)

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return self._len

    def _normalize(self, indices: Any) -> np.ndarray:
        n, shown = self._len, self._tree.where()
        return indices_array(
            indices, n, lambda i: f"index {i} is out of range for {shown} (length {n})"
        )

    def _read(self, name: str, idx: np.ndarray) -> np.ndarray:
        reader = self._preadv.get(name)
        if reader is None:
            return self._engine.read(name, idx)
        out = np.empty((len(idx), *self.shapes[name][1:]), reader.dtype)
        reader.read(idx, out.reshape(len(idx), -1).view(np.uint8), self._tree.where(name))
        return out

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, torch.Tensor) and index.ndim == 0:
            index = int(index)
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        batch = self.read_batch([int(index)])
        if not self.is_group:
            return batch[0].clone()
        return {k: v[0].clone() for k, v in batch.items()}

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """torch's per-batch hook: one batched read per array, split into per-sample views."""
        batch = self.read_batch(indices)
        if not self.is_group:
            return list(batch)
        return [{k: v[j] for k, v in batch.items()} for j in range(len(indices))]

    def read_batch(
        self, indices: Sequence[int] | np.ndarray | torch.Tensor, out: Any = None
    ) -> Any:
        """Return what ``default_collate([ds[i] for i in indices])`` returns: one read per array.

        ``out`` (optional) is a tensor (single array) or dict of tensors (group) with room for the
        batch; the batch is copied into it and views of it are returned.
        """
        idx = self._normalize(indices)
        result: dict[str, torch.Tensor] = {}
        for name in self.names:
            arr = self._read(name, idx) if len(idx) else None
            target = out.get(name) if isinstance(out, dict) else out
            if target is None:
                empty = (0, *self.shapes[name][1:])
                result[name] = torch.from_numpy(
                    arr if arr is not None else np.empty(empty, self.dtype_of(name))
                )
                continue
            view = self._out_rows(name, target, len(idx))
            if arr is not None:
                view.copy_(torch.from_numpy(arr))
            result[name] = view
        return result if self.is_group else result[""]

    def _out_rows(self, name: str, target: Any, n: int) -> torch.Tensor:
        """The first ``n`` rows of ``out[name]``, checked to hold array ``name``'s records."""
        shape = (n, *self.shapes[name][1:])
        want = torch.from_numpy(np.empty(0, self.dtype_of(name))).dtype
        if (
            not isinstance(target, torch.Tensor)
            or target.dtype != want  # copy_ would cast silently
            or tuple(target.shape[1:]) != shape[1:]
            or target.shape[0] < shape[0]
        ):
            raise ValueError(f"out[{name!r}] must be a {want} tensor with room for {shape}")
        return target[:n]

    def dtype_of(self, name: str = "") -> np.dtype[Any]:
        """The numpy dtype of array ``name`` (``""`` for a single array)."""
        if name in self._dtypes:
            return self._dtypes[name]
        return self._engine.dtype(name)

    def __repr__(self) -> str:
        arrays = {n or "<root>": s for n, s in self.shapes.items()}
        return (
            f"ZarrDataset({self._tree.where()!r}, {self._len} samples, {arrays}, "
            f"backend={self.backend!r})"
        )
