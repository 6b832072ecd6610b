"""How the columns of an Arrow table are stored by ``feedpipe convert``: each column's type
is planned before anything is written (:func:`plan_column`, one planner per column kind, tried
in order; the mapping is the table in :mod:`feedpipe.datasets.tables`), a whole table's
columns at once (:class:`TablePlan`), and a column's values converted as the writer takes them
(:func:`column_values`). ``pyarrow`` is the ``parquet`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from feedpipe.errors import DatasetError, require

__all__ = [
    "ArrowColumn",
    "TablePlan",
    "column_values",
    "hf_features",
    "plan_column",
    "require_pyarrow",
]

_BYTES_FEATURES = ("Image", "Audio")  # Hugging Face structs {bytes, path}: stored as the bytes


def require_pyarrow() -> Any:
    """The ``pyarrow`` module (``MissingExtraError`` naming the ``parquet`` extra without it)."""
    return require("pyarrow", "parquet")


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


@dataclass(frozen=True)
class ColumnType:
    """What decides how a column is stored: its Arrow type (``value``: dictionary-decoded;
    ``storage``: an extension type's storage too), its Hugging Face feature, its role."""

    pa: Any
    name: str
    arrow: str  # the Arrow type as read, kept in the index
    value: Any
    storage: Any
    hf: str  # the feature's ``_type`` ("" when none)
    feature: Any
    records: bool  # the records column, not a side field

    @classmethod
    def of(cls, name: str, typ: Any, feature: Any, *, records: bool) -> ColumnType:
        pa = require_pyarrow()
        hf = feature.get("_type", "") if isinstance(feature, dict) else ""
        hf = hf if isinstance(hf, str) else ""  # valid JSON that lies: not a feature
        value = typ.value_type if pa.types.is_dictionary(typ) else typ
        storage = value.storage_type if isinstance(value, pa.ExtensionType) else value
        return cls(pa, name, str(typ), value, storage, hf, feature, records)

    def column(self, kind: str, dtype: str = "uint8", shape: tuple[int, ...] = ()) -> ArrowColumn:
        return ArrowColumn(self.name, self.arrow, kind, dtype, shape)


def _plan_bytes_feature(c: ColumnType) -> ArrowColumn | None:
    """An HF ``Image``/``Audio``: the struct's bytes."""
    if c.hf in _BYTES_FEATURES and _bytes_struct(c.pa, c.value):
        kind = "bytes" if c.records else "ragged"
        return ArrowColumn(c.name, c.arrow, kind, member="bytes")
    return None


def _plan_array_feature(c: ColumnType) -> ArrowColumn | None:
    """An HF ``Array2D``..``Array5D`` stored as nested lists: fixed."""
    fixed = _array_feature(c.pa, c.storage, c.feature) if c.hf.startswith("Array") else None
    return None if fixed is None else c.column("fixed", *fixed)


def _plan_numbers(c: ColumnType) -> ArrowColumn | None:
    """Numbers, or nested fixed-size lists of numbers: fixed."""
    inner, shape = _fixed_lists(c.pa, c.storage)
    return c.column("fixed", _dtype(inner), shape) if _numeric(c.pa, inner) else None


def _plan_temporal(c: ColumnType) -> ArrowColumn | None:
    """Timestamps, dates, times, durations: the int64 Arrow stores."""
    return c.column("fixed", "int64") if _temporal(c.pa, c.storage) else None


def _plan_string(c: ColumnType) -> ArrowColumn | None:
    if _string(c.pa, c.storage):
        return c.column("bytes" if c.records else "str")
    return None


def _plan_binary(c: ColumnType) -> ArrowColumn | None:
    if _binary(c.pa, c.storage):
        return c.column("bytes" if c.records else "ragged")
    return None


def _plan_ragged(c: ColumnType) -> ArrowColumn | None:
    """Lists of numbers (or of fixed-size lists of numbers): ragged."""
    if not _list(c.pa, c.storage):
        return None
    inner, shape = _fixed_lists(c.pa, c.storage.value_type)
    return c.column("ragged", _dtype(inner), shape) if _numeric(c.pa, inner) else None


def _plan_json(c: ColumnType) -> ArrowColumn | None:
    """Structs, maps with string keys, lists of strings or structs: a JSON side field."""
    pa, t = c.pa, c.storage
    if not _jsonable(pa, t) or _numeric(pa, t) or _string(pa, t) or pa.types.is_null(t):
        return None
    if c.records:
        raise ValueError(
            "the records column holds numbers, arrays, strings or bytes; this column can "
            "be a JSON side field: choose another records column with data_key/--data-key"
        )
    return c.column("json")


# the column planners, tried in order: the first that plans the column decides
_PLANNERS: tuple[Callable[[ColumnType], ArrowColumn | None], ...] = (
    _plan_bytes_feature,
    _plan_array_feature,
    _plan_numbers,
    _plan_temporal,
    _plan_string,
    _plan_binary,
    _plan_ragged,
    _plan_json,
)


def plan_column(name: str, typ: Any, feature: Any, *, records: bool) -> ArrowColumn:
    """How column ``name`` of Arrow type ``typ`` (Hugging Face ``feature``: its ``to_dict()``
    form, or None) is stored (see the module docstring); ``ValueError`` for what cannot be."""
    c = ColumnType.of(name, typ, feature, records=records)
    for planner in _PLANNERS:
        col = planner(c)
        if col is not None:
            return col
    hint = " (cast it to float64 or string first)" if c.pa.types.is_decimal(c.storage) else ""
    raise ValueError(f"no feedpipe column type holds Arrow {c.arrow}{hint}")


@dataclass
class TablePlan:
    """How every column of a table is stored: the records column (``key``) and the side
    fields, planned from the schema before anything is written."""

    key: str
    record_column: ArrowColumn
    columns: dict[str, ArrowColumn]  # the side fields
    arrow_types: dict[str, str]  # every column's Arrow type, kept in the index
    class_labels: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, schema: Any, data_key: str | None, where: str) -> TablePlan:
        """The plan of a table of ``schema``; ``DatasetError`` naming ``where`` and the column."""
        names = list(schema.names)
        key = _records_key(names, data_key, where)
        features = hf_features(schema)
        columns: dict[str, ArrowColumn] = {}
        for name in names:
            typ = schema.field(name).type
            try:
                columns[name] = plan_column(name, typ, features.get(name), records=name == key)
            except ValueError as exc:
                role = "the records column" if name == key else "column"
                raise DatasetError(f"{where}: {role} {name!r} ({typ}): {exc}") from None
        rec = columns.pop(key)
        types = {n: str(schema.field(n).type) for n in names}
        return cls(key, rec, columns, types, _class_labels(schema, features))

    @property
    def fields(self) -> dict[str, Any]:
        """The writer's side-field specs."""
        return {n: c.spec for n, c in self.columns.items()}

    def records_layout(self, default: tuple[str, Any]) -> tuple[str, Any]:
        """``(dtype, shape)`` of the records (``default`` for the bytes layout)."""
        rec = self.record_column
        if rec.kind == "fixed":
            return rec.dtype, rec.shape
        if rec.kind == "ragged":
            return rec.dtype, (None, *rec.shape)
        return default

    def extra(self, kind: str) -> dict[str, Any]:
        """The index's ``extra``: the source's column types and any ClassLabel names."""
        extra: dict[str, Any] = {"source": {"kind": kind, "columns": dict(self.arrow_types)}}
        if self.class_labels:
            extra["class_labels"] = self.class_labels
            if len(self.class_labels) == 1:
                extra["classes"] = next(iter(self.class_labels.values()))
        return extra


def _records_key(names: list[str], data_key: str | None, where: str) -> str:
    if not names:
        raise DatasetError(f"{where}: the table has no columns")
    if len(set(names)) != len(names):
        raise DatasetError(f"{where}: duplicate column names {names}")
    key = data_key or ("data" if "data" in names else names[0])
    if key not in names:
        raise DatasetError(f"{where}: no column {key!r} (columns: {names})")
    return key


def _str_list(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(c, str) for c in value)


def _class_labels(schema: Any, features: dict[str, Any]) -> dict[str, list[str]]:
    """The names of each integer column that is a Hugging Face ``ClassLabel``."""
    pa = require_pyarrow()
    labels: dict[str, list[str]] = {}
    for n, f in features.items():
        if n not in schema.names or not isinstance(f, dict) or f.get("_type") != "ClassLabel":
            continue
        t = schema.field(n).type
        t = t.value_type if pa.types.is_dictionary(t) else t  # a ClassLabel holds integers
        names = f.get("names")
        if pa.types.is_integer(t) and _str_list(names):
            labels[n] = names
    return labels


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
    pa = require_pyarrow()
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


def hf_features(schema: Any) -> dict[str, Any]:
    """The Hugging Face features of a table, from its ``huggingface`` schema metadata."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return features if isinstance(features, dict) else {}
