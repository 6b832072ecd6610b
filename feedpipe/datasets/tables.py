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
from dataclasses import dataclass
from typing import Any

import numpy as np

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
_BYTES_FEATURES = ("Image", "Audio")  # Hugging Face structs {bytes, path}: stored as the bytes


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``datasets.Dataset`` (duck-typed, ``datasets`` not needed),
    or a ``DatasetDict`` of them (refused by :class:`HFSource`, naming the splits)."""
    if isinstance(obj, Mapping) and obj and callable(getattr(obj, "with_format", None)):
        return all(is_hf_dataset(v) for v in obj.values())
    return hasattr(obj, "features") and callable(getattr(obj, "with_format", None))


def _pa() -> Any:
    return require("pyarrow", "parquet")


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


# ---------------------------------------------------------------------- column types
@dataclass(frozen=True)
class ArrowColumn:
    """How one Arrow column is stored: ``kind`` is ``fixed``, ``ragged`` (first dimension
    varies; ``shape`` holds the others), ``bytes`` (records only), ``str`` or ``json``."""

    name: str
    arrow: str  # the Arrow type as read, kept in the index
    kind: str
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    member: str = ""  # a struct's child holding the value (``bytes`` of an HF Image)

    @property
    def spec(self) -> Any:
        """The ``MemmapWriter`` field spec (side fields)."""
        if self.kind in ("str", "json"):
            return self.kind
        if self.kind == "ragged":
            return (self.dtype, (None, *self.shape))
        return (self.dtype, self.shape)


def _numeric(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _temporal(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_temporal(t)) and not pa.types.is_interval(t)


def _string(pa: Any, t: Any) -> bool:
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or view(t))


def _binary(pa: Any, t: Any) -> bool:
    view = getattr(pa.types, "is_binary_view", lambda _: False)
    return bool(
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or view(t)
    )


def _list(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _fixed_lists(pa: Any, t: Any) -> tuple[Any, tuple[int, ...]]:
    """The element type under nested fixed-size lists, and their sizes."""
    shape: list[int] = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    return t, tuple(shape)


def _dtype(t: Any) -> str:
    return str(np.dtype(t.to_pandas_dtype()))


def _jsonable(pa: Any, t: Any) -> bool:
    """Whether every value of Arrow type ``t`` reads back equal as JSON."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_null(t) or _numeric(pa, t) or _string(pa, t):
        return True
    if _list(pa, t) or pa.types.is_fixed_size_list(t):
        return _jsonable(pa, t.value_type)
    if pa.types.is_struct(t):
        return all(_jsonable(pa, t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _string(pa, t.key_type) and _jsonable(pa, t.item_type)
    return False


def _bytes_struct(pa: Any, t: Any) -> bool:
    """Whether ``t`` is a struct with a binary ``bytes`` child (an HF ``Image``/``Audio``)."""
    return bool(pa.types.is_struct(t)) and (
        t.get_field_index("bytes") >= 0 and _binary(pa, t.field("bytes").type)
    )


def _array_feature(pa: Any, t: Any, feature: dict[str, Any]) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, shape) of a Hugging Face ``Array2D``..``Array5D`` column stored as nested lists
    (an extension type in memory, plain lists in its Parquet files), or None when the Arrow
    type does not match the feature's fixed shape. Each list's length is checked on reading."""
    shape = feature.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape
    ):
        return None
    depth = 0
    while _list(pa, t) or pa.types.is_fixed_size_list(t):
        t, depth = t.value_type, depth + 1
    if depth != len(shape) or not _numeric(pa, t):
        return None
    return _dtype(t), tuple(shape)


def plan_column(name: str, typ: Any, feature: Any, *, records: bool) -> ArrowColumn:
    """How column ``name`` of Arrow type ``typ`` (Hugging Face ``feature``: its ``to_dict()``
    form, or None) is stored (see the module docstring); ``ValueError`` for what cannot be."""
    pa = _pa()
    arrow = str(typ)
    hf = feature.get("_type", "") if isinstance(feature, dict) else ""
    hf = hf if isinstance(hf, str) else ""  # valid JSON that lies: not a feature
    t = typ.value_type if pa.types.is_dictionary(typ) else typ
    if hf in _BYTES_FEATURES and _bytes_struct(pa, t):
        return ArrowColumn(name, arrow, "bytes" if records else "ragged", member="bytes")
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if hf.startswith("Array"):
        fixed = _array_feature(pa, t, feature)
        if fixed is not None:
            return ArrowColumn(name, arrow, "fixed", *fixed)
    inner, shape = _fixed_lists(pa, t)
    if _numeric(pa, inner):
        return ArrowColumn(name, arrow, "fixed", _dtype(inner), shape)
    if _temporal(pa, t):
        return ArrowColumn(name, arrow, "fixed", "int64")
    if _string(pa, t):
        return ArrowColumn(name, arrow, "bytes" if records else "str")
    if _binary(pa, t):
        return ArrowColumn(name, arrow, "bytes" if records else "ragged")
    if _list(pa, t):
        inner, shape = _fixed_lists(pa, t.value_type)
        if _numeric(pa, inner):
            return ArrowColumn(name, arrow, "ragged", _dtype(inner), shape)
    if _jsonable(pa, t) and not (_numeric(pa, t) or _string(pa, t) or pa.types.is_null(t)):
        if records:
            raise ValueError(
                "the records column holds numbers, arrays, strings or bytes; this column can "
                "be a JSON side field: choose another records column with data_key/--data-key"
            )
        return ArrowColumn(name, arrow, "json")
    hint = " (cast it to float64 or string first)" if pa.types.is_decimal(t) else ""
    raise ValueError(f"no feedpipe column type holds Arrow {arrow}{hint}")


# ---------------------------------------------------------------------- column values
def _first_null(arr: Any) -> int:
    return int(np.argmax(np.asarray(arr.is_null().to_numpy(zero_copy_only=False))))


def _no_nulls(col: ArrowColumn, arr: Any, where: Callable[[int], str], what: str = "") -> None:
    if arr.null_count:
        raise DatasetError(
            f"{where(_first_null(arr))}: column {col.name!r} ({col.arrow}) is null{what}; nulls "
            "are refused except in JSON columns (fill them first, e.g. pyarrow.compute.fill_null)"
        )


def _inner_nulls(col: ArrowColumn, values: Any, owner: Callable[[int], int], where: Any) -> None:
    """Refuse a null element inside a list value, naming the row (``owner`` maps an element
    position to its row)."""
    if values.null_count:
        raise DatasetError(
            f"{where(owner(_first_null(values)))}: column {col.name!r} ({col.arrow}) holds a "
            "null element; nulls are refused except in JSON columns"
        )


def _row_of(per: int) -> Callable[[int], int]:
    """The row of an element of a flattened fixed-size list of ``per`` elements a row."""
    return lambda i: i // per


def _fixed_values(pa: Any, col: ArrowColumn, arr: Any, where: Callable[[int], str]) -> np.ndarray:
    n = len(arr)
    if _temporal(pa, arr.type):
        if pa.types.is_date32(arr.type) or pa.types.is_time32(arr.type):
            arr = arr.cast(pa.int32())
        return np.asarray(arr.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    per = 1
    for size in col.shape:  # fixed-size or (HF ArrayND) variable lists of the expected sizes
        if _list(pa, arr.type):
            lengths = np.diff(np.asarray(arr.offsets.to_numpy(zero_copy_only=False)))
            bad = np.flatnonzero(lengths != size)
            if len(bad):
                row = int(bad[0]) // per
                raise DatasetError(
                    f"{where(row)}: column {col.name!r} holds a list of {int(lengths[bad[0]])} "
                    f"where its shape {col.shape} needs {size}"
                )
        per *= size
        arr = arr.flatten()
        _inner_nulls(col, arr, _row_of(per), where)
    values = arr.to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=col.dtype).reshape((n, *col.shape))


def _ragged_values(pa: Any, col: ArrowColumn, arr: Any, where: Callable[[int], str]) -> list[Any]:
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type) or col.member:
        return [bytes(v) for v in arr.to_pylist()]
    if not _list(pa, arr.type):  # fixed-size or view binary
        return [bytes(v) for v in arr.to_pylist()]
    off = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    starts = off - off[0]

    def owner(per: int) -> Callable[[int], int]:
        return lambda i: int(np.searchsorted(starts, i // per, "right")) - 1

    flat = arr.flatten()
    _inner_nulls(col, flat, owner(1), where)
    per = 1
    for size in col.shape:
        per *= size
        flat = flat.flatten()
        _inner_nulls(col, flat, owner(per), where)
    values = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=col.dtype)
    values = values.reshape((-1, *col.shape))
    return np.split(values, (off[1:-1] - off[0]).tolist())


def column_values(col: ArrowColumn, data: Any, where: Callable[[int], str]) -> Any:
    """A table column as the writer takes it: an ``(n, *shape)`` array (``fixed``), a list of
    arrays or bytes (``ragged``/``bytes``), of ``str`` or of JSON values. ``where(j)`` names
    row ``j`` (file and row) in an error."""
    pa = _pa()
    if pa.types.is_dictionary(data.type):
        data = data.cast(data.type.value_type)  # decoded, whatever each chunk's dictionary
    arr = data.combine_chunks() if hasattr(data, "combine_chunks") else data
    if col.kind == "json":
        try:
            return arr.to_pylist(maps_as_pydicts="strict")
        except (pa.ArrowException, KeyError, ValueError) as exc:
            raise DatasetError(
                f"{where(0)}..: column {col.name!r} ({col.arrow}): not JSON: {exc}"
            ) from None
    _no_nulls(col, arr, where)
    if col.member:
        arr = arr.field(col.member)
        _no_nulls(col, arr, where, f" (its {col.member!r}: stored by path only?)")
    if col.kind == "fixed":
        return _fixed_values(pa, col, arr, where)
    if col.kind == "ragged":
        return _ragged_values(pa, col, arr, where)
    if col.kind == "str":
        return arr.cast(pa.large_string()).to_pylist()
    return [v.encode() if isinstance(v, str) else bytes(v) for v in arr.to_pylist()]


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


def _features(schema: Any) -> dict[str, Any]:
    """The Hugging Face features of a table, from its ``huggingface`` schema metadata."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return features if isinstance(features, dict) else {}


# ---------------------------------------------------------------------- sources
class _TableSource:
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
        names = list(schema.names)
        if not names:
            raise DatasetError(f"{where}: the table has no columns")
        if len(set(names)) != len(names):
            raise DatasetError(f"{where}: duplicate column names {names}")
        key = data_key or ("data" if "data" in names else names[0])
        if key not in names:
            raise DatasetError(f"{where}: no column {key!r} (columns: {names})")
        features = _features(schema)
        self.columns: dict[str, ArrowColumn] = {}
        for name in names:
            typ = schema.field(name).type
            try:
                col = plan_column(name, typ, features.get(name), records=name == key)
            except ValueError as exc:
                role = "the records column" if name == key else "column"
                raise DatasetError(f"{where}: {role} {name!r} ({typ}): {exc}") from None
            self.columns[name] = col
        self.key = key
        rec = self.columns.pop(key)
        self.record_column = rec
        if rec.kind == "fixed":
            self.dtype, self.shape = rec.dtype, rec.shape
        elif rec.kind == "ragged":
            self.dtype, self.shape = rec.dtype, (None, *rec.shape)
        self.fields = {n: c.spec for n, c in self.columns.items()}
        self.extra = {"source": {"kind": self.kind, "columns": {n: str(schema.field(n).type)
                                                                  for n in names}}}  # fmt: skip
        labels = {
            n: f["names"]
            for n, f in features.items()
            if n in names
            and _pa().types.is_integer(self._label_type(schema.field(n).type))
            and isinstance(f, dict)
            and f.get("_type") == "ClassLabel"
            and isinstance(f.get("names"), list)
            and all(isinstance(c, str) for c in f["names"])
        }
        if labels:
            self.extra["class_labels"] = labels
            if len(labels) == 1:
                self.extra["classes"] = next(iter(labels.values()))

    @staticmethod
    def _label_type(t: Any) -> Any:
        """The value type of a (dictionary-encoded) column: a ClassLabel holds integers."""
        return t.value_type if _pa().types.is_dictionary(t) else t

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
        return ["hf", getattr(self.dataset, "_fingerprint", None), self.length, self.key]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, Any]]:
        return self._convert(self.dataset[a:b], self._where(a))
