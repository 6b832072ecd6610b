"""A zarr-python store wrapper under which a missing chunk is an error, never fill values.

zarr-python reads a missing chunk (or a missing inner chunk of a shard) as the array's fill
value. For training data that is silent corruption, so :class:`ZarrDataset` reads through
:func:`strict_store`: a chunk key the store lacks raises
:class:`MissingChunkError`, and every shard index the codec loads (alone or inside a whole
shard) is checked for empty inner-chunk entries. That makes the zarr-python path as strict as
TensorStore's ``fill_missing_data_reads=False`` (stricter for shards: one missing inner chunk
fails every read of its shard).

Inner chunks that lie wholly outside the array (the tail of the last shard along an axis whose
length is not a multiple of the shard shape) are never written by zarr-python or TensorStore, so
their empty index entries are not missing: only inner chunks whose origin is inside the array are
checked (:meth:`_ShardIndexShape.stored`).

A shard index whose codecs are not ``bytes`` (+ ``crc32c``) cannot be checked; such arrays are
refused with ``backend="zarr"`` rather than read unchecked.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from feedpipe.errors import DatasetError

__all__ = ["MissingChunkError", "strict_store"]

_EMPTY = 2**64 - 1
_METADATA = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


class MissingChunkError(DatasetError):
    """A chunk (or an inner chunk of a shard) that a read needs is not stored."""


class _ShardIndexShape:
    """Where a shard's index is and how big it is, from the array's ``zarr.json``."""

    def __init__(self, meta: dict[str, Any], where: str) -> None:
        conf = meta["codecs"][0]["configuration"]
        outer = [int(o) for o in meta["chunk_grid"]["configuration"]["chunk_shape"]]
        inner = [int(i) for i in conf["chunk_shape"]]
        self.shape = [int(n) for n in meta["shape"]]
        self.outer, self.inner = outer, inner
        self.grid = [-(-o // i) for o, i in zip(outer, inner, strict=True)]
        enc = meta.get("chunk_key_encoding") or {"name": "default"}
        self.v2 = enc.get("name") == "v2"
        self.sep = (enc.get("configuration") or {}).get("separator", "." if self.v2 else "/")
        names = [c["name"] for c in conf.get("index_codecs", [])]
        if names not in (["bytes"], ["bytes", "crc32c"]) or any(
            c.get("configuration", {}).get("endian", "little") != "little"
            for c in conf["index_codecs"]
            if c["name"] == "bytes"
        ):
            raise DatasetError(
                f"{where}: shard index codecs {names} cannot be checked for missing chunks; "
                "read it with backend='tensorstore'"
            )
        self.nchunks = math.prod(self.grid)
        self.size = self.nchunks * 16 + (4 if names[-1] == "crc32c" else 0)
        self.at_end = conf.get("index_location", "end") == "end"

    def check(self, blob: bytes, key: str, where: str) -> None:
        """Raise if the index in ``blob`` (an index, or a whole shard) lists an empty chunk."""
        raw = blob[-self.size :] if self.at_end else blob[: self.size]
        if len(raw) != self.size:
            raise DatasetError(f"{where}/{key}: shard is truncated (no complete shard index)")
        entries = np.frombuffer(raw[: self.nchunks * 16], "<u8").reshape(-1, 2)
        inside = self.stored(key)
        empty = np.flatnonzero((entries[:, 0] == _EMPTY) & inside)
        if empty.size:
            raise MissingChunkError(
                f"{where}/{key}: {empty.size} of {int(inside.sum())} inner chunks are missing "
                f"(first: inner chunk {int(empty[0])}); feedpipe never reads missing chunks as "
                "fill values (write with write_empty_chunks=True)"
            )

    def stored(self, key: str) -> np.ndarray:
        """Which inner chunks of shard ``key`` (C order, as in its index) start inside the
        array: the others are never written. All of them when ``key`` does not parse."""
        coords = self._coords(key)
        if coords is None:
            return np.ones(self.nchunks, bool)
        inside = np.ones((), bool)
        for c, n, o, i, g in zip(
            coords, self.shape, self.outer, self.inner, self.grid, strict=True
        ):
            inside = np.multiply.outer(inside, c * o + np.arange(g) * i < n)
        return inside.reshape(-1)

    def _coords(self, key: str) -> list[int] | None:
        """Shard ``key``'s grid coordinates (``c/1/0``, ``c.1.0``, v2's ``1.0``), else None."""
        if self.v2:
            parts = key.split(self.sep)
        else:
            head, _, rest = key.partition(self.sep)
            parts = rest.split(self.sep) if head == "c" else []
        if len(parts) != len(self.shape) or not all(p.isdigit() for p in parts):
            return None
        return [int(p) for p in parts]


class _StrictStore(WrapperStore[Any]):
    def __init__(self, store: Any, where: str, shards: _ShardIndexShape | None) -> None:
        super().__init__(store)
        self._where, self._shards = where, shards

    def _with_store(self, store: Any) -> _StrictStore:
        return type(self)(store, self._where, self._shards)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        buf: Buffer | None = await self._store.get(key, prototype, byte_range)
        if key.endswith(_METADATA):
            return buf
        if buf is None:
            raise MissingChunkError(
                f"{self._where}/{key}: chunk is missing; feedpipe never reads missing chunks as "
                "fill values (write with write_empty_chunks=True)"
            )
        shards = self._shards
        if shards is not None and (
            byte_range is None
            or (isinstance(byte_range, SuffixByteRequest) and byte_range.suffix == shards.size)
            or (
                isinstance(byte_range, RangeByteRequest)
                and (byte_range.start, byte_range.end) == (0, shards.size)
                and not shards.at_end
            )
        ):
            shards.check(buf.to_bytes(), key, self._where)
        return buf


def strict_store(store: Any, meta: dict[str, Any], where: str) -> Any:
    """Wrap the zarr store of the one array whose ``zarr.json`` is ``meta``."""
    try:
        codecs: Any = meta.get("codecs")
        sharded = bool(codecs) and codecs[0].get("name") == "sharding_indexed"
        shards = _ShardIndexShape(meta, where) if sharded else None
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, IndexError) as exc:
        raise DatasetError(f"{where}/zarr.json: malformed sharding codec: {exc}") from None
    return _StrictStore(store, where, shards)
