"""The dataset index (``index.json``): a typed view of the on-disk format, validated on load.

A dataset is a directory holding ``index.json`` (written last, atomically) and shard files::

    {"format": "feedpipe.memmap", "version": 1,
     "layout": {"kind": "fixed", "shape": [2048], "dtype": "int32"},   # or {"kind": "bytes"}
     "fields": {"label": {"dtype": "int64", "shape": []}},
     "num_records": 1000,
     "shards": [{"records": 500, "files": {
         "data": {"path": "shard-00000.data", "bytes": 4096000, "crc32c": "1a2b3c4d"},
         "offsets": {...},          # bytes layout only: (records + 1) uint64 offsets
         "field.label": {...}}}]}

Extra top-level keys (e.g. ``"classes"``) are kept in :attr:`Index.extra` and written back.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from feedpipe.errors import DatasetError

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "VERSION",
    "FieldSpec",
    "FileInfo",
    "Index",
    "Layout",
    "Shard",
    "read_index",
    "write_index",
]

FORMAT = "feedpipe.memmap"
VERSION = 1
INDEX_NAME = "index.json"
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_CORE_KEYS = {"format", "version", "layout", "fields", "num_records", "shards"}


@dataclass(frozen=True)
class Layout:
    """Record layout: ``fixed`` (``shape``, ``dtype``) or ``bytes`` (variable-length records)."""

    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"

    @property
    def record_bytes(self) -> int:
        """Bytes per record of a fixed layout (0 for the bytes layout)."""
        if self.kind != "fixed":
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        if self.kind == "bytes":
            return {"kind": "bytes"}
        return {"kind": "fixed", "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class FieldSpec:
    """A side field stored column-wise: one ``dtype``/``shape`` value per record."""

    dtype: str
    shape: tuple[int, ...] = ()

    @property
    def record_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


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
            "version": self.version,
            "layout": self.layout.to_json(),
            "fields": {
                n: {"dtype": f.dtype, "shape": list(f.shape)} for n, f in self.fields.items()
            },
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
        if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
            fmt = doc.get("format") if isinstance(doc, Mapping) else None
            raise DatasetError(f"{source}: not a feedpipe dataset index (format={fmt!r})")
        version = doc.get("version")
        if version != VERSION:
            raise DatasetError(f"{source}: unsupported index version {version!r} (expected 1)")
        try:
            layout = _parse_layout(doc["layout"])
            fields = {
                str(n): FieldSpec(
                    str(np.dtype(f["dtype"])), tuple(int(d) for d in f.get("shape", []))
                )
                for n, f in dict(doc.get("fields") or {}).items()
            }
            shards = [_parse_shard(s, i, source) for i, s in enumerate(doc["shards"])]
            declared = int(doc["num_records"])
        except DatasetError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{source}: malformed index: {type(exc).__name__}: {exc}") from None
        index = cls(layout, fields, shards, {k: v for k, v in doc.items() if k not in _CORE_KEYS})
        if index.num_records != declared:
            raise DatasetError(
                f"{source}: num_records is {declared} but the shards hold {index.num_records}"
            )
        for shard_id, shard in enumerate(shards):
            needed = ["data", *(f"field.{n}" for n in fields)]
            if layout.kind == "bytes":
                needed.append("offsets")
            for role in needed:
                if role not in shard.files:
                    raise DatasetError(f"{source}: shard {shard_id} lists no {role!r} file")
            _check_sizes(index, shard_id, source)
        return index


def _parse_layout(doc: Mapping[str, Any]) -> Layout:
    kind = doc["kind"]
    if kind == "bytes":
        return Layout("bytes")
    if kind != "fixed":
        raise ValueError(f"unknown layout kind {kind!r}")
    shape = tuple(int(d) for d in doc["shape"])
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return Layout("fixed", shape, str(np.dtype(doc["dtype"])))


def _parse_shard(doc: Mapping[str, Any], shard_id: int, source: str) -> Shard:
    records = int(doc["records"])
    if records < 0:
        raise DatasetError(f"{source}: shard {shard_id} has a negative record count")
    files: dict[str, FileInfo] = {}
    for role, f in dict(doc["files"]).items():
        path = str(f["path"])
        parts = path.split("/")
        if not path or path.startswith("/") or "\\" in path or ".." in parts or ":" in parts[0]:
            raise DatasetError(f"{source}: shard {shard_id} file path {path!r} escapes the dataset")
        crc = str(f["crc32c"]).lower()
        if not _HEX8.match(crc):
            raise DatasetError(f"{source}: shard {shard_id} file {path!r} has a bad crc32c {crc!r}")
        nbytes = int(f["bytes"])
        if nbytes < 0:
            raise DatasetError(f"{source}: shard {shard_id} file {path!r} has a negative size")
        files[str(role)] = FileInfo(path, nbytes, crc)
    return Shard(records, files)


def _check_sizes(index: Index, shard_id: int, source: str) -> None:
    """The listed sizes must agree with the record count (a cheap consistency check)."""
    shard = index.shards[shard_id]
    expect: dict[str, int] = {
        f"field.{n}": shard.records * f.record_bytes for n, f in index.fields.items()
    }
    if index.layout.kind == "fixed":
        expect["data"] = shard.records * index.layout.record_bytes
    else:
        expect["offsets"] = (shard.records + 1) * 8
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
            with open(name, "rb") as f:
                raw = f.read()
        else:
            raw = fs.cat_file(name)
    except FileNotFoundError:
        raise DatasetError(f"{root}: not a feedpipe dataset (no {INDEX_NAME})") from None
    except NotADirectoryError:
        raise DatasetError(f"{root}: not a feedpipe dataset (not a directory)") from None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise DatasetError(f"{name}: index is not valid JSON: {exc}") from None
    return Index.from_json(doc, name)


def write_index(directory: str | os.PathLike[str], index: Index) -> str:
    """Write ``index.json`` atomically (temp name, fsync, rename); return its path."""
    root = os.fspath(directory)
    final = os.path.join(root, INDEX_NAME)
    tmp = os.path.join(root, f".{INDEX_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    data = json.dumps(index.to_json(), indent=1).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
