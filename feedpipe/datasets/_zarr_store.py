"""What a Zarr v3 store holds, read from its ``zarr.json`` files: :class:`ZarrTree`.

A tree is a local folder or an fsspec URL; :meth:`ZarrTree.meta` reads and checks one node's
``zarr.json``, :meth:`ZarrTree.arrays` picks the arrays a dataset reads (the root array, or
members of a group), and :func:`array_meta` turns an array's ``zarr.json`` into its shape and
numpy dtype, refusing anything that cannot be read as a tensor. Every error is a
:class:`~feedpipe.errors.DatasetError` naming the node (its URL without secrets).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from feedpipe.errors import DatasetError
from feedpipe.format import check_dtype, check_shape
from feedpipe.io.remote import is_remote, local_file_path, redact

__all__ = ["ZarrTree", "array_meta"]


class ZarrTree:
    """The Zarr v3 store at ``path_or_url`` (see the module docstring); plain and picklable."""

    def __init__(
        self, path_or_url: str | os.PathLike[str], storage_options: dict[str, Any] | None
    ) -> None:
        self.path = local_file_path(os.fspath(path_or_url).rstrip("/"))
        self.storage_options = dict(storage_options or {})
        self.remote = is_remote(self.path)

    def where(self, name: str = "") -> str:
        """How messages name array ``name`` (``""``: the root), without secrets."""
        shown = redact(self.path, self.storage_options)
        return f"{shown}/{name}" if name else shown

    def fs(self) -> tuple[Any, str]:
        """The fsspec filesystem of a remote tree and the root's path on it."""
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        return fs, root.rstrip("/")

    def meta(self, name: str) -> dict[str, Any]:
        """Node ``name``'s ``zarr.json``, checked to be Zarr format 3."""
        where = self.where(name)
        try:
            raw = self._read(name)
        except (FileNotFoundError, NotADirectoryError):
            local = os.path.join(self.path, name, ".zarray")
            hint = " (a Zarr v2 array?)" if not self.remote and os.path.exists(local) else ""
            raise DatasetError(
                f"{where}: not a Zarr v3 array or group (no zarr.json){hint}"
            ) from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise DatasetError(f"{where}/zarr.json: not valid JSON: {why}") from None
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
            raise DatasetError(f"{where}/zarr.json: not Zarr format 3")
        return doc

    def _read(self, name: str) -> bytes:
        if self.remote:
            fs, root = self.fs()
            raw: bytes = fs.cat_file(f"{root}/{name}/zarr.json" if name else f"{root}/zarr.json")
            return raw
        with open(os.path.join(self.path, name, "zarr.json"), "rb") as f:
            return f.read()

    def arrays(self, names: Sequence[str] | None) -> tuple[list[str], bool]:
        """The arrays to read and whether the root is a group: the root array (``[""]``), or
        ``names`` of a group (default: every array member)."""
        node = self.meta("").get("node_type")
        if node == "array":
            if names:
                raise DatasetError(f"{self.path}: is a single array; 'arrays' needs a group")
            return [""], False
        if node != "group":
            raise DatasetError(f"{self.path}: zarr.json has unknown node_type {node!r}")
        picked = list(names) if names else self.members()
        if not picked:
            raise DatasetError(f"{self.path}: Zarr group has no arrays")
        return picked, True

    def members(self) -> list[str]:
        """The array members of the root group, sorted."""
        if self.remote:
            fs, root = self.fs()
            entries = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        else:
            entries = os.listdir(self.path)
        names = []
        for entry in sorted(entries):
            if entry == "zarr.json":
                continue
            try:
                if self.meta(entry).get("node_type") == "array":
                    names.append(entry)
            except DatasetError:
                continue
        return names


def array_meta(meta: dict[str, Any], source: str) -> tuple[tuple[int, ...], np.dtype[Any] | None]:
    """An array's shape and numpy dtype (None: a type only the backend knows) from its
    ``zarr.json``; anything malformed or unreadable as a tensor is a :class:`DatasetError`."""
    if meta.get("node_type") != "array":
        raise DatasetError(f"{source}: not a Zarr array (node_type {meta.get('node_type')!r})")
    try:
        if "shape" not in meta or "data_type" not in meta:
            raise ValueError("an array needs 'shape' and 'data_type'")
        dtype = _dtype(meta["data_type"])
        shape = check_shape(meta["shape"], dtype.itemsize if dtype is not None else 1, "array")
        _check_chunk_shapes(meta, len(shape))
    except (ValueError, TypeError, OverflowError, KeyError, AttributeError) as exc:
        raise DatasetError(f"{source}: malformed Zarr metadata: {exc}") from None
    if not shape:
        raise DatasetError(f"{source}: a 0-d array has no sample axis")
    return shape, dtype


def _dtype(name: Any) -> np.dtype[Any] | None:
    """A ``data_type``'s numpy dtype, checked; None for a type only the backend knows (a Zarr
    type name numpy does not know, a v3 extension type object)."""
    if isinstance(name, dict):  # v3 extension types are objects
        return None
    if not isinstance(name, str):
        raise ValueError(f"data_type must be a string or an object, got {name!r}")
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None
    check_dtype(dtype, "data_type")
    return dtype


def _check_chunk_shapes(meta: dict[str, Any], ndim: int) -> None:
    """The chunk grid's and a sharding codec's ``chunk_shape``: ``ndim`` positive integers."""
    grid = meta.get("chunk_grid")
    shapes = []
    if isinstance(grid, dict) and isinstance(grid.get("configuration"), dict):
        shapes.append(("chunk_grid", grid["configuration"].get("chunk_shape")))
    for codec in meta.get("codecs") or []:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            conf = codec.get("configuration")
            if not isinstance(conf, dict):
                raise ValueError("sharding_indexed needs a configuration object")
            shapes.append(("sharding_indexed", conf.get("chunk_shape")))
    for where, chunk in shapes:
        if (
            not isinstance(chunk, list)
            or len(chunk) != ndim
            or any(type(c) is not int or c < 1 for c in chunk)
        ):
            raise ValueError(f"{where} chunk_shape must be {ndim} positive integers, got {chunk!r}")
