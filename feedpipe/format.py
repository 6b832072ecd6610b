"""The dataset index (``index.json``): a typed view of the on-disk format, validated on load.

A dataset is a directory holding ``index.json`` (written last, atomically) and shard files::

    {"format": "feedpipe.memmap", "version": 1,
     "layout": {"kind": "fixed", "shape": [2048], "dtype": "int32"},   # or {"kind": "bytes"}
     "fields": {"label": {"dtype": "int64", "shape": []}},
     # version 2 adds typed columns: {"kind": "str"}, {"kind": "json"} and variable-length
     # arrays {"kind": "ragged", "dtype": "int32", "shape": [null]} (fields and layout), and
     # the layout {"kind": "none"} (records that are only fields)
     "num_records": 1000,
     "shards": [{"records": 500, "files": {
         "data": {"path": "shard-00000.data", "bytes": 4096000, "crc32c": "1a2b3c4d"},
         "offsets": {...},          # bytes layout only: (records + 1) uint64 offsets
         "field.label": {...},
         "field.text": {...}, "field.text.offsets": {...}}}]}   # a variable-length field

A variable-length column (the bytes and ragged layouts, and ``str``, ``json`` and ragged
fields) is a data file plus an offsets file of ``records + 1`` little-endian uint64 byte
offsets into it (:mod:`feedpipe.datasets.columns`).

Extra top-level keys (e.g. ``"classes"``) are kept in :attr:`Index.extra` and written back.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from feedpipe.errors import DatasetError
from feedpipe.io.fsutil import atomic_write
from feedpipe.io.ownership import is_marker_name

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "MAX_BYTES",
    "VARIABLE_KINDS",
    "VERSION",
    "VERSIONS",
    "FieldSpec",
    "FileInfo",
    "Index",
    "Layout",
    "Shard",
    "check_dtype",
    "check_field_names",
    "check_shape",
    "column_roles",
    "parse_index",
    "parse_ragged_shape",
    "read_index",
    "write_index",
]

FORMAT = "feedpipe.memmap"
VERSION = 1
VERSIONS = (1, 2)  # version 2: typed columns (written only when a dataset uses one)
INDEX_NAME = "index.json"
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_CORE_KEYS = {"format", "version", "layout", "fields", "num_records", "shards"}
MAX_BYTES = 1 << 62  # no record, field or file may be larger: offsets stay within int64
_DTYPE_KINDS = "biufc"  # what torch.from_numpy reads: bool, ints, floats, complex
VARIABLE_KINDS = ("ragged", "str", "json")  # columns stored as a data file plus offsets


def check_dtype(dtype: Any, what: str) -> str:
    """``dtype`` as a canonical numpy name if torch can read it; else ``ValueError``."""
    if isinstance(dtype, np.dtype):
        dt = dtype
    elif isinstance(dtype, str) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise ValueError(f"{what}: unknown dtype {dtype!r}") from exc
    else:
        raise ValueError(f"{what}: dtype must be a string, got {type(dtype).__name__}")
    if dt.kind not in _DTYPE_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(
            f"{what}: dtype {dt} cannot be read as a tensor (bool, integer, float or complex only)"
        )
    if not dt.isnative and dt.itemsize > 1:
        native = dt.newbyteorder("=").str
        raise ValueError(f"{what}: dtype {dt.str} is not native byte order (use {native})")
    return str(dt)


def check_shape(shape: Any, itemsize: int, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints whose bytes fit :data:`MAX_BYTES`."""
    if not isinstance(shape, (list, tuple)) or not all(_is_int(d) for d in shape):
        raise ValueError(f"{what}: shape must be a list of integers, got {shape!r}")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"{what}: negative dimension in shape {list(dims)}")
    if math.prod(dims) * itemsize > MAX_BYTES:
        raise ValueError(f"{what}: shape {list(dims)} is too large ({itemsize}-byte items)")
    return dims


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int(value: Any, what: str, limit: int = MAX_BYTES) -> int:
    """A JSON integer in ``0..limit``; anything else (bool, float, string) is a ``ValueError``."""
    if not _is_int(value) or not 0 <= int(value) <= limit:
        raise ValueError(f"{what} must be an integer in 0..{limit}, got {value!r}")
    return int(value)


class _ArrayColumn:
    """What a records layout and a side field share: a ``kind``, an element ``dtype`` and a
    ``shape`` (of each record, ``fixed``; of each row of the varying first dimension,
    ``ragged``). The subclasses differ only in their constructor order and JSON key order,
    both part of the public API and the on-disk format (docs/formats.md)."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    _ragged_keys: ClassVar[tuple[str, str, str]]  # the key order of a ragged column's JSON
    _fixed_keys: ClassVar[tuple[str, ...]]  # ... and of a fixed one's

    @property
    def record_bytes(self) -> int:
        """Bytes per record of a fixed column (0 for the other kinds)."""
        return self.row_bytes if self.kind == "fixed" else 0

    @property
    def row_bytes(self) -> int:
        """Bytes per record (fixed) or per row of the varying dimension (ragged); 1 for the
        byte kinds (``bytes``, ``str``, ``json``)."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        if self.kind not in ("fixed", "ragged"):
            return {"kind": self.kind}
        shape = [None, *self.shape] if self.kind == "ragged" else list(self.shape)
        values = {"kind": self.kind, "shape": shape, "dtype": self.dtype}
        keys = self._ragged_keys if self.kind == "ragged" else self._fixed_keys
        return {k: values[k] for k in keys}


@dataclass(frozen=True)
class Layout(_ArrayColumn):
    """Record layout: ``fixed`` (``shape``, ``dtype``), ``bytes`` (variable-length records),
    ``ragged`` (arrays of ``dtype`` whose first dimension varies; ``shape`` holds the others)
    or ``none`` (no records column: a record is its fields)."""

    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"
    _ragged_keys: ClassVar[tuple[str, str, str]] = ("kind", "shape", "dtype")
    _fixed_keys: ClassVar[tuple[str, ...]] = ("kind", "shape", "dtype")

    @property
    def has_offsets(self) -> bool:
        """Whether the records column is variable-length (a data file plus offsets)."""
        return self.kind in ("bytes", "ragged")


@dataclass(frozen=True)
class FieldSpec(_ArrayColumn):
    """A side field stored column-wise. ``kind`` ``fixed``: one ``dtype``/``shape`` value per
    record; ``ragged``: an array of ``dtype`` per record whose first dimension varies
    (``shape`` holds the others); ``str``: a UTF-8 string; ``json``: any JSON value."""

    dtype: str
    shape: tuple[int, ...] = ()
    kind: str = "fixed"
    _ragged_keys: ClassVar[tuple[str, str, str]] = ("kind", "dtype", "shape")
    _fixed_keys: ClassVar[tuple[str, ...]] = ("dtype", "shape")  # no "kind": the default


@dataclass(frozen=True)
class FileInfo:
    """One file of a shard: dataset-relative posix path, size and CRC32C (8 hex digits)."""

    path: str
    bytes: int
    crc32c: str


@dataclass(frozen=True)
class Shard:
    """One shard: its record count and files by role (``data``, ``offsets``, ``field.NAME``)."""

    records: int
    files: dict[str, FileInfo]


@dataclass
class Index:
    """A parsed, validated ``index.json``."""

    layout: Layout
    fields: dict[str, FieldSpec]
    shards: list[Shard]
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    @property
    def num_records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def needed_version(self) -> int:
        """2 when the dataset uses a typed column (readers of version 1 cannot read it)."""
        typed = self.layout.kind in ("ragged", "none")
        return 2 if typed or any(f.kind != "fixed" for f in self.fields.values()) else 1

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for s in self.shards for f in s.files.values())

    def files(self) -> Iterator[tuple[int, str, int, str]]:
        """Yield ``(shard_id, relpath, nbytes, crc32c_hex)`` for every file of the dataset."""
        for shard_id, shard in enumerate(self.shards):
            for info in shard.files.values():
                yield shard_id, info.path, info.bytes, info.crc32c

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": max(self.version, self.needed_version),
            "layout": self.layout.to_json(),
            "fields": {n: f.to_json() for n, f in self.fields.items()},
            "num_records": self.num_records,
            "shards": [
                {
                    "records": s.records,
                    "files": {
                        role: {"path": f.path, "bytes": f.bytes, "crc32c": f.crc32c}
                        for role, f in s.files.items()
                    },
                }
                for s in self.shards
            ],
        }
        doc.update({k: v for k, v in self.extra.items() if k not in _CORE_KEYS})
        return doc

    @classmethod
    def from_json(cls, doc: Any, source: str = "index.json") -> Index:
        """Parse and validate; every problem raises :class:`DatasetError` naming ``source``."""
        version = _check_header(doc, source)
        try:
            layout, fields, shards, declared = _parse_body(doc, source)
        except DatasetError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise DatasetError(f"{source}: malformed index: {type(exc).__name__}: {exc}") from None
        extra = {k: v for k, v in doc.items() if k not in _CORE_KEYS}
        index = cls(layout, fields, shards, extra, version)
        _check_index(index, declared, source)
        return index


def _check_header(doc: Any, source: str) -> int:
    """The index's format and version, checked; returns the version."""
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        fmt = doc.get("format") if isinstance(doc, Mapping) else None
        raise DatasetError(f"{source}: not a feedpipe dataset index (format={fmt!r})")
    version = doc.get("version")
    if version not in VERSIONS or isinstance(version, bool):
        raise DatasetError(
            f"{source}: unsupported index version {version!r} (expected 1 or 2; "
            "a newer feedpipe wrote it?)"
        )
    checked: int = version  # as written (1.0 is 1 to Python, and stays as written)
    return checked


def _parse_body(
    doc: Mapping[str, Any], source: str
) -> tuple[Layout, dict[str, FieldSpec], list[Shard], int]:
    """Layout, fields, shards and the declared record count (``KeyError``, ``ValueError``...
    for anything malformed)."""
    layout = _parse_layout(doc["layout"])
    fields = _parse_fields(doc.get("fields", {}))
    check_field_names(layout, fields)
    if not isinstance(doc["shards"], list):
        raise ValueError("'shards' must be a list")
    shards = [_parse_shard(s, i, source) for i, s in enumerate(doc["shards"])]
    declared = _int(doc["num_records"], "num_records")
    classes = doc.get("classes")
    if classes is not None and not (
        isinstance(classes, list) and all(isinstance(c, str) for c in classes)
    ):
        raise ValueError("'classes' must be a list of strings")
    return layout, fields, shards, declared


def _check_index(index: Index, declared: int, source: str) -> None:
    """What only the whole index can tell: the version its columns need, the record count,
    every shard's files and their sizes."""
    if index.needed_version > index.version:
        raise DatasetError(
            f"{source}: version {index.version} index uses typed columns (a version 2 feature)"
        )
    if index.num_records != declared:
        raise DatasetError(
            f"{source}: num_records is {declared} but the shards hold {index.num_records}"
        )
    needed = [*column_roles(index.layout, index.fields)]
    for shard_id, shard in enumerate(index.shards):
        for role in needed:
            if role not in shard.files:
                raise DatasetError(f"{source}: shard {shard_id} lists no {role!r} file")
        _check_sizes(index, shard_id, source)


def column_roles(layout: Layout, fields: Mapping[str, FieldSpec]) -> Iterator[str]:
    """The file roles every shard of this layout and these fields must list."""
    if layout.kind != "none":
        yield "data"
    if layout.has_offsets:
        yield "offsets"
    for name, spec in fields.items():
        yield f"field.{name}"
        if spec.kind in VARIABLE_KINDS:
            yield f"field.{name}.offsets"


def check_field_names(layout: Layout, fields: Mapping[str, FieldSpec]) -> None:
    """Refuse field names that would clash with a file or a batch key, and columns no read
    can serve (:func:`_check_widths`): a ``ValueError`` naming the field. The writer (at
    write time) and :meth:`Index.from_json` (on open) both call it."""
    for name in fields:
        if not isinstance(name, str) or not name.isidentifier() or name == "data":
            raise ValueError(f"invalid side-field name {name!r}")
        if name == "offsets" and layout.has_offsets:
            raise ValueError("a side field cannot be called 'offsets' (the records' offsets file)")
    ragged = [n for n, f in fields.items() if f.kind == "ragged"]
    if layout.kind == "ragged":
        ragged.append("data")
    for name in ragged:
        if f"{name}_lengths" in fields:
            raise ValueError(
                f"side field {name}_lengths clashes with the lengths of ragged column {name!r}"
            )
    if layout.kind == "none" and not fields:
        raise ValueError("the 'none' layout needs at least one field")
    _check_widths(layout, fields)


def _check_widths(layout: Layout, fields: Mapping[str, FieldSpec]) -> None:
    """Every array column's record (fixed) or row (ragged) holds at least one byte. A ragged
    row of zero bytes (``(None, 0)``) stores every record as zero bytes, so how many rows a
    record has cannot be read back; a zero-byte fixed record cannot be mapped or indexed."""
    columns = [("records", layout), *((f"field {n!r}", f) for n, f in fields.items())]
    for what, col in columns:
        if col.kind not in ("fixed", "ragged") or col.row_bytes:
            continue
        shape = [None, *col.shape] if col.kind == "ragged" else list(col.shape)
        unit = "row" if col.kind == "ragged" else "record"
        raise ValueError(
            f"{what}: shape {tuple(shape)} gives each {unit} zero bytes, which no read can "
            f"serve; give each {unit} at least one element"
        )


def parse_ragged_shape(shape: Any, dtype: str, what: str) -> tuple[int, ...] | None:
    """``(None, *rest)`` -> ``rest`` checked (a ragged column); a fixed shape -> ``None``."""
    if isinstance(shape, (list, tuple)) and len(shape) >= 1 and shape[0] is None:
        return check_shape(list(shape[1:]), np.dtype(dtype).itemsize, what)
    return None


def _parse_layout(doc: Any) -> Layout:
    if not isinstance(doc, Mapping):
        raise ValueError("'layout' must be an object")
    kind = doc["kind"]
    if kind in ("bytes", "none"):
        return Layout(kind)
    if kind not in ("fixed", "ragged"):
        raise ValueError(f"unknown layout kind {kind!r}")
    dtype = check_dtype(doc["dtype"], "layout")
    if kind == "ragged":
        rest = parse_ragged_shape(doc["shape"], dtype, "layout")
        if rest is None:
            raise ValueError(f"a ragged layout's shape must start with null, got {doc['shape']!r}")
        return Layout("ragged", rest, dtype)
    return Layout("fixed", check_shape(doc["shape"], np.dtype(dtype).itemsize, "layout"), dtype)


def _parse_fields(doc: Any) -> dict[str, FieldSpec]:
    if not isinstance(doc, Mapping):
        raise ValueError("'fields' must be an object")
    fields = {}
    for name, f in doc.items():
        if not isinstance(name, str) or not name.isidentifier() or name == "data":
            raise ValueError(f"invalid side-field name {name!r}")
        if not isinstance(f, Mapping):
            raise ValueError(f"field {name!r} must be an object")
        kind = f.get("kind", "fixed")
        if kind in ("str", "json"):
            fields[name] = FieldSpec("uint8", (), kind)
            continue
        if kind not in ("fixed", "ragged"):
            raise ValueError(f"field {name!r}: unknown kind {kind!r}")
        dtype = check_dtype(f["dtype"], f"field {name!r}")
        if kind == "ragged":
            rest = parse_ragged_shape(f["shape"], dtype, f"field {name!r}")
            if rest is None:
                raise ValueError(f"field {name!r}: a ragged shape must start with null")
            fields[name] = FieldSpec(dtype, rest, "ragged")
            continue
        shape = check_shape(f.get("shape", []), np.dtype(dtype).itemsize, f"field {name!r}")
        fields[name] = FieldSpec(dtype, shape)
    return fields


def _parse_shard(doc: Any, shard_id: int, source: str) -> Shard:
    if not isinstance(doc, Mapping) or not isinstance(doc["files"], Mapping):
        raise ValueError(f"shard {shard_id} must be an object with a 'files' object")
    records = _int(doc["records"], f"shard {shard_id} records")
    files: dict[str, FileInfo] = {}
    for role, f in doc["files"].items():
        if not isinstance(f, Mapping) or not isinstance(f["path"], str):
            raise ValueError(f"shard {shard_id} file {role!r} must be an object with a 'path'")
        path = f["path"]
        _check_file_path(path, shard_id, source)
        crc = f["crc32c"]
        if not isinstance(crc, str) or not _HEX8.match(crc.lower()):
            raise DatasetError(f"{source}: shard {shard_id} file {path!r} has a bad crc32c {crc!r}")
        nbytes = _int(f["bytes"], f"shard {shard_id} file {path!r} bytes")
        files[str(role)] = FileInfo(path, nbytes, crc.lower())
    return Shard(records, files)


def _check_file_path(path: str, shard_id: int, source: str) -> None:
    """A shard file's path: inside the dataset, and not a name the dataset keeps for itself."""
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or ".." in parts or ":" in parts[0]:
        raise DatasetError(f"{source}: shard {shard_id} file path {path!r} escapes the dataset")
    if path == INDEX_NAME or any(p in ("", ".") or is_marker_name(p) for p in parts):
        raise DatasetError(
            f"{source}: shard {shard_id} file path {path!r} is not a valid dataset file name "
            f"(an empty or '.' component, {INDEX_NAME!r}, or an ownership marker's name "
            "'.TOOL-owner.json', which stage, convert and the cache keep for their own)"
        )


def _check_sizes(index: Index, shard_id: int, source: str) -> None:
    """The listed sizes must agree with the record count (a cheap consistency check)."""
    shard = index.shards[shard_id]
    expect: dict[str, int] = {}
    rows: dict[str, int] = {}  # variable-length data files hold whole rows
    for n, f in index.fields.items():
        if f.kind in VARIABLE_KINDS:
            expect[f"field.{n}.offsets"] = (shard.records + 1) * 8
            rows[f"field.{n}"] = f.row_bytes
        else:
            expect[f"field.{n}"] = shard.records * f.record_bytes
    if index.layout.kind == "fixed":
        expect["data"] = shard.records * index.layout.record_bytes
    elif index.layout.has_offsets:
        expect["offsets"] = (shard.records + 1) * 8
        rows["data"] = index.layout.row_bytes
    for role, row in rows.items():
        info = shard.files[role]
        if row and info.bytes % row:
            raise DatasetError(
                f"{source}: shard {shard_id} file {info.path!r} is listed with {info.bytes} bytes, "
                f"not a whole number of {row}-byte rows"
            )
    for role, nbytes in expect.items():
        info = shard.files[role]
        if info.bytes != nbytes:
            raise DatasetError(
                f"{source}: shard {shard_id} file {info.path!r} is listed with {info.bytes} bytes "
                f"but {shard.records} records need {nbytes}"
            )


def read_index(path_or_url: str | os.PathLike[str], fs: Any = None) -> Index:
    """Read ``index.json`` from a dataset directory (local path, or any path of fsspec ``fs``)."""
    root = os.fspath(path_or_url).rstrip("/")
    name = f"{root}/{INDEX_NAME}"
    try:
        if fs is None:
            if os.path.isfile(root):  # allow pointing at the index itself
                name = root
            raw = _read_local(name)
        else:
            raw = fs.cat_file(name)
    except FileNotFoundError:
        raise DatasetError(f"{root}: not a feedpipe dataset (no {INDEX_NAME})") from None
    except NotADirectoryError:
        raise DatasetError(f"{root}: not a feedpipe dataset (not a directory)") from None
    except IsADirectoryError:
        raise DatasetError(f"{root}: not a feedpipe dataset ({INDEX_NAME} is a folder)") from None
    return parse_index(raw, name)


def _read_local(name: str) -> bytes:
    """The bytes of the local file ``name``: non-blocking, so a FIFO planted there is refused
    (a :class:`DatasetError` naming it), never waited on."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(name)
        if not stat.S_ISREG(mode):
            raise DatasetError(f"{name}: not a regular file; refusing to read it as an index")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def parse_index(raw: bytes | str, source: str) -> Index:
    """Parse and validate ``index.json`` bytes; any problem is a :class:`DatasetError`."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise DatasetError(f"{source}: index is not valid JSON: {why}") from None
    return Index.from_json(doc, source)


def write_index(directory: str | os.PathLike[str], index: Index) -> str:
    """Write ``index.json`` atomically and durably (:func:`feedpipe.io.fsutil.atomic_write`);
    return its path."""
    final = os.path.join(os.fspath(directory), INDEX_NAME)
    atomic_write(final, json.dumps(index.to_json(), indent=1).encode())
    return final
