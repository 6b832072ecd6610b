"""Typed columns: UTF-8 strings, JSON values and variable-length (ragged) arrays.

A variable-length column is stored as the bytes layout has always been stored: per shard, a
data file holding the records back to back and an offsets file of ``records + 1`` little-endian
uint64 byte offsets into it (record ``i`` is ``data[off[i]:off[i+1]]``). The kinds:

- ``ragged``: an array of ``dtype`` whose first dimension varies (``fields={"tokens":
  ("int32", (None,))}``, or the records themselves with ``shape=(None,)``); the other
  dimensions are fixed. Offsets are multiples of one row's bytes.
- ``str``: a UTF-8 string. ``json``: any JSON value (``None``, ``bool``, ``int``, finite
  ``float``, ``str``, ``list``, ``dict`` with string keys), stored compactly as UTF-8 JSON.

Writing (:func:`parse_field`, :func:`encode`) refuses up front what would not read back equal.
Reading is one vectorised gather per column per shard of a batch (:func:`gather`), then
:func:`assemble` gives the batch: ragged columns padded (``"pad"``, with ``NAME_lengths``),
as a jagged nested tensor (``"nested"``) or as a list of tensors (``"list"``); strings and JSON
values as Python lists. Offsets are checked when a shard's are first loaded
(:func:`check_offsets`): a bad offset is a :class:`~feedpipe.DatasetError` naming the file and
the record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feedpipe.errors import DatasetError
from feedpipe.format import (
    VARIABLE_KINDS,
    FieldSpec,
    Layout,
    check_dtype,
    check_shape,
)

__all__ = [
    "RAGGED_MODES",
    "Column",
    "assemble",
    "check_offsets",
    "dtype_arg",
    "encode",
    "gather",
    "loads_json",
    "parse_field",
    "read_variable",
    "variable_columns",
]

RAGGED_MODES = ("pad", "nested")
_BIG_RECORD = 1024  # bytes: records this large are copied one slice each, not by index arrays


@dataclass(frozen=True)
class Column:
    """A variable-length column: its batch key, kind, element type and file roles."""

    name: str
    kind: str  # ragged, str, json (the bytes layout keeps its own read path)
    dtype: str
    shape: tuple[int, ...]  # the fixed dimensions after the varying one (ragged)
    data_role: str
    offsets_role: str

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def variable_columns(layout: Layout, fields: dict[str, FieldSpec]) -> dict[str, Column]:
    """The variable-length columns read by this module, by batch key (``data`` for records)."""
    cols: dict[str, Column] = {}
    if layout.kind == "ragged":
        cols["data"] = Column("data", "ragged", layout.dtype, layout.shape, "data", "offsets")
    for name, spec in fields.items():
        if spec.kind in VARIABLE_KINDS:
            role = f"field.{name}"
            cols[name] = Column(name, spec.kind, spec.dtype, spec.shape, role, f"{role}.offsets")
    return cols


# ---------------------------------------------------------------------- writing
def dtype_arg(value: Any) -> Any:
    """A dtype argument as :func:`~feedpipe.format.check_dtype` takes it
    (``np.int32``, ``torch.int32``, a string)."""
    if isinstance(value, (str, np.dtype)) or (
        isinstance(value, type) and issubclass(value, np.generic)
    ):
        return value
    if isinstance(value, torch.dtype):  # its numpy twin
        return torch.empty(0, dtype=value).numpy().dtype
    return np.dtype(value)


def parse_field(name: str, spec: Any) -> FieldSpec:
    """A writer's field spec: ``"str"``, ``"json"``, a dtype, ``(dtype, shape)``, or
    ``(dtype, (None, *shape))`` for a ragged array. ``ValueError`` names the field."""
    what = f"field {name!r}"
    if isinstance(spec, str) and spec in ("str", "json"):
        return FieldSpec("uint8", (), spec)
    dtype, shape = (spec, ()) if not isinstance(spec, tuple) else spec
    if isinstance(spec, tuple) and len(spec) != 2:
        raise ValueError(f"{what}: expected dtype or (dtype, shape), got {spec!r}")
    dt = check_dtype(dtype_arg(dtype), what)
    if not isinstance(shape, (tuple, list)):
        raise ValueError(f"{what}: shape must be a tuple, got {shape!r}")
    if len(shape) and shape[0] is None:
        return FieldSpec(dt, check_shape(list(shape[1:]), np.dtype(dt).itemsize, what), "ragged")
    return FieldSpec(dt, check_shape(tuple(shape), np.dtype(dt).itemsize, what))


def encode(kind: str, dtype: str, shape: tuple[int, ...], value: Any, where: str) -> np.ndarray:
    """One record of a variable-length column as uint8 bytes; ``DatasetError`` naming
    ``where`` (record and field) for a value that would not read back equal."""
    if kind == "str":
        if not isinstance(value, str):
            raise DatasetError(f"{where}: expected str, got {type(value).__name__}")
        try:
            return np.frombuffer(value.encode("utf-8"), np.uint8)
        except UnicodeEncodeError as exc:
            raise DatasetError(f"{where}: not encodable as UTF-8: {exc.reason}") from None
    if kind == "json":
        _check_json(value, where)
        try:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            data = text.encode("utf-8")
        except (ValueError, UnicodeEncodeError) as exc:  # a huge int, a lone surrogate
            raise DatasetError(f"{where}: cannot be stored as JSON: {exc}") from None
        return np.frombuffer(data, np.uint8)
    return np.ascontiguousarray(_ragged(dtype, shape, value, where)).reshape(-1).view(np.uint8)


def _ragged(dtype: str, shape: tuple[int, ...], value: Any, where: str) -> np.ndarray:
    """One ragged record: raw bytes (a ``uint8`` column), else an array of ``(n, *shape)``
    cast exactly to ``dtype``."""
    if isinstance(value, (bytes, bytearray, memoryview)) and dtype == "uint8" and shape == ():
        return np.frombuffer(value, np.uint8)
    arr = _array_of(value, where)
    want = np.dtype(dtype)
    if arr.size == 0 and arr.ndim == 1 and shape == ():
        return np.empty(0, want)
    if arr.ndim != 1 + len(shape) or arr.shape[1:] != shape:
        want_shape = f"(n, {', '.join(map(str, shape))})" if shape else "(n,)"
        raise DatasetError(f"{where}: expected shape {want_shape} with any n, got {arr.shape}")
    return arr if arr.dtype == want else _cast_exact(arr, want, where)


def _array_of(value: Any, where: str) -> np.ndarray:
    """``value`` (an array-like, a tensor) as a numpy array; never a string, mapping or None."""
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise DatasetError(f"{where}: expected an array, got {type(value).__name__}")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _cast_exact(arr: np.ndarray, want: np.dtype[Any], where: str) -> np.ndarray:
    """``arr`` as ``want``: integers whose values fit, or a same-kind cast that loses nothing."""
    ints = arr.dtype.kind in "biu" and want.kind in "iu"  # checked below: values must fit
    if not ints and not np.can_cast(arr.dtype, want, "same_kind"):
        raise DatasetError(f"{where}: expected dtype {want}, got {arr.dtype}")
    cast = arr.astype(want)
    if not np.array_equal(cast, arr):
        raise DatasetError(
            f"{where}: expected dtype {want}, got {arr.dtype} with values that do not fit"
        )
    return cast


def _check_json(value: Any, where: str, depth: int = 0) -> None:
    """Only what JSON round-trips unchanged: never a silent tuple->list or 1->"1" key."""
    if depth > 100:
        raise DatasetError(f"{where}: JSON value nested deeper than 100 levels")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DatasetError(f"{where}: {value} cannot be stored as JSON")
        return
    if isinstance(value, list):
        for v in value:
            _check_json(v, where, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise DatasetError(
                    f"{where}: JSON object keys must be str, got {type(k).__name__} {k!r}"
                )
            _check_json(v, where, depth + 1)
        return
    hint = " (pass a list)" if isinstance(value, tuple) else " (convert it: .item(), .tolist())"
    raise DatasetError(f"{where}: {type(value).__name__} is not a JSON value{hint}")


# ---------------------------------------------------------------------- reading
def check_offsets(
    raw: bytes, records: int, data_bytes: int, row_bytes: int, path: str
) -> np.ndarray:
    """Parse and check one shard's offsets file: ``records + 1`` offsets, from 0, never
    decreasing, ending at the data file's size, on row boundaries. Returns int64 offsets."""
    if len(raw) != (records + 1) * 8:
        raise DatasetError(
            f"{path}: offsets file is {len(raw)} bytes; {records} records need {(records + 1) * 8}"
        )
    off = np.frombuffer(raw, dtype="<u8")
    if off[0] != 0:
        raise DatasetError(f"{path}: record 0 starts at byte {int(off[0])}, not 0")
    beyond = off > data_bytes
    if beyond.any():
        i = max(int(np.argmax(beyond)) - 1, 0)
        raise DatasetError(
            f"{path}: record {i} ends beyond the data file ({int(off[i + 1])} > {data_bytes} bytes)"
        )
    off = off.astype(np.int64)
    back = np.diff(off) < 0
    if back.any():
        i = int(np.argmax(back))
        raise DatasetError(
            f"{path}: record {i} has a negative length (offsets {off[i]} then {off[i + 1]})"
        )
    if off[-1] != data_bytes:
        raise DatasetError(
            f"{path}: the last record ends at byte {int(off[-1])}, the data file has {data_bytes}"
        )
    if row_bytes > 1:
        odd = off % row_bytes != 0
        if odd.any():
            i = int(np.argmax(odd))
            raise DatasetError(
                f"{path}: record {max(i - 1, 0) if i == records else i} has a boundary at byte "
                f"{int(off[i])}, not a multiple of its {row_bytes}-byte rows"
            )
    return off


def gather(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, dest: np.ndarray
) -> None:
    """Copy ``buf[starts[j]:starts[j]+lengths[j]]`` to ``out[dest[j]:...]`` for every ``j``:
    indexed copies for records of under ``_BIG_RECORD`` bytes on average, one slice copy per
    record for larger ones. A range outside ``buf`` is an ``IndexError``."""
    n = len(starts)
    if n == 0:
        return
    total = int(lengths.sum())
    if total >= _BIG_RECORD * n:
        for s, ln, d in zip(starts.tolist(), lengths.tolist(), dest.tolist(), strict=True):
            if s < 0 or ln < 0 or s + ln > len(buf):  # a slice would clip or count from the end
                raise IndexError(f"range [{s}, {s + ln}) is outside a buffer of {len(buf)}")
            out[d : d + ln] = buf[s : s + ln]
        return
    unit = _unit(buf, starts, lengths, out, dest)
    view = np.dtype(f"u{unit}")
    src, dst = buf.view(view), out.view(view)
    starts, lengths, dest = starts // unit, lengths // unit, dest // unit
    if _back_to_back(src, starts, lengths, dest):
        _take_runs(src, starts, lengths, dst[int(dest[0]) :])
        return
    count = total // unit
    within = np.arange(count, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    at = np.repeat(starts, lengths) + within
    if count and int(at.min()) < 0:  # numpy would count it from the end
        raise IndexError(f"a range starts {-int(at.min()) * unit} bytes before the buffer")
    dst[np.repeat(dest, lengths) + within] = src[at]


def _unit(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, dest: np.ndarray
) -> int:
    """The widest unit (8, 4, 2 or 1 bytes) every boundary and both buffers are a multiple of."""
    for u in (8, 4, 2):
        if (
            buf.nbytes % u == 0
            and out.nbytes % u == 0
            and not (starts % u).any()
            and not (lengths % u).any()
            and not (dest % u).any()
        ):
            return u
    return 1


def _back_to_back(
    src: np.ndarray, starts: np.ndarray, lengths: np.ndarray, dest: np.ndarray
) -> bool:
    """Whether the records go back to back from ``dest[0]`` and each range lies inside ``src``
    (then :func:`_take_runs` copies them; anything else takes the general path, which raises
    an ``IndexError`` for a range outside)."""
    ends = starts + lengths
    return (
        int(starts.min()) >= 0
        and int(lengths.min()) >= 0
        and int(ends.max()) <= len(src)
        and bool((dest[1:] - dest[:-1] == lengths[:-1]).all())
    )


_RUN_UNITS = 1 << 15  # units copied per take: the index temporaries stay small (cache, no mmap)


def _take_runs(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray, dst: np.ndarray) -> None:
    """Ranges ``src[starts[j]:starts[j]+lengths[j]]`` (inside ``src``) back to back into
    ``dst``: a few records at a time (``_RUN_UNITS`` units), each run one ``take`` whose index
    is each unit's record start, shifted to its place, plus its place in the run."""
    ends = np.cumsum(lengths)
    n, j = len(starts), 0
    while j < n:
        base = int(ends[j] - lengths[j])
        k = max(int(np.searchsorted(ends, base + _RUN_UNITS, side="right")), j + 1)
        run = lengths[j:k]
        count = int(ends[k - 1]) - base
        idx = np.repeat(starts[j:k] - (ends[j:k] - run - base), run)
        idx += np.arange(count, dtype=idx.dtype)
        src.take(idx, out=dst[base : base + count], mode="clip")  # in range: checked above
        j = k


def read_variable(
    sid: np.ndarray,
    local: np.ndarray,
    offsets_of: Callable[[int], np.ndarray],
    mapped: Callable[[int], AbstractContextManager[np.ndarray]],
    order: list[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Gather the records ``local`` of shards ``sid`` of one variable-length column: their
    bytes back to back and their byte lengths. ``offsets_of(s)`` gives shard ``s``'s checked
    offsets, ``mapped(s)`` its data file mapped (held open inside the block), ``order`` the
    shards in the order to read them. One :func:`gather` per shard of the batch."""
    n = len(sid)
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    single = len(order) == 1
    for s in order:
        pos = slice(None) if single else np.flatnonzero(sid == s)
        off = offsets_of(s)
        at = local[pos]
        starts[pos] = off[at]
        lengths[pos] = off[at + 1] - off[at]
    dest = np.cumsum(lengths) - lengths
    values = np.empty(int(lengths.sum()), np.uint8)
    for s in order:
        pos = slice(None) if single else np.flatnonzero(sid == s)
        with mapped(s) as buf:
            gather(buf, starts[pos], lengths[pos], values, dest[pos])
    return values, lengths


def assemble(
    col: Column,
    values: np.ndarray,
    lengths: np.ndarray,
    mode: str,
    *,
    pad_value: Any,
    where: Callable[[int], str],
) -> dict[str, Any] | list[Any]:
    """The batch of one column from its gathered bytes (``values``, records back to back) and
    per-record byte ``lengths``: ``{name: ..., name_lengths: ...}`` (``pad``), ``{name: nested}``
    (``nested``) or the per-record list (``list``, also for ``str``/``json`` in every mode).
    ``where(j)`` names record ``j`` (file and record) for a decoding error."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    if col.kind in ("str", "json"):
        items: list[Any] = []
        for j in range(len(lengths)):
            raw = values[bounds[j] : bounds[j + 1]].tobytes()
            try:
                text = raw.decode("utf-8")
                items.append(loads_json(text) if col.kind == "json" else text)
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                why = type(exc).__name__ + (f": {exc}" if type(exc) is ValueError else "")
                raise DatasetError(f"{where(j)}: {col.kind} column {col.name!r}: {why}") from None
        return items if mode == "list" else {col.name: items}
    dt, shape = np.dtype(col.dtype), col.shape
    row = col.row_bytes
    rows = lengths // row if row else np.zeros_like(lengths)
    elems = values.view(dt).reshape(-1, *shape)
    if mode == "list":
        tensor = _tensor(elems)
        return list(torch.split(tensor, rows.tolist())) if len(rows) else []
    if mode == "nested":
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(rows)]).astype(np.int64))
        nested = torch.nested.nested_tensor_from_jagged(_tensor(elems), offsets)
        return {col.name: nested}
    n = len(rows)
    width = int(rows.max()) if n else 0
    padded = np.full((n, width, *shape), pad_value, dtype=dt)
    total = int(rows.sum())
    if total:
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
        target = np.repeat(np.arange(n, dtype=np.int64) * width, rows) + within
        padded.reshape(n * width, *shape)[target] = elems
    return {
        col.name: _tensor(padded),
        f"{col.name}_lengths": _tensor(rows.astype(np.int64)),
    }


def loads_json(text: str | bytes) -> Any:
    """A JSON column's value, as strict as :func:`encode` writes one: ``NaN``, ``Infinity`` and
    numbers out of a float's range (``1e999``, which ``json`` reads as ``inf``) are refused with
    a ``ValueError``, so what reads back is what could be written again."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _no_constant(name: str) -> Any:
    """``json.loads`` hook: ``NaN``/``Infinity`` are not JSON (the writer never stores them)."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """``json.loads`` hook: a number out of a float's range is refused, not read as ``inf``."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy``, with plain strides for an empty array (numpy gives 0 strides)."""
    t = torch.from_numpy(arr)
    return t if t.numel() else torch.empty(t.shape, dtype=t.dtype)
