"""Columnar sources for ``feedpipe convert``: Parquet files and Hugging Face datasets.

Both are read as Arrow tables, a row range at a time, and mapped column by column:

- the records column (``data_key``; else a column named ``"data"``; else the first column):
  a fixed-size numeric column or fixed-size list (nested lists too) becomes the fixed layout;
  ``string``/``binary`` columns become the bytes layout (strings as UTF-8 bytes);
- every other column becomes a side field: numeric scalars, or fixed-size numeric lists.

Anything else (variable-length lists, strings in side fields, structs, nulls) is refused up
front, naming the column and its Arrow type: the typed ``"str"``/variable-length columns are
not available to this conversion yet.

Parquet is read through ``pyarrow.parquet`` one row group at a time (one is cached per
process), so memory stays bounded by a row group whatever the file size. A Hugging Face
``datasets.Dataset`` (anything with ``.features`` and ``.with_format``) is sliced with
``with_format("arrow")``. ``pyarrow`` is the ``parquet`` extra; ``datasets`` the ``hf`` extra.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from feedpipe.errors import DatasetError, require

__all__ = ["HFSource", "ParquetSource", "is_hf_dataset", "parquet_paths"]

_SAMPLE_ROWS = 64  # rows read up front to estimate the output size


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``datasets.Dataset`` (duck-typed, ``datasets`` not needed)."""
    return hasattr(obj, "features") and callable(getattr(obj, "with_format", None))


def parquet_paths(source: str | Sequence[str]) -> list[str]:
    """The Parquet files of a file, a folder (its ``*.parquet``, sorted) or a glob."""
    items = [source] if isinstance(source, str) else list(source)
    paths: list[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "*.parquet")))
        elif any(c in item for c in "*?["):
            found = sorted(glob.glob(item))
        else:
            found = [item] if os.path.exists(item) else []
        if not found:
            raise DatasetError(f"{item}: no Parquet files there")
        paths += found
    return paths


def _pa() -> Any:
    return require("pyarrow", "parquet")


def _layout(name: str, typ: Any, records: bool) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, shape) of a column, or None for the bytes layout; refuses what cannot be stored."""
    pa = _pa()
    shape: list[int] = []
    inner = typ
    while pa.types.is_fixed_size_list(inner):
        shape.append(inner.list_size)
        inner = inner.value_type
    if pa.types.is_integer(inner) or pa.types.is_floating(inner) or pa.types.is_boolean(inner):
        return str(np.dtype(inner.to_pandas_dtype())), tuple(shape)
    textual = (
        pa.types.is_string(inner)
        or pa.types.is_large_string(inner)
        or pa.types.is_binary(inner)
        or pa.types.is_large_binary(inner)
    )
    if records and textual and not shape:
        return None
    what = "the records column" if records else "a side field"
    raise DatasetError(
        f"column {name!r} has Arrow type {typ}, which {what} cannot hold here (records: numbers, "
        "fixed-size lists, strings or binary; side fields: numbers or fixed-size lists)"
    )


def _column(name: str, col: Any, layout: tuple[str, tuple[int, ...]] | None, first: int) -> Any:
    """A table column as a numpy array ``(n, *shape)``, or a list of bytes."""
    pa = _pa()
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if arr.null_count:
        row = first + next(i for i, v in enumerate(arr.is_null().to_pylist()) if v)
        raise DatasetError(f"record {row}: column {name!r} is null")
    if layout is None:
        return [v.encode() if isinstance(v, str) else bytes(v) for v in arr.to_pylist()]
    dtype, shape = layout
    n = len(arr)
    while pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
        if arr.null_count:
            raise DatasetError(f"records {first}..{first + n - 1}: column {name!r} holds nulls")
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=dtype).reshape((n, *shape))


class _TableSource:
    """The ``convert`` source protocol over Arrow tables: ``kind``, ``shape``, ``dtype``,
    ``fields``, ``extra``, ``length``, ``est_bytes``, ``fingerprint()``, ``read(a, b)``."""

    kind = ""
    records = True  # a table always has a records column (the data key)
    shape: tuple[int, ...] | None = None
    dtype = "uint8"
    length = 0
    est_bytes = 0

    def _plan(self, schema: Any, data_key: str | None, sample: Any) -> None:
        names = list(schema.names)
        if not names:
            raise DatasetError("the table has no columns")
        key = data_key or ("data" if "data" in names else names[0])
        if key not in names:
            raise DatasetError(f"no column {key!r} (columns: {names})")
        self.key = key
        layout = _layout(key, schema.field(key).type, records=True)
        if layout is not None:
            self.dtype, self.shape = layout
        self.columns: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name in names:
            if name != key:
                spec = _layout(name, schema.field(name).type, records=False)
                assert spec is not None
                self.columns[name] = spec
        self.fields = dict(self.columns)
        records, _ = self._convert(sample, 0)
        rows = max(1, sample.num_rows)
        size = records.nbytes if isinstance(records, np.ndarray) else sum(map(len, records))
        self.est_bytes = max(1, size * self.length // rows)

    def _convert(self, table: Any, first: int) -> tuple[Any, dict[str, np.ndarray]]:
        layout = None if self.shape is None else (self.dtype, self.shape)
        records = _column(self.key, table.column(self.key), layout, first)
        fields = {n: _column(n, table.column(n), s, first) for n, s in self.columns.items()}
        return records, fields


class ParquetSource(_TableSource):
    """Parquet files read one row group at a time (see the module docstring)."""

    kind = "parquet"

    def __init__(self, paths: list[str], data_key: str | None) -> None:
        pq: Any = require("pyarrow.parquet", "parquet")
        self.paths = paths
        self.groups: list[tuple[int, int, int]] = []  # (file, row group, first row)
        schema = None
        row = 0
        for f, path in enumerate(paths):
            try:
                meta = pq.ParquetFile(path)
            except Exception as exc:
                raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
            if schema is None:
                schema = meta.schema_arrow
            elif not meta.schema_arrow.equals(schema):
                raise DatasetError(f"{path}: its columns differ from {paths[0]}'s")
            for g in range(meta.num_row_groups):
                self.groups.append((f, g, row))
                row += meta.metadata.row_group(g).num_rows
        self.length = row
        if row == 0:
            raise DatasetError(f"{', '.join(paths)}: no rows")
        self._cache: tuple[int, Any] | None = None
        self.extra = {"source": {"kind": "parquet", "paths": paths}}
        self._plan(schema, data_key, self._rows(0, min(row, _SAMPLE_ROWS)))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
        return state

    def _group(self, k: int) -> Any:
        if self._cache is None or self._cache[0] != k:
            pq: Any = require("pyarrow.parquet", "parquet")
            f, g, _ = self.groups[k]
            self._cache = None  # one row group in memory at a time
            self._cache = (k, pq.ParquetFile(self.paths[f]).read_row_group(g))
        return self._cache[1]

    def _rows(self, a: int, b: int) -> Any:
        pa = _pa()
        starts = [first for _, _, first in self.groups]
        k = max(0, int(np.searchsorted(starts, a, side="right")) - 1)
        pieces = []
        while a < b:
            first = starts[k]
            table = self._group(k)
            take = min(b, first + table.num_rows) - a
            if take > 0:
                pieces.append(table.slice(a - first, take))
                a += take
            k += 1
        return pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]

    def fingerprint(self) -> Any:
        sizes = [[p, os.path.getsize(p), os.path.getmtime(p)] for p in self.paths]
        return ["parquet", sizes, self.key]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        return self._convert(self._rows(a, b), a)


class HFSource(_TableSource):
    """A Hugging Face ``datasets.Dataset`` (duck-typed), sliced as Arrow tables."""

    kind = "hf"

    def __init__(self, dataset: Any, data_key: str | None) -> None:
        _pa()
        self.dataset = dataset.with_format("arrow")
        self.length = len(dataset)
        if self.length == 0:
            raise DatasetError(f"{type(dataset).__name__}: the dataset is empty")
        sample = self.dataset[0 : min(self.length, _SAMPLE_ROWS)]
        self.extra = {"source": {"kind": "hf", "type": type(dataset).__qualname__}}
        self._plan(sample.schema, data_key, sample)

    def fingerprint(self) -> Any:
        return ["hf", getattr(self.dataset, "_fingerprint", None), self.length, self.key]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        return self._convert(self.dataset[a:b], a)
