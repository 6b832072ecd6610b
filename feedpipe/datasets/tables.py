"""Columnar sources for ``feedpipe convert``: Parquet files and Hugging Face datasets.

Both are read as Arrow tables, a row range at a time, and every column is mapped to a typed
column of :mod:`feedpipe.datasets.columns` before anything is written (:func:`plan_column`):

==========================================  ===========================  ====================
Arrow type (Hugging Face feature)           side field                   records column
==========================================  ===========================  ====================
int8..int64, uint8..uint64, float16..64,    that dtype, shape ``()``     fixed layout
bool (``Value``, ``ClassLabel``)
fixed-size list, nested (``Sequence(...,    that dtype, fixed shape      fixed layout
length=k)``, ``Array2D``..``Array5D``)
list / large_list of numbers, or of fixed-  ragged ``(None, ...)``       ragged layout
size lists of numbers (``Sequence``/``List``)
string, large_string (``Value("string")``)  ``"str"``                    bytes layout (UTF-8)
binary, large_binary, fixed_size_binary     ragged ``uint8``             bytes layout
``Image`` / ``Audio`` (struct bytes, path)  ragged ``uint8``: the bytes  bytes layout
struct, map<string, ...>, lists of strings  ``"json"``                   refused
or of structs, nested lists
timestamp, date32/64, time32/64, duration   ``int64`` (the type's unit)  fixed layout
dictionary-encoded                          as its value type, decoded   as its value type
decimal, null, union, map with non-string   refused                      refused
keys, binary or temporal values in a struct
==========================================  ===========================  ====================

Temporal columns hold the integer Arrow stores: a timestamp counts its unit (``s``, ``ms``,
``us``, ``ns``) since the Unix epoch in UTC whatever its time zone, ``date32`` days and
``date64`` milliseconds since the epoch, ``time32``/``time64`` its unit since midnight, a
duration its unit. The Arrow type of every column is kept in the index, under
``extra["source"]["columns"]``; a Hugging Face ``ClassLabel``'s names under
``extra["class_labels"]`` (and ``extra["classes"]``, ``MemmapDataset.classes``, when there is
one). Hugging Face features come from the table's ``huggingface`` schema metadata, which both a
``datasets.Dataset`` and the Parquet files it writes carry.

Nulls are refused, naming the file, row and column (fill them first, for example with
``pyarrow.compute.fill_null``), except in ``"json"`` columns, where a null is stored as JSON
``null`` and reads back as ``None``. In Parquet, nulls in flat columns are found up front from
the footers' statistics; others when their rows are converted (no dataset appears). What cannot
be stored is refused up front, naming the column, its Arrow type and the file.

Parquet files are local paths or fsspec URLs, read through ``pyarrow.parquet`` one row group at a
time (one is cached per process), so memory stays bounded by a row group whatever the file size;
page checksums are verified where the writer stored them. A file that cannot be read is a
:class:`~feedpipe.DatasetError` naming it (and the row group), and so is a file that changed
since its footer was read (its stamp: size and ETag, or size, inode and mtime). A Hugging Face
``datasets.Dataset`` (anything with ``.features`` and ``.with_format``) is sliced with
``with_format("arrow")``; a streaming ``IterableDataset`` has no length and is refused, and
a ``DatasetDict`` is refused naming its splits.
``pyarrow`` is the ``parquet`` extra; ``datasets`` the ``hf`` extra.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from feedpipe.datasets.arrow_columns import (
    ArrowColumn,
    TablePlan,
    column_values,
    plan_column,
    require_pyarrow,
)
from feedpipe.datasets.record_source import Source
from feedpipe.errors import DatasetError, require
from feedpipe.io.remote import is_url, local_file_path, redact

__all__ = [
    "ArrowColumn",
    "HFSource",
    "ParquetSource",
    "column_values",
    "is_hf_dataset",
    "parquet_paths",
    "plan_column",
]

_SAMPLE_ROWS = 64  # rows read up front to estimate the output size


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``datasets.Dataset`` (duck-typed, ``datasets`` not needed),
    or a ``DatasetDict`` of them (refused by :class:`HFSource`, naming the splits)."""
    if isinstance(obj, Mapping) and obj and callable(getattr(obj, "with_format", None)):
        return all(is_hf_dataset(v) for v in obj.values())
    return hasattr(obj, "features") and callable(getattr(obj, "with_format", None))


def _pa() -> Any:
    return require_pyarrow()


def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    from feedpipe.remote.transfer import resolve

    return resolve(url, storage_options)


def parquet_paths(
    source: str | Sequence[str], storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """The Parquet files of a file, a folder (its ``*.parquet``, sorted) or a glob; each may
    be a local path or an fsspec URL (``s3://bucket/train/*.parquet``)."""
    items = [source] if isinstance(source, str) else list(source)
    paths: list[str] = []
    for item in items:
        item = local_file_path(item)  # file:///abs by the one rule; file://host is refused
        if is_url(item):
            fs, root = _fs(item, storage_options)
            if any(c in root for c in "*?["):
                found = sorted(fs.glob(root))
            elif fs.isdir(root):
                found = sorted(fs.glob(root.rstrip("/") + "/*.parquet"))
            else:
                found = [root] if fs.exists(root) else []
            found = [fs.unstrip_protocol(p) for p in found]
        elif os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "*.parquet")))
        elif any(c in item for c in "*?["):
            found = sorted(glob.glob(item))
        else:
            found = [item] if os.path.exists(item) else []
        if not found:
            raise DatasetError(f"{item}: no Parquet files there")
        paths += found
    return paths


def _nbytes(values: Any) -> int:
    if isinstance(values, np.ndarray):
        return values.nbytes
    total = 0
    for v in values:
        if isinstance(v, np.ndarray):
            total += v.nbytes
        elif isinstance(v, (bytes, str)):
            total += len(v)
        else:
            total += len(json.dumps(v, default=str))
    return total


# ---------------------------------------------------------------------- sources
class _TableSource(Source):
    """The ``convert`` source protocol over Arrow tables: ``kind``, ``shape``, ``dtype``,
    ``fields``, ``extra``, ``length``, ``est_bytes``, ``fingerprint()``, ``read(a, b)``."""

    kind = ""
    records = True  # a table always has a records column (the data key)
    shape: tuple[int | None, ...] | None = None
    dtype = "uint8"
    length = 0
    est_bytes = 0
    extra: dict[str, Any]

    def _plan(self, schema: Any, data_key: str | None, where: str) -> None:
        """Plan every column from ``schema`` (see :class:`TablePlan`)."""
        plan = TablePlan.of(schema, data_key, where)
        self.key, self.record_column, self.columns = plan.key, plan.record_column, plan.columns
        self.dtype, self.shape = plan.records_layout((self.dtype, self.shape))
        self.fields = plan.fields
        self.extra = plan.extra(self.kind)

    def _estimate(self, sample: Any, where: Callable[[int], str]) -> None:
        records, fields = self._convert(sample, where)
        size = _nbytes(records) + sum(_nbytes(v) for v in fields.values())
        self.est_bytes = max(1, size * self.length // max(1, sample.num_rows))

    def _convert(self, table: Any, where: Callable[[int], str]) -> tuple[Any, dict[str, Any]]:
        records = column_values(self.record_column, table.column(self.key), where)
        fields = {n: column_values(c, table.column(n), where) for n, c in self.columns.items()}
        return records, fields


def _concat(parts: list[tuple[Any, dict[str, Any]]]) -> tuple[Any, dict[str, Any]]:
    if len(parts) == 1:
        return parts[0]

    def join(values: list[Any]) -> Any:
        if isinstance(values[0], np.ndarray):
            return np.concatenate(values)
        return [v for vs in values for v in vs]

    records = join([r for r, _ in parts])
    return records, {k: join([f[k] for _, f in parts]) for k in parts[0][1]}


class ParquetSource(_TableSource):
    """Parquet files (local or URLs) read one row group at a time (see the module docstring)."""

    kind = "parquet"

    def __init__(
        self,
        paths: list[str],
        data_key: str | None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.paths = [local_file_path(p) for p in paths]
        paths = self.paths
        self.storage_options = dict(storage_options or {})
        self._stamps: dict[str, list[Any]] = {}  # path -> stamp when its footer was read
        self.groups: list[tuple[int, int, int, int]] = []  # (file, group, first record, row)
        schema, row = None, 0
        nulls: list[tuple[int, str]] = []  # (row group, flat column) whose footer counts nulls
        for f, path in enumerate(paths):
            meta = self._file(path)
            here = meta.schema_arrow
            if schema is None:
                schema = here
            elif not here.equals(schema):
                raise DatasetError(_schema_diff(paths[0], schema, path, here))
            in_file = 0
            for g in range(meta.num_row_groups):
                self.groups.append((f, g, row, in_file))
                group = meta.metadata.row_group(g)
                nulls += [(len(self.groups) - 1, n) for n in _null_columns(group, here.names)]
                row += group.num_rows
                in_file += group.num_rows
        self.length = row
        if row == 0:
            raise DatasetError(f"{', '.join(paths)}: no rows")
        self._cache: tuple[int, Any] | None = None
        self._plan(schema, data_key, paths[0])
        self.extra["source"]["paths"] = paths
        self._refuse_nulls(nulls)
        a, b = 0, min(row, _SAMPLE_ROWS)
        pieces = list(self._pieces(a, b))
        sample = _pa().concat_tables([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1]
        self._estimate(sample, self._where(pieces[0][0]))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
        return state

    def _file(self, path: str, group: int | None = None) -> Any:
        """The ``ParquetFile`` of ``path`` (footer read), or its row group ``group``. The file's
        stamp (size and ETag, or size, inode and mtime) is taken after each read: a file
        replaced or rewritten since its footer was read is an error naming it, never a mix."""
        pq: Any = require("pyarrow.parquet", "parquet")
        what = "not a readable Parquet file" if group is None else f"row group {group} unreadable"
        try:
            if is_url(path):
                fs, root = _fs(path, self.storage_options)
                with fs.open(root, "rb") as fh:
                    pf = pq.ParquetFile(fh, page_checksum_verification=True)
                    out = pf if group is None else pf.read_row_group(group)
                fs.invalidate_cache(root)
                info = fs.info(root)
                stamp = [info.get("size"), str(info.get("ETag") or info.get("LastModified"))]
            else:
                pf = pq.ParquetFile(path, page_checksum_verification=True)
                out = pf if group is None else pf.read_row_group(group)
                st = os.stat(path)
                stamp = [st.st_size, st.st_ino, st.st_mtime_ns]
        except DatasetError:
            raise
        except Exception as exc:  # pyarrow raises many types for a damaged file
            why = redact(str(exc), self.storage_options)
            raise DatasetError(f"{path}: {what}: {type(exc).__name__}: {why}") from None
        if self._stamps.setdefault(path, stamp) != stamp:
            raise DatasetError(
                f"{path}: the file changed while it was converted (its footer was read from "
                "another version): convert it again once it no longer changes"
            )
        return out

    def _group(self, k: int) -> Any:
        if self._cache is None or self._cache[0] != k:
            f, g, _, _ = self.groups[k]
            self._cache = None  # one row group in memory at a time
            table = self._file(self.paths[f], g)
            want = self.groups[k + 1][2] if k + 1 < len(self.groups) else self.length
            if table.num_rows != want - self.groups[k][2]:
                raise DatasetError(
                    f"{self.paths[f]}: row group {g} holds {table.num_rows} rows, its footer "
                    f"says {want - self.groups[k][2]}"
                )
            self._cache = (k, table)
        return self._cache[1]

    def _where(self, at: tuple[int, int, int]) -> Callable[[int], str]:
        """Names row ``j`` of a piece starting at (file, row in file, record)."""
        f, row, rec = at
        return lambda j: f"{self.paths[f]}: row {row + j} (record {rec + j})"

    def _pieces(self, a: int, b: int) -> Any:
        """``((file, row in file, record), table)`` pieces of records ``a..b-1``, each within
        one row group."""
        starts = [first for _, _, first, _ in self.groups]
        k = max(0, int(np.searchsorted(starts, a, side="right")) - 1)
        while a < b:
            f, _, first, in_file = self.groups[k]
            table = self._group(k)
            take = min(b, first + table.num_rows) - a
            if take > 0:
                yield (f, in_file + a - first, a), table.slice(a - first, take)
                a += take
            k += 1

    def _refuse_nulls(self, nulls: list[tuple[int, str]]) -> None:
        """Up front, from the footers' statistics: a null in a flat column that refuses nulls
        is named (file, row, column) before anything is written."""
        for k, name in nulls:
            col = self.record_column if name == self.key else self.columns[name]
            if col.kind != "json":
                f, _, first, in_file = self.groups[k]
                column_values(col, self._group(k).column(name), self._where((f, in_file, first)))

    def fingerprint(self) -> Any:
        sizes = []
        for p in self.paths:
            if is_url(p):
                fs, root = _fs(p, self.storage_options)
                info = fs.info(root)
                stamp = info.get("ETag") or info.get("LastModified") or info.get("mtime")
                sizes.append([p, info.get("size"), str(stamp)])
            else:
                sizes.append([p, os.path.getsize(p), os.path.getmtime(p)])
        return ["parquet", sizes, self.key]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, Any]]:
        return _concat([self._convert(t, self._where(at)) for at, t in self._pieces(a, b)])


def _null_columns(group: Any, names: list[str]) -> list[str]:
    """The top-level, non-nested columns whose chunk in row group ``group`` counts nulls."""
    found = []
    for i in range(group.num_columns):
        chunk = group.column(i)
        stats = chunk.statistics
        counted = stats is not None and stats.has_null_count and stats.null_count > 0
        if chunk.path_in_schema in names and counted:
            found.append(chunk.path_in_schema)
    return found


def _schema_diff(path_a: str, a: Any, path_b: str, b: Any) -> str:
    """Name both files and the first column in which their schemas differ."""
    for name in dict.fromkeys([*a.names, *b.names]):
        ta = a.field(name).type if name in a.names else None
        tb = b.field(name).type if name in b.names else None
        if ta is None or tb is None or not ta.equals(tb):
            return (
                f"{path_b}: its columns differ from {path_a}'s: column {name!r} is "
                f"{tb or 'missing'} there and {ta or 'missing'} in {path_a}"
            )
    return f"{path_b}: its columns differ from {path_a}'s (order: {b.names} vs {a.names})"


class HFSource(_TableSource):
    """A Hugging Face ``datasets.Dataset`` (duck-typed), sliced as Arrow tables."""

    kind = "hf"

    def __init__(self, dataset: Any, data_key: str | None) -> None:
        _pa()
        name = type(dataset).__name__
        if isinstance(dataset, Mapping):
            raise DatasetError(
                f"{name} of splits {list(dataset)}: convert one split at a time "
                f"(dataset[{next(iter(dataset))!r}])"
            )
        try:
            self.length = len(dataset)
        except TypeError:
            raise DatasetError(
                f"{name}: a streaming dataset has no length, so it cannot be split into parts; "
                "materialise it first (datasets.Dataset.from_generator, or load it without "
                "streaming=True)"
            ) from None
        if self.length == 0:
            raise DatasetError(f"{name}: the dataset is empty")
        self.dataset = dataset.with_format("arrow")
        self.name = name
        sample = self.dataset[0 : min(self.length, _SAMPLE_ROWS)]
        self._plan(sample.schema, data_key, name)
        self.extra["source"]["type"] = type(dataset).__qualname__
        self._estimate(sample, self._where(0))

    def _where(self, first: int) -> Callable[[int], str]:
        return lambda j: f"{self.name}: record {first + j}"

    def fingerprint(self) -> Any:
        # third-party private: datasets.Dataset has no public fingerprint of its content
        return ["hf", getattr(self.dataset, "_fingerprint", None), self.length, self.key]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, Any]]:
        return self._convert(self.dataset[a:b], self._where(a))
