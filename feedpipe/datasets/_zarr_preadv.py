"""Byte-range reads of an *uncompressed* Zarr v3 array whose chunks hold whole records.

Such chunks (a lone ``bytes`` codec, or ``sharding_indexed`` with only ``bytes`` inside) are
plain C-order rows, so a record is one ``preadv`` (or one row of a map) at an address taken
from the chunk grid and the shard index (its CRC32C checked). A storage engine's per-chunk
overhead would otherwise dominate when every record is its own chunk.
:meth:`PreadvReader.plan` says whether an array qualifies; anything else goes through
TensorStore / zarr-python (:mod:`feedpipe.datasets.zarr`).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import Any

import numpy as np

from feedpipe.datasets._gather import ROW_COPY_MIN, inverse, scratch
from feedpipe.errors import DatasetError
from feedpipe.io.fsutil import readinto_exactly

__all__ = ["PreadvReader"]

_MISSING = np.uint64(2**64 - 1)


class PreadvReader:
    """Reads of records of one qualifying array under ``root`` (see the module docstring):
    ``meta`` is its ``zarr.json``, ``shape`` its shape. Open files and maps are per process."""

    def __init__(self, root: str, meta: dict[str, Any], shape: tuple[int, ...]) -> None:
        self.root, self.meta, self.shape = root, meta, shape
        self.dtype = np.dtype(meta["data_type"])
        self.row = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.outer = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        enc = meta.get("chunk_key_encoding", {"name": "default"})
        default = enc["name"] == "default"
        self._sep: str = enc.get("configuration", {}).get("separator", "/" if default else ".")
        self._prefix = "c" + self._sep if default else ""  # v2 keys have no "c"
        codec = meta["codecs"][0]
        self.sharded = codec["name"] == "sharding_indexed"
        if self.sharded:
            conf = codec["configuration"]
            self.inner = int(conf["chunk_shape"][0])
            self.nchunks = -(-self.outer // self.inner)
            self.index_at_end = conf.get("index_location", "end") == "end"
            self.index_crc = any(c["name"] == "crc32c" for c in conf["index_codecs"])
        self.pid = -1
        self.fds: dict[int, int] = {}
        self.indexes: dict[int, np.ndarray] = {}
        self.maps: dict[int, np.ndarray] = {}
        self.addrs: dict[int, tuple[np.ndarray, bool]] = {}
        self._tls = threading.local()  # per-thread scratch for gathers spanning shards

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt from its plan: open files, maps and the scratch stay behind
        return (PreadvReader, (self.root, self.meta, self.shape))

    def _key(self, k: int) -> str:
        """The store key of chunk (or shard) ``k`` along the sample axis."""
        tail = [0] * (len(self.shape) - 1)
        return self._prefix + self._sep.join(map(str, [k, *tail]))

    @staticmethod
    def plan(root: str, meta: dict[str, Any], shape: tuple[int, ...]) -> PreadvReader | None:
        """A preadv reader if the layout qualifies, else None."""
        try:
            dtype = np.dtype(meta["data_type"])
            grid = meta["chunk_grid"]
            codecs = meta["codecs"]
            if dtype.kind not in "biufc" or grid["name"] != "regular" or len(codecs) != 1:
                return None
            if int(grid["configuration"]["chunk_shape"][0]) <= 0:
                return None
            if list(grid["configuration"]["chunk_shape"][1:]) != list(shape[1:]):
                return None

            def plain(cs: list[dict[str, Any]]) -> bool:
                if len(cs) != 1 or cs[0]["name"] != "bytes":
                    return False
                endian = cs[0].get("configuration", {}).get("endian", "little")
                return bool(dtype.itemsize == 1 or endian == "little")

            codec = codecs[0]
            if codec["name"] == "sharding_indexed":
                conf = codec["configuration"]
                ok_index = [c["name"] for c in conf["index_codecs"]] in (
                    ["bytes"],
                    ["bytes", "crc32c"],
                )
                if not (plain(conf["codecs"]) and ok_index):
                    return None
                if list(conf["chunk_shape"][1:]) != list(shape[1:]) or conf["chunk_shape"][0] <= 0:
                    return None
            elif not plain(codecs):
                return None
            if meta.get("chunk_key_encoding", {"name": "default"})["name"] not in ("default", "v2"):
                return None
            return PreadvReader(root, meta, shape)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError):
            return None

    def _fd(self, k: int) -> int:
        if self.pid != os.getpid():
            self.pid, self.fds, self.indexes, self.maps = os.getpid(), {}, {}, {}
            self.addrs = {}
        fd = self.fds.get(k)
        if fd is None:
            path = os.path.join(self.root, self._key(k))
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise DatasetError(
                    f"{path}: chunk/shard file is missing (records from {k * self.outer})"
                ) from None
            self.fds[k] = fd
        return fd

    def _index(self, k: int) -> np.ndarray:
        idx = self.indexes.get(k)
        if idx is None:
            fd = self._fd(k)
            path = os.path.join(self.root, self._key(k))
            nbytes = self.nchunks * 16 + (4 if self.index_crc else 0)
            size = os.fstat(fd).st_size
            raw = os.pread(fd, nbytes, size - nbytes if self.index_at_end else 0)
            if len(raw) != nbytes or size < nbytes:
                raise DatasetError(f"{path}: shard is truncated (no complete shard index)")
            body = raw[: self.nchunks * 16]
            if self.index_crc:
                from feedpipe.io.crc import crc32c

                if crc32c(body) != int.from_bytes(raw[-4:], "little"):
                    raise DatasetError(f"{path}: shard index fails its CRC32C check")
            idx = np.frombuffer(body, dtype="<u8").reshape(-1, 2)
            self.indexes[k] = idx
        return idx

    def _addr(self, k: int) -> tuple[np.ndarray, bool]:
        """Shard ``k``'s per-record byte addresses (-1: chunk missing or not stored plain), and
        whether every record starts on a row boundary (then it can be gathered from the map)."""
        got = self.addrs.get(k)
        if got is None:
            entries = self._index(k)
            ok = (entries[:, 0] != _MISSING) & (entries[:, 1] == self.inner * self.row)
            start = np.where(ok, entries[:, 0], 0).astype(np.int64)
            within = np.arange(self.inner, dtype=np.int64) * self.row
            addr = (start[:, None] + within[None, :]).reshape(-1)[: self.outer].copy()
            addr[np.repeat(~ok, self.inner)[: self.outer]] = -1
            got = self.addrs[k] = (addr, not np.any(addr[addr >= 0] % self.row))
        return got

    def read(self, idx: np.ndarray, out: np.ndarray, where: str) -> None:
        """Read records ``idx`` into the rows of ``out`` (``(n, row)`` uint8, C-contiguous)."""
        shard, local = np.divmod(idx, self.outer)
        order = None
        if shard.size and shard.min() != shard.max():  # group by shard, then one scatter
            order = np.argsort(shard, kind="stable")
            shard, local, idx = shard[order], local[order], idx[order]
            bounds = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), len(idx)]
        else:
            bounds = [0, len(idx)]
        if order is not None and self.row >= ROW_COPY_MIN:  # one copy per record, no scatter
            for a, b in itertools.pairwise(bounds):
                self._read_shard(int(shard[a]), local[a:b], idx[a:b], out, where, at=order[a:b])
            return
        dest = out if order is None else scratch(self._tls, out)
        for a, b in itertools.pairwise(bounds):
            self._read_shard(int(shard[a]), local[a:b], idx[a:b], dest[a:b], where)
        if order is not None:  # scatter as a gather: take copies whole rows, fancy setitem not
            np.take(dest, inverse(order), 0, out, "clip")

    def _read_shard(
        self,
        k: int,
        local: np.ndarray,
        idx: np.ndarray,
        out: np.ndarray,
        where: str,
        *,
        at: np.ndarray | None = None,
    ) -> None:
        """Records ``local`` of shard ``k`` into the rows of ``out`` (rows ``at``, else all)."""
        if not self.sharded:
            self._gather(self._rows(k, where), local, out, at)
            return
        table, aligned = self._addr(k)
        addr = table[local]
        if addr.min() < 0:
            rec = int(idx[np.argmax(addr < 0)])
            raise DatasetError(
                f"{where}: record {rec}: its chunk in shard "
                f"{self._key(k)} is missing or not stored uncompressed"
            )
        if aligned:
            rows = self._rows(k, where)
            r = addr // self.row
            if r.max() >= len(rows):
                raise DatasetError(
                    f"{where}/{self._key(k)}: record {int(idx[np.argmax(r >= len(rows))])} lies "
                    "beyond the end of the file (truncated)"
                )
            self._gather(rows, r, out, at)
            return
        fd = self._fd(k)
        dest = range(len(addr)) if at is None else at.tolist()
        for j, (p, offset) in enumerate(zip(dest, addr.tolist(), strict=True)):
            got = readinto_exactly(fd, [out[p]], offset, self.row)
            if got != self.row:
                raise DatasetError(
                    f"{where}/{self._key(k)}: short read at record {int(idx[j])} "
                    f"(got {got} of {self.row} bytes); the file is truncated"
                )

    @staticmethod
    def _gather(rows: np.ndarray, r: np.ndarray, out: np.ndarray, at: np.ndarray | None) -> None:
        if at is None:
            np.take(rows, r, 0, out, "clip")  # clip: indices are checked; raise copies twice
            return
        for p, q in zip(at.tolist(), r.tolist(), strict=True):
            out[p] = rows[q]

    def _rows(self, k: int, where: str) -> np.ndarray:
        """Shard/chunk file ``k`` mapped as ``(rows, row)`` uint8; its size re-checked per call."""
        fd = self._fd(k)
        size = os.fstat(fd).st_size
        rows = self.maps.get(k)
        if rows is None or len(rows) * self.row != size - size % self.row:
            if size < self.row:
                raise DatasetError(f"{where}/{self._key(k)}: file is truncated ({size} bytes)")
            m = mmap.mmap(fd, size - size % self.row, prot=mmap.PROT_READ)
            rows = np.frombuffer(m, np.uint8).reshape(-1, self.row)
            self.maps[k] = rows
        if not self.sharded and size != self.outer * self.row:
            raise DatasetError(
                f"{where}/{self._key(k)}: chunk file is {size} bytes, expected "
                f"{self.outer * self.row} (truncated or compressed)"
            )
        return rows

    def close(self) -> None:
        if self.pid == os.getpid():
            for fd in self.fds.values():
                os.close(fd)
        self.fds, self.indexes, self.maps, self.addrs = {}, {}, {}, {}
