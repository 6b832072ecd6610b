"""``MemmapWriter``: write a sharded memmap dataset (format: :mod:`feedpipe.format`).

Each shard is written under a temporary name and renamed when complete; ``index.json`` is written
last, so a crashed or interrupted write never looks like a complete dataset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from feedpipe.datasets._writer_target import WriteTarget, check_destination, prepare_destination
from feedpipe.datasets._writing_shard import WritingShard
from feedpipe.datasets.columns import dtype_arg, encode, parse_field
from feedpipe.datasets.shard_names import shard_name
from feedpipe.errors import DatasetError
from feedpipe.format import (
    VARIABLE_KINDS,
    FieldSpec,
    Index,
    Layout,
    Shard,
    check_dtype,
    check_field_names,
    check_shape,
    write_index,
)
from feedpipe.io.destination import is_writer_file

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "MemmapWriter",
    "check_destination",
    "is_writer_file",
    "parse_fields",
    "prepare_destination",
    "records_layout",
    "shard_name",
]

DEFAULT_SHARD_BYTES = 256 << 20


def _nbytes(buf: Any) -> int:
    return 0 if buf is None else memoryview(buf).nbytes


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def records_layout(shape: Sequence[int | None] | None, dtype: Any, *, records: bool) -> Layout:
    """The layout of a writer's records (see :class:`MemmapWriter`); ``ValueError`` if invalid."""
    if not records:
        return Layout("none")
    if shape is None:
        return Layout("bytes")
    dt = check_dtype(dtype_arg(dtype), "records")
    if len(shape) and shape[0] is None:
        rest = check_shape(tuple(shape[1:]), np.dtype(dt).itemsize, "records")
        return Layout("ragged", rest, dt)
    return Layout("fixed", check_shape(tuple(shape), np.dtype(dt).itemsize, "records"), dt)


def parse_fields(fields: Mapping[str, Any], layout: Layout) -> dict[str, FieldSpec]:
    """The side-field specs of a writer of ``layout``; ``ValueError`` for an invalid one."""
    out: dict[str, FieldSpec] = {}
    for name, spec in dict(fields).items():
        if not isinstance(name, str) or not name.isidentifier() or name == "data":
            raise ValueError(f"invalid side-field name {name!r}")
        out[name] = parse_field(name, spec)
    check_field_names(layout, out)
    return out


class MemmapWriter:
    """Write records into a new dataset directory; use as a context manager.

    ``shape``/``dtype`` give a fixed layout (every record an array of exactly that shape and
    dtype); ``shape=(None, ...)`` a ragged layout (arrays of ``dtype`` whose first dimension
    varies); ``shape=None`` the bytes layout (each record any bytes-like object);
    ``records=False`` no records column (a record is its fields; ``append(**fields)``).
    ``fields`` maps side-field names to a dtype, ``(dtype, shape)``, ``(dtype, (None, ...))``
    (ragged), ``"str"`` (UTF-8) or ``"json"`` (see :mod:`feedpipe.datasets.columns`). A shard
    is closed when its records and variable-length field files would exceed ``shard_bytes``
    (a layout with neither counts its fixed-size fields). ``extra`` adds top-level keys to the
    index (e.g. ``classes``). ``first_record`` numbers the records in error messages (a writer
    of one part of a larger conversion).

    >>> with MemmapWriter("out", shape=(2048,), dtype="int32", fields={"label": "int64"}) as w:
    ...     w.append(tokens, label=3)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        shape: Sequence[int | None] | None = None,
        dtype: Any = "uint8",
        fields: Mapping[str, Any] | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        first_shard: int = 0,
        storage_options: Mapping[str, Any] | None = None,
        records: bool = True,
        first_record: int = 0,
    ) -> None:
        self.path = os.fspath(path)
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        try:
            self.layout = records_layout(shape, dtype, records=records)
            self.fields: dict[str, FieldSpec] = parse_fields(fields or {}, self.layout)
        except (ValueError, TypeError) as exc:
            raise DatasetError(f"{self.path}: {exc}") from None
        self.shard_bytes = int(shard_bytes)
        self.extra = dict(extra or {})
        self._target = WriteTarget(self.path, storage_options, overwrite=overwrite)
        self.path = self._target.path
        self._local = self._target.local
        self._shards: list[Shard] = []
        self._first_shard = first_shard
        self._shard: WritingShard | None = None  # the open shard, whatever the layout
        self._var = {n: f for n, f in self.fields.items() if f.kind in VARIABLE_KINDS}
        self.num_records = 0  # records appended in total
        self.first_record = first_record  # the number of the first record in error messages
        self._closed = False

    # ------------------------------------------------------------------ appending
    def append(self, record: Any = None, **fields: Any) -> None:
        """Append one record (an array for a fixed or ragged layout, bytes-like for the bytes
        layout, nothing with ``records=False``) and its fields."""
        number = self.first_record + self.num_records
        buf = self._check_record(record, number)
        cols = self._check_fields(fields, 1, number)
        var = self._check_var(fields, 1, number, batch=False)
        self._write_records([buf], [_nbytes(buf)], cols, var)

    def append_batch(self, records: Any = None, **fields: Any) -> None:
        """Append many records at once: an ``(n, *shape)`` array (fixed), or a sequence of
        arrays (ragged) or bytes-likes (bytes); field values as sequences of ``n``. With
        ``records=False``, ``n`` is the length of the field sequences."""
        first = self.first_record + self.num_records
        if self.layout.kind == "fixed" and not self._var:
            self._append_block(self._check_fixed(_as_array(records), first, batch=True), fields)
            return
        if self.layout.kind == "none":
            n = len(next(iter(fields.values()))) if fields else 0
            records = [None] * n
        elif records is None:
            raise DatasetError(f"{self.path}: records {first}...: append_batch needs records")
        elif self.layout.kind == "fixed":
            records = list(self._check_fixed(_as_array(records), first, batch=True))
        bufs = [self._check_record(r, first + i) for i, r in enumerate(records)]
        if not bufs:
            return
        cols = self._check_fields(fields, len(bufs), first)
        var = self._check_var(fields, len(bufs), first, batch=True)
        self._write_records(bufs, [_nbytes(b) for b in bufs], cols, var)

    def _append_block(self, arr: np.ndarray, fields: Mapping[str, Any]) -> None:
        """Fixed records with fixed fields: written in pieces that respect the shard size."""
        n = len(arr)
        if n == 0:
            return
        cols = self._check_fields(fields, n, self.first_record + self.num_records)
        arr = np.ascontiguousarray(arr)
        per = self.layout.record_bytes
        row = sum(c.nbytes for c in cols.values()) // n  # one record's fixed-size fields
        start = 0
        while start < n:
            if self._full_for(per, row):
                self._close_shard()
            room = (self.shard_bytes - self._size()) // per if per else n
            stop = min(n, start + max(1, room))
            piece = {k: v[start:stop] for k, v in cols.items()}
            self._write_block(arr[start:stop], stop - start, piece)
            start = stop

    # ------------------------------------------------------------------ checks
    def _check_record(self, record: Any, number: int) -> Any:
        kind = self.layout.kind
        if kind == "fixed":
            return np.ascontiguousarray(self._check_fixed(_as_array(record), number, batch=False))
        if kind == "ragged":
            where = f"{self.path}: record {number}"
            return encode("ragged", self.layout.dtype, self.layout.shape, record, where)
        if kind == "none":
            if record is not None:
                raise DatasetError(f"{self.path}: record {number}: records=False takes no record")
            return None
        return self._check_bytes(record, number)

    def _check_var(
        self, fields: Mapping[str, Any], n: int, first: int, *, batch: bool
    ) -> dict[str, list[np.ndarray]]:
        """Variable-length field values encoded per record (``n`` values each when ``batch``)."""
        out: dict[str, list[np.ndarray]] = {}
        for name, spec in self._var.items():
            values = fields[name]
            if batch:
                if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
                    raise DatasetError(
                        f"{self.path}: records {first}..{first + n - 1}: field {name!r} needs a "
                        f"sequence of {n} values, got {type(values).__name__}"
                    )
                if len(values) != n:
                    raise DatasetError(
                        f"{self.path}: records {first}..{first + n - 1}: field {name!r} has "
                        f"{len(values)} values for {n} records"
                    )
            else:
                values = [values]
            out[name] = [
                encode(
                    spec.kind,
                    spec.dtype,
                    spec.shape,
                    v,
                    f"{self.path}: record {first + j}: field {name!r}",
                )
                for j, v in enumerate(values)
            ]
        return out

    def _check_fixed(self, arr: np.ndarray, first: int, *, batch: bool) -> np.ndarray:
        want_shape, want_dtype = self.layout.shape, np.dtype(self.layout.dtype)
        got_shape = arr.shape[1:] if batch else arr.shape
        where = (
            f"records {first}..{first + len(arr) - 1}" if batch and arr.ndim else f"record {first}"
        )
        if (batch and arr.ndim == 0) or got_shape != want_shape:
            raise DatasetError(
                f"{self.path}: {where}: expected shape {want_shape} per record, "
                f"got {arr.shape}{' for the batch' if batch else ''}"
            )
        if arr.dtype != want_dtype:
            raise DatasetError(
                f"{self.path}: {where}: expected dtype {want_dtype}, got {arr.dtype} "
                "(cast explicitly; feedpipe never casts silently)"
            )
        return arr

    def _check_bytes(self, record: Any, number: int) -> Any:
        if isinstance(record, str):
            raise DatasetError(f"{self.path}: record {number}: expected bytes, got str (encode it)")
        if isinstance(record, np.ndarray) or hasattr(record, "numpy"):
            return np.ascontiguousarray(_as_array(record)).view(np.uint8).reshape(-1)
        try:
            memoryview(record)
        except TypeError:
            raise DatasetError(
                f"{self.path}: record {number}: expected a bytes-like object, "
                f"got {type(record).__name__}"
            ) from None
        return record

    def _check_fields(self, fields: Mapping[str, Any], n: int, first: int) -> dict[str, np.ndarray]:
        missing = set(self.fields) - set(fields)
        unknown = set(fields) - set(self.fields)
        if missing or unknown:
            raise DatasetError(
                f"{self.path}: record {first}: side fields must be exactly {sorted(self.fields)} "
                f"(missing {sorted(missing)}, unknown {sorted(unknown)})"
            )
        out: dict[str, np.ndarray] = {}
        for name, spec in self.fields.items():
            if name in self._var:
                continue
            raw = _as_array(fields[name])
            want = np.dtype(spec.dtype)
            shape = (n, *spec.shape)
            try:
                value = raw.reshape(shape) if raw.size == int(np.prod(shape)) else None
            except ValueError:
                value = None
            if value is None:
                raise DatasetError(
                    f"{self.path}: record {first}: field {name!r} expected shape {spec.shape} per "
                    f"record, got {raw.shape}"
                )
            if value.dtype != want:
                cast = value.astype(want)
                if not np.can_cast(value.dtype, want, "same_kind") or not np.array_equal(
                    cast, value
                ):
                    raise DatasetError(
                        f"{self.path}: record {first}: field {name!r} expected dtype {want}, "
                        f"got {value.dtype} with values that do not fit"
                    )
                value = cast
            out[name] = np.ascontiguousarray(value)
        return out

    # ------------------------------------------------------------------ shards
    def _size(self) -> int:
        """Bytes of the open shard counted against ``shard_bytes`` (see :class:`WritingShard`)."""
        return self._shard.size if self._shard is not None else 0

    def _full_for(self, streamed: int, columns: int) -> bool:
        """Whether the open shard, holding records, would pass ``shard_bytes`` with a record
        of ``streamed`` bytes of files and ``columns`` bytes of fixed-size fields."""
        shard = self._shard
        if shard is None or not shard.records:
            return False
        return shard.size_with(streamed, columns) > self.shard_bytes

    def _open_shard(self) -> WritingShard:
        sid = self._first_shard + len(self._shards)
        self._shard = WritingShard(self._local, sid, self.layout, self.fields)
        return self._shard

    def _write_records(
        self,
        bufs: list[Any],
        sizes: list[int],
        cols: dict[str, np.ndarray],
        var: dict[str, list[np.ndarray]] | None = None,
    ) -> None:
        var = var or {}
        for i, (buf, size) in enumerate(zip(bufs, sizes, strict=True)):
            row = {k: v[i : i + 1] for k, v in cols.items()}
            one = {k: v[i] for k, v in var.items()}
            streamed = size + sum(v.nbytes for v in one.values())
            if self._full_for(streamed, sum(c.nbytes for c in row.values())):
                self._close_shard()
            self._write_block(buf, 1, row, one)

    def _write_block(
        self,
        buf: Any,
        n: int,
        cols: dict[str, np.ndarray],
        var: dict[str, np.ndarray] | None = None,
    ) -> None:
        if self._closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        shard = self._shard if self._shard is not None else self._open_shard()
        shard.write(buf, n, cols, var or {})
        self.num_records += n

    def _close_shard(self) -> None:
        shard, self._shard = self._shard, None
        if shard is not None:
            self._shards.append(shard.finish())

    @property
    def shards(self) -> list[Shard]:
        """Shards completed so far."""
        return list(self._shards)

    def close(self) -> Index:
        """Close the last shard and write ``index.json``; return the index."""
        if self._closed:
            raise RuntimeError(f"{self.path}: writer is already closed")
        self._close_shard()
        self._closed = True
        index = Index(self.layout, dict(self.fields), list(self._shards), dict(self.extra))
        write_index(self._local, index)
        self._target.publish()
        return index

    def abort(self) -> None:
        """Discard the open shard; no index is written, so the directory is not a dataset."""
        shard, self._shard = self._shard, None
        if shard is not None:
            shard.abort()
        self._closed = True
        self._target.discard()

    def __enter__(self) -> MemmapWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
