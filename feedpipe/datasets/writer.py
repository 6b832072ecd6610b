"""``MemmapWriter``: write a sharded memmap dataset (format: :mod:`feedpipe.datasets.format`).

Each shard is written under a temporary name and renamed when complete; ``index.json`` is written
last, so a crashed or interrupted write never looks like a complete dataset.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from feedpipe.datasets.columns import dtype_arg, encode, parse_field
from feedpipe.datasets.format import (
    INDEX_NAME,
    VARIABLE_KINDS,
    FieldSpec,
    FileInfo,
    Index,
    Layout,
    Shard,
    check_dtype,
    check_field_names,
    check_shape,
    read_index,
    write_index,
)
from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.io.destination import is_writer_file
from feedpipe.io.remote import local_file_path

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "MemmapWriter",
    "check_destination",
    "is_writer_file",
    "prepare_destination",
    "shard_name",
]

DEFAULT_SHARD_BYTES = 256 << 20
_TMP_MARK = ".tmp-"


def check_destination(path: str, *, overwrite: bool) -> bool:
    """Refuse ``path`` unless a new dataset may be written there; True if something is there.

    Absent or empty: fine. A dataset (``index.json``) holding only its own files: fine with
    ``overwrite``, else refused. Anything else (a file, a folder holding other files, a dataset
    with extra files) is refused even with ``overwrite``: feedpipe never deletes what it did not
    write. Leftovers of an interrupted writer (shard files, no index) count as its own.
    """
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not os.path.isdir(path):
        raise DatasetError(
            f"{path}: exists and is not a dataset folder; refusing to replace it"
            + (" (did you forget DEST?)" if path.endswith((".npy", ".npz")) else "")
        )
    entries = os.listdir(path)
    foreign = sorted(
        e
        for e in entries
        if not is_writer_file(e)
        or os.path.islink(os.path.join(path, e))
        or os.path.isdir(os.path.join(path, e))
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise DatasetError(
            f"{path}: folder holds files feedpipe did not write ({shown}); refusing to write "
            "into it, even with overwrite (choose a new or empty folder)"
        )
    if INDEX_NAME in entries:
        listed = {rel for _sid, rel, _n, _c in read_index(path).files()}  # damaged: not ours
        extra = sorted(e for e in entries if e[0] != "." and e != INDEX_NAME and e not in listed)
        if extra:
            raise DatasetError(
                f"{path}: the dataset folder holds files its index does not list ({extra[0]}...); "
                "refusing to replace it"
            )
        if not overwrite:
            raise DatasetError(f"{path}: a dataset already exists here (pass overwrite=True)")
    return bool(entries)


def prepare_destination(path: str, *, overwrite: bool) -> None:
    """:func:`check_destination`, then delete the old dataset's files (its index first)."""
    if not check_destination(path, overwrite=overwrite):
        return
    entries = os.listdir(path)
    for e in sorted(entries, key=lambda e: e == INDEX_NAME, reverse=True):
        os.unlink(os.path.join(path, e))


def shard_name(shard_id: int, suffix: str) -> str:
    """Relative file name of one shard file, e.g. ``shard-00003.data``."""
    return f"shard-{shard_id:05d}.{suffix}"


def _nbytes(buf: Any) -> int:
    return 0 if buf is None else memoryview(buf).nbytes


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


class _ShardFile:
    """A file being written under a temp name, with its running CRC32C and size."""

    def __init__(self, directory: str, relpath: str) -> None:
        self.relpath = relpath
        self.final = os.path.join(directory, relpath)
        self.tmp = os.path.join(directory, f".{relpath}{_TMP_MARK}{uuid.uuid4().hex[:8]}")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish()/abort()
        self.crc = 0
        self.size = 0

    def write(self, buf: Any) -> None:
        mv = memoryview(buf).cast("B")
        self.f.write(mv)
        self.crc = crc32c(mv, self.crc)
        self.size += mv.nbytes

    def finish(self) -> FileInfo:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.final)
        return FileInfo(self.relpath, self.size, to_hex(self.crc))

    def abort(self) -> None:
        self.f.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class MemmapWriter:
    """Write records into a new dataset directory; use as a context manager.

    ``shape``/``dtype`` give a fixed layout (every record an array of exactly that shape and
    dtype); ``shape=(None, ...)`` a ragged layout (arrays of ``dtype`` whose first dimension
    varies); ``shape=None`` the bytes layout (each record any bytes-like object);
    ``records=False`` no records column (a record is its fields; ``append(**fields)``).
    ``fields`` maps side-field names to a dtype, ``(dtype, shape)``, ``(dtype, (None, ...))``
    (ragged), ``"str"`` (UTF-8) or ``"json"`` (see :mod:`feedpipe.datasets.columns`). A shard
    is closed when its files would exceed ``shard_bytes``. ``extra`` adds top-level keys to the
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
        from feedpipe.remote import transfer as _remote

        self.path = os.fspath(path)
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        try:
            if not records:
                self.layout = Layout("none")
            elif shape is None:
                self.layout = Layout("bytes")
            else:
                dt = check_dtype(dtype_arg(dtype), "records")
                if len(shape) and shape[0] is None:
                    rest = check_shape(tuple(shape[1:]), np.dtype(dt).itemsize, "records")
                    self.layout = Layout("ragged", rest, dt)
                else:
                    dims = check_shape(tuple(shape), np.dtype(dt).itemsize, "records")
                    self.layout = Layout("fixed", dims, dt)
            self.fields: dict[str, FieldSpec] = {}
            for name, spec in dict(fields or {}).items():
                if not isinstance(name, str) or not name.isidentifier() or name == "data":
                    raise ValueError(f"invalid side-field name {name!r}")
                self.fields[name] = parse_field(name, spec)
            check_field_names(self.layout, self.fields)
        except (ValueError, TypeError) as exc:
            raise DatasetError(f"{self.path}: {exc}") from None
        self.shard_bytes = int(shard_bytes)
        self.extra = dict(extra or {})
        self._upload: tuple[str, dict[str, Any], bool] | None = None
        if _remote.is_remote(self.path):  # write locally, publish on close (index last)
            self._upload = (self.path, dict(storage_options or {}), overwrite)
            from feedpipe.datasets._publish import check_remote_destination

            check_remote_destination(self.path, self._upload[1], overwrite=overwrite)
            self._local = tempfile.mkdtemp(prefix="feedpipe-upload-")
        else:
            self.path = local_file_path(self.path)
            prepare_destination(self.path, overwrite=overwrite)
            os.makedirs(self.path, exist_ok=True)
            self._local = self.path
        self._shards: list[Shard] = []
        self._first_shard = first_shard
        self._data: _ShardFile | None = None
        self._offsets: list[int] = []
        self._columns: dict[str, list[np.ndarray]] = {}
        self._var = {n: f for n, f in self.fields.items() if f.kind in VARIABLE_KINDS}
        self._var_files: dict[str, _ShardFile] = {}
        self._var_offsets: dict[str, list[int]] = {}
        self._records = 0  # records in the open shard
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
            arr = self._check_fixed(_as_array(records), first, batch=True)
            n = len(arr)
            if n == 0:
                return
            cols = self._check_fields(fields, n, first)
            arr = np.ascontiguousarray(arr)
            per = self.layout.record_bytes
            # split into pieces that respect the shard size limit
            start = 0
            while start < n:
                if self._records and self._data_size() + per > self.shard_bytes:
                    self._close_shard()
                room = (self.shard_bytes - self._data_size()) // per if per else n
                stop = min(n, start + max(1, room))
                piece = {k: v[start:stop] for k, v in cols.items()}
                self._write_block(arr[start:stop], stop - start, piece)
                start = stop
        else:
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
    def _data_size(self) -> int:
        """Bytes of the open shard's streamed files (records and variable-length fields)."""
        if not self._open:
            return 0
        size = self._data.size if self._data is not None else 0
        return size + sum(f.size for f in self._var_files.values())

    @property
    def _open(self) -> bool:
        return self._data is not None or bool(self._var_files)

    def _open_shard(self) -> None:
        sid = self._first_shard + len(self._shards)
        if self.layout.kind != "none":
            self._data = _ShardFile(self._local, shard_name(sid, "data"))
        self._offsets = [0]
        self._columns = {name: [] for name in self.fields if name not in self._var}
        self._var_files = {n: _ShardFile(self._local, shard_name(sid, n)) for n in self._var}
        self._var_offsets = {n: [0] for n in self._var}
        self._records = 0

    def _write_records(
        self,
        bufs: list[Any],
        sizes: list[int],
        cols: dict[str, np.ndarray],
        var: dict[str, list[np.ndarray]] | None = None,
    ) -> None:
        var = var or {}
        for i, (buf, size) in enumerate(zip(bufs, sizes, strict=True)):
            extra = sum(v[i].nbytes for v in var.values())
            if self._records and self._data_size() + size + extra > self.shard_bytes:
                self._close_shard()
            one = {k: v[i] for k, v in var.items()}
            self._write_block(buf, 1, {k: v[i : i + 1] for k, v in cols.items()}, one)

    def _write_block(
        self,
        buf: Any,
        n: int,
        cols: dict[str, np.ndarray],
        var: dict[str, np.ndarray] | None = None,
    ) -> None:
        if self._closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        if not self._open:
            self._open_shard()
        if self._data is not None:
            self._data.write(buf)
            if self.layout.has_offsets:
                self._offsets.append(self._data.size)
        for name, value in (var or {}).items():
            f = self._var_files[name]
            f.write(value)
            self._var_offsets[name].append(f.size)
        for name, col in cols.items():
            self._columns[name].append(col)
        self._records += n
        self.num_records += n

    def _close_shard(self) -> None:
        if not self._open:
            return
        sid = self._first_shard + len(self._shards)
        files: dict[str, FileInfo] = {}
        if self._data is not None:
            files["data"] = self._data.finish()
        self._data = None
        var_files, self._var_files = self._var_files, {}
        pending: list[tuple[str, str, np.ndarray]] = []
        if self.layout.has_offsets:
            pending.append(("offsets", "offsets", np.asarray(self._offsets, dtype="<u8")))
        for name, f in var_files.items():
            files[f"field.{name}"] = f.finish()
            offsets = np.asarray(self._var_offsets[name], dtype="<u8")
            pending.append((f"field.{name}.offsets", f"{name}.offsets", offsets))
        for name, spec in self.fields.items():
            if name in self._var:
                continue
            parts = self._columns[name]
            col = np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)
            pending.append((f"field.{name}", name, col))
        for role, suffix, arr in pending:
            f = _ShardFile(self._local, shard_name(sid, suffix))
            try:
                f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
                files[role] = f.finish()
            except BaseException:
                f.abort()
                raise
        self._shards.append(Shard(self._records, files))
        self._records = 0

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
        if self._upload is not None:
            from feedpipe.datasets._publish import publish

            url, options, overwrite = self._upload
            try:
                publish(self._local, url, options, overwrite=overwrite)
            finally:
                shutil.rmtree(self._local, ignore_errors=True)
        return index

    def abort(self) -> None:
        """Discard the open shard; no index is written, so the directory is not a dataset."""
        if self._data is not None:
            self._data.abort()
            self._data = None
        for f in self._var_files.values():
            f.abort()
        self._var_files = {}
        self._closed = True
        if self._upload is not None:
            shutil.rmtree(self._local, ignore_errors=True)

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
