"""``MemmapWriter``: write a sharded memmap dataset (format: :mod:`feedpipe.datasets.format`).

Each shard is written under a temporary name and renamed when complete; ``index.json`` is written
last, so a crashed or interrupted write never looks like a complete dataset.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from feedpipe.datasets.format import (
    INDEX_NAME,
    FieldSpec,
    FileInfo,
    Index,
    Layout,
    Shard,
    check_dtype,
    check_shape,
    read_index,
    write_index,
)
from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c, to_hex

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "MemmapWriter",
    "check_destination",
    "prepare_destination",
    "shard_name",
]

DEFAULT_SHARD_BYTES = 256 << 20
_TMP_MARK = ".tmp-"
# names a writer creates: shard files, their temps, and the index and its temps
_OWN_NAME = re.compile(
    r"^(index\.json|\.index\.json\..*\.tmp|\.?shard-\d{5,}\.[A-Za-z0-9_.]+(\.tmp-[0-9a-f]{8})?)$"
)


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
        if not _OWN_NAME.match(e)
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


def _dtype(value: Any) -> Any:
    """A dtype argument as :func:`check_dtype` takes it (``np.int32``, ``torch.int32``, str)."""
    if isinstance(value, (str, np.dtype)) or (
        isinstance(value, type) and issubclass(value, np.generic)
    ):
        return value
    if type(value).__module__ == "torch":  # torch.dtype: its numpy twin
        import torch

        return torch.empty(0, dtype=value).numpy().dtype
    return np.dtype(value)


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
    dtype); ``shape=None`` gives the bytes layout (each record any bytes-like object). ``fields``
    maps side-field names to a dtype or ``(dtype, shape)``. A shard is closed when its data file
    would exceed ``shard_bytes``. ``extra`` adds top-level keys to the index (e.g. ``classes``).

    >>> with MemmapWriter("out", shape=(2048,), dtype="int32", fields={"label": "int64"}) as w:
    ...     w.append(tokens, label=3)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        shape: Sequence[int] | None = None,
        dtype: Any = "uint8",
        fields: Mapping[str, Any] | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        first_shard: int = 0,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        from feedpipe import _remote

        self.path = os.fspath(path)
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        try:
            if shape is None:
                self.layout = Layout("bytes")
            else:
                dt = check_dtype(_dtype(dtype), "records")
                dims = check_shape(tuple(shape), np.dtype(dt).itemsize, "records")
                self.layout = Layout("fixed", dims, dt)
            self.fields: dict[str, FieldSpec] = {}
            for name, spec in dict(fields or {}).items():
                if not isinstance(name, str) or not name.isidentifier() or name == "data":
                    raise ValueError(f"invalid side-field name {name!r}")
                fdtype, fshape = (spec, ()) if not isinstance(spec, tuple) else spec
                fdt = check_dtype(_dtype(fdtype), f"field {name!r}")
                what = f"field {name!r}"
                self.fields[name] = FieldSpec(
                    fdt, check_shape(tuple(fshape), np.dtype(fdt).itemsize, what)
                )
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
            if self.path.startswith("file://"):
                self.path = self.path[len("file://") :]
            prepare_destination(self.path, overwrite=overwrite)
            os.makedirs(self.path, exist_ok=True)
            self._local = self.path
        self._shards: list[Shard] = []
        self._first_shard = first_shard
        self._data: _ShardFile | None = None
        self._offsets: list[int] = []
        self._columns: dict[str, list[np.ndarray]] = {}
        self._records = 0  # records in the open shard
        self.num_records = 0  # records appended in total
        self._closed = False

    # ------------------------------------------------------------------ appending
    def append(self, record: Any, **fields: Any) -> None:
        """Append one record (an array for a fixed layout, bytes-like for the bytes layout)."""
        if self.layout.kind == "fixed":
            arr = self._check_fixed(_as_array(record), self.num_records, batch=False)
            buf: Any = np.ascontiguousarray(arr)
        else:
            buf = self._check_bytes(record, self.num_records)
        cols = self._check_fields(fields, 1, self.num_records)
        self._write_records([buf], [memoryview(buf).nbytes], cols)

    def append_batch(self, records: Any, **fields: Any) -> None:
        """Append many records at once: an ``(n, *shape)`` array, or a sequence of bytes-likes."""
        first = self.num_records
        if self.layout.kind == "fixed":
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
            bufs = [self._check_bytes(r, first + i) for i, r in enumerate(records)]
            if not bufs:
                return
            cols = self._check_fields(fields, len(bufs), first)
            self._write_records(bufs, [memoryview(b).nbytes for b in bufs], cols)

    # ------------------------------------------------------------------ checks
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
        return self._data.size if self._data is not None else 0

    def _open_shard(self) -> None:
        sid = self._first_shard + len(self._shards)
        self._data = _ShardFile(self._local, shard_name(sid, "data"))
        self._offsets = [0]
        self._columns = {name: [] for name in self.fields}
        self._records = 0

    def _write_records(
        self, bufs: list[Any], sizes: list[int], cols: dict[str, np.ndarray]
    ) -> None:
        for i, (buf, size) in enumerate(zip(bufs, sizes, strict=True)):
            if self._records and self._data_size() + size > self.shard_bytes:
                self._close_shard()
            self._write_block(buf, 1, {k: v[i : i + 1] for k, v in cols.items()})

    def _write_block(self, buf: Any, n: int, cols: dict[str, np.ndarray]) -> None:
        if self._closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        if self._data is None:
            self._open_shard()
        assert self._data is not None
        self._data.write(buf)
        if self.layout.kind == "bytes":
            self._offsets.append(self._data.size)
        for name, col in cols.items():
            self._columns[name].append(col)
        self._records += n
        self.num_records += n

    def _close_shard(self) -> None:
        if self._data is None:
            return
        sid = self._first_shard + len(self._shards)
        files = {"data": self._data.finish()}
        self._data = None
        pending: list[tuple[str, str, np.ndarray]] = []
        if self.layout.kind == "bytes":
            pending.append(("offsets", "offsets", np.asarray(self._offsets, dtype="<u8")))
        for name, spec in self.fields.items():
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
