"""``ZarrDataset``: a map-style torch dataset over a Zarr v3 array (or a group of aligned arrays).

The first axis is the sample axis. Reads go through TensorStore by default (GIL released, one
batched read per array, missing chunks are an error rather than silent fill values) or through
zarr-python with ``backend="zarr"``. Any codec zarr supports works, including the v3 sharding
codec with zstd. Remote fsspec URLs (``s3://``...) are read with zarr-python's fsspec store.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.errors import DatasetError, require

__all__ = ["ZarrDataset"]

_BACKENDS = ("tensorstore", "zarr")
# pid of the process that started TensorStore's threads. TensorStore aborts a forked child that
# uses it after its parent did, so such a child reads through zarr-python instead.
_TS_STARTED_IN: int | None = None


def _is_remote(path: str) -> bool:
    return "://" in path and path.split("://", 1)[0].lower() not in {"file", "local"}


class ZarrDataset(torch.utils.data.Dataset[Any]):
    """Samples along the first axis of a Zarr v3 array, or of aligned arrays in a group.

    For a group, ``arrays`` picks the member arrays (default: every array member) and samples are
    dicts ``{name: tensor}``; for a single array, samples are tensors.
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        arrays: Sequence[str] | None = None,
        backend: str = "tensorstore",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.path = os.fspath(path_or_url).rstrip("/")
        if self.path.startswith("file://"):
            self.path = self.path[len("file://") :]
        self.storage_options = dict(storage_options or {})
        self.remote = _is_remote(self.path)
        # TensorStore is given local paths; remote URLs use zarr-python over fsspec
        self.backend = "zarr" if self.remote else backend
        node = self._read_meta("")
        if node.get("node_type") == "array":
            if arrays:
                raise DatasetError(f"{self.path}: is a single array; 'arrays' needs a group")
            self.names: list[str] = [""]
            self.is_group = False
        elif node.get("node_type") == "group":
            self.names = list(arrays) if arrays else self._members()
            if not self.names:
                raise DatasetError(f"{self.path}: Zarr group has no arrays")
            self.is_group = True
        else:
            raise DatasetError(
                f"{self.path}: zarr.json has unknown node_type {node.get('node_type')!r}"
            )
        metas = {n: self._read_meta(n) for n in self.names}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, np.dtype] = {}
        for name, meta in metas.items():
            where = self._where(name)
            if meta.get("node_type") != "array":
                raise DatasetError(f"{where}: not a Zarr array")
            shape = tuple(int(d) for d in meta["shape"])
            if not shape:
                raise DatasetError(f"{where}: a 0-d array has no sample axis")
            self.shapes[name] = shape
            try:
                self._dtypes[name] = np.dtype(meta["data_type"])
            except (TypeError, KeyError):
                pass  # unusual data types: ask the backend
        lengths = {n: s[0] for n, s in self.shapes.items()}
        self._len = next(iter(lengths.values()))
        if len(set(lengths.values())) != 1:
            raise DatasetError(
                f"{self.path}: arrays are not aligned on the sample axis (lengths {lengths})"
            )
        self._handles: dict[str, Any] | None = None
        self._pid = -1
        self._proc_backend = self.backend

    # ------------------------------------------------------------------ metadata
    def _where(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path

    def _fs(self) -> tuple[Any, str]:
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        return fs, root.rstrip("/")

    def _read_meta(self, name: str) -> dict[str, Any]:
        where = self._where(name)
        try:
            if self.remote:
                fs, root = self._fs()
                raw = fs.cat_file(f"{root}/{name}/zarr.json" if name else f"{root}/zarr.json")
            else:
                with open(os.path.join(self.path, name, "zarr.json"), "rb") as f:
                    raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            hint = (
                " (a Zarr v2 array?)"
                if not self.remote and os.path.exists(os.path.join(self.path, name, ".zarray"))
                else ""
            )
            raise DatasetError(
                f"{where}: not a Zarr v3 array or group (no zarr.json){hint}"
            ) from None
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise DatasetError(f"{where}/zarr.json: not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
            raise DatasetError(f"{where}: not Zarr format 3")
        return doc

    def _members(self) -> list[str]:
        if self.remote:
            fs, root = self._fs()
            entries = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        else:
            entries = sorted(os.listdir(self.path))
        names = []
        for entry in sorted(entries):
            if entry == "zarr.json":
                continue
            try:
                if self._read_meta(entry).get("node_type") == "array":
                    names.append(entry)
            except DatasetError:
                continue
        return names

    # ------------------------------------------------------------------ handles
    def _open(self) -> dict[str, Any]:
        if self._handles is not None and self._pid == os.getpid():
            return self._handles
        global _TS_STARTED_IN
        handles: dict[str, Any] = {}
        self._proc_backend = self.backend
        if self.backend == "tensorstore" and _TS_STARTED_IN not in (None, os.getpid()):
            warnings.warn(
                f"{self.path}: this process was forked after TensorStore ran in its parent, which "
                "TensorStore does not allow; reading with zarr-python here instead (use the "
                "'forkserver' or 'spawn' start method, or thread workers, to keep TensorStore)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._proc_backend = "zarr"
        if self._proc_backend == "tensorstore":
            _TS_STARTED_IN = os.getpid()
            ts: Any = require("tensorstore", "zarr")
            for name in self.names:
                path = os.path.abspath(os.path.join(self.path, name))
                spec = {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": path},
                    "fill_missing_data_reads": False,  # a missing chunk is an error, not zeros
                }
                try:
                    handles[name] = ts.open(spec, read=True).result()
                except Exception as exc:
                    raise DatasetError(
                        f"{self._where(name)}: TensorStore cannot open it: {exc}"
                    ) from None
        else:
            zarr: Any = require("zarr", "zarr")
            for name in self.names:
                where = self._where(name)
                try:
                    if self.remote:
                        store = zarr.storage.FsspecStore.from_url(
                            where, storage_options=self.storage_options, read_only=True
                        )
                        handles[name] = zarr.open_array(store, mode="r")
                    else:
                        handles[name] = zarr.open_array(where, mode="r")
                except Exception as exc:
                    raise DatasetError(f"{where}: zarr cannot open it: {exc}") from None
        self._handles, self._pid = handles, os.getpid()
        return handles

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return self._len

    def _normalize(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices.tolist() if isinstance(indices, torch.Tensor) else indices)
        if idx.size == 0:
            return np.empty(0, np.int64)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise TypeError(f"indices must be a 1-D sequence of integers, got {idx.dtype}")
        idx = idx.astype(np.int64)
        bad = (idx < -self._len) | (idx >= self._len)
        if bad.any():
            first = int(idx[np.argmax(bad)])
            raise IndexError(f"index {first} is out of range for {self.path} (length {self._len})")
        return np.where(idx < 0, idx + self._len, idx)

    def _read(self, name: str, idx: np.ndarray) -> np.ndarray:
        h = self._open()[name]
        try:
            if self._proc_backend == "tensorstore":
                return np.asarray(h[idx].read().result())
            return np.asarray(h.oindex[idx])
        except Exception as exc:
            rows = idx.tolist()
            shown = rows if len(rows) <= 8 else [*rows[:8], "..."]
            raise DatasetError(
                f"{self._where(name)}: reading records {shown} failed: {exc}"
            ) from None

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
            shape = (len(idx), *self.shapes[name][1:])
            arr = self._read(name, idx) if len(idx) else None
            target = out.get(name) if isinstance(out, dict) else out
            if target is None:
                t = torch.from_numpy(arr) if arr is not None else None
                if t is None:
                    t = torch.from_numpy(np.empty(shape, self.dtype_of(name)))
            else:
                if (
                    not isinstance(target, torch.Tensor)
                    or tuple(target.shape[1:]) != shape[1:]
                    or target.shape[0] < shape[0]
                ):
                    raise ValueError(f"out[{name!r}] must be a tensor with room for {shape}")
                t = target[: shape[0]]
                if arr is not None:
                    t.copy_(torch.from_numpy(arr))
            result[name] = t
        return result if self.is_group else result[""]

    def dtype_of(self, name: str = "") -> np.dtype:
        """The numpy dtype of array ``name`` (``""`` for a single array)."""
        if name in self._dtypes:
            return self._dtypes[name]
        h = self._open()[name]
        return np.dtype(h.dtype.numpy_dtype if self._proc_backend == "tensorstore" else h.dtype)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = None
        state["_pid"] = -1
        return state

    def __repr__(self) -> str:
        arrays = {n or "<root>": s for n, s in self.shapes.items()}
        return (
            f"ZarrDataset({self.path!r}, {self._len} samples, {arrays}, backend={self.backend!r})"
        )
