"""A zarr-python store wrapper under which a missing chunk is an error, never fill values.

zarr-python reads a missing chunk (or a missing inner chunk of a shard) as the array's fill
value. For training data that is silent corruption, so :class:`ZarrDataset` reads through
:func:`strict_store`: a chunk key the store lacks raises
:class:`MissingChunkError`, and every shard index the codec loads (alone or inside a whole
shard) is checked for empty inner-chunk entries. That makes the zarr-python path as strict as
TensorStore's ``fill_missing_data_reads=False`` (stricter for shards: one missing inner chunk
fails every read of its shard).

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
        outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
        inner = conf["chunk_shape"]
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
        self.nchunks = math.prod(-(-int(o) // int(i)) for o, i in zip(outer, inner, strict=True))
        self.size = self.nchunks * 16 + (4 if names[-1] == "crc32c" else 0)
        self.at_end = conf.get("index_location", "end") == "end"

    def check(self, blob: bytes, key: str, where: str) -> None:
        """Raise if the index in ``blob`` (an index, or a whole shard) lists an empty chunk."""
        raw = blob[-self.size :] if self.at_end else blob[: self.size]
        if len(raw) != self.size:
            raise DatasetError(f"{where}/{key}: shard is truncated (no complete shard index)")
        entries = np.frombuffer(raw[: self.nchunks * 16], "<u8").reshape(-1, 2)
        empty = np.flatnonzero(entries[:, 0] == _EMPTY)
        if empty.size:
            raise MissingChunkError(
                f"{where}/{key}: {empty.size} of {self.nchunks} inner chunks are missing "
                f"(first: inner chunk {int(empty[0])}); feedpipe never reads missing chunks as "
                "fill values (write with write_empty_chunks=True)"
            )


class _StrictStore(WrapperStore[Any]):
    def __init__(self, store: Any, where: str, shards: _ShardIndexShape | None) -> None:
        super().__init__(store)
        self._where, self._shards = where, shards

    def _with_store(self, store: Any) -> _StrictStore:
        return type(self)(store, self._where, self._shards)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        buf = await self._store.get(key, prototype, byte_range)
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
