"""``ZarrDataset``: a map-style torch dataset over a Zarr v3 array (or a group of aligned arrays).

The first axis is the sample axis. Reads go through TensorStore by default (GIL released, one
batched read per array) or through zarr-python with ``backend="zarr"``. On every path a missing
chunk is a :class:`DatasetError`, never fill values (zarr-python through
:mod:`feedpipe.datasets._zarr_strict`). Any codec zarr supports works, including the v3 sharding
codec with zstd. Remote fsspec URLs (``s3://``...) are read with zarr-python's fsspec store.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._gather import ROW_COPY_MIN, indices_array, inverse, scratch
from feedpipe.datasets.format import check_dtype, check_shape
from feedpipe.errors import DatasetError, require
from feedpipe.io.fsutil import readinto_exactly
from feedpipe.io.remote import is_remote, local_file_path, redact

__all__ = ["ZarrDataset"]

_BACKENDS = ("tensorstore", "zarr")
# pid of the process that started TensorStore's threads. TensorStore aborts a forked child that
# uses it after its parent did, so such a child reads through zarr-python instead.
_TS_STARTED_IN: int | None = None


class ZarrDataset(torch.utils.data.Dataset[Any]):
    """Samples along the first axis of a Zarr v3 array, or of aligned arrays in a group.

    For a group, ``arrays`` picks the member arrays (default: every array member) and samples are
    dicts ``{name: tensor}``; for a single array, samples are tensors. ``preadv`` (default True)
    reads uncompressed local arrays whose chunks hold whole records with ``os.preadv`` at
    addresses from the shard index, instead of through the engine (see :class:`_PreadvReader`).
    ``direct`` is the deprecated name of ``preadv`` (it warns; "direct" now names only the GPU
    feed's direct path, see the glossary).
    """

    #: ``read_batch`` takes numpy index arrays (:class:`feedpipe.protocols.IndexArrayDataset`).
    takes_index_arrays = True

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        arrays: Sequence[str] | None = None,
        backend: str = "tensorstore",
        storage_options: dict[str, Any] | None = None,
        preadv: bool = True,
        direct: bool | None = None,
    ) -> None:
        if direct is not None:
            if preadv is not True:
                raise TypeError("ZarrDataset: pass preadv= only (direct= is its deprecated name)")
            warnings.warn(
                "ZarrDataset(direct=) is deprecated; use ZarrDataset(preadv=)",
                DeprecationWarning,
                stacklevel=2,
            )
            preadv = direct
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.path = os.fspath(path_or_url).rstrip("/")
        self.path = local_file_path(self.path)
        self.storage_options = dict(storage_options or {})
        self.remote = is_remote(self.path)
        # TensorStore is given local paths; remote URLs use zarr-python over fsspec
        self.backend = "zarr" if self.remote else backend
        node = self._read_meta("")
        if node.get("node_type") == "array":
            if arrays:
                raise DatasetError(f"{self.path}: is a single array; 'arrays' needs a group")
            self.names: list[str] = [""]
            self.is_group = False
        elif node.get("node_type") == "group":
            self.names = list(arrays) if arrays else self._members()
            if not self.names:
                raise DatasetError(f"{self.path}: Zarr group has no arrays")
            self.is_group = True
        else:
            raise DatasetError(
                f"{self.path}: zarr.json has unknown node_type {node.get('node_type')!r}"
            )
        metas = {n: self._read_meta(n) for n in self.names}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, np.dtype] = {}
        for name, meta in metas.items():
            shape, dtype = _array_meta(meta, f"{self._where(name)}/zarr.json")
            self.shapes[name] = shape
            if dtype is not None:
                self._dtypes[name] = dtype
        self._preadv: dict[str, _PreadvReader] = {}
        if preadv and not self.remote:
            for name, meta in metas.items():
                plan = _PreadvReader.plan(os.path.join(self.path, name), meta, self.shapes[name])
                if plan is not None:
                    self._preadv[name] = plan
        lengths = {n: s[0] for n, s in self.shapes.items()}
        self._len = next(iter(lengths.values()))
        if len(set(lengths.values())) != 1:
            raise DatasetError(
                f"{self.path}: arrays are not aligned on the sample axis (lengths {lengths})"
            )
        self._handles: dict[str, Any] | None = None
        self._pid = -1
        self._proc_backend = self.backend

    # ------------------------------------------------------------------ metadata
    def _where(self, name: str) -> str:
        shown = redact(self.path, self.storage_options)
        return f"{shown}/{name}" if name else shown

    def _fs(self) -> tuple[Any, str]:
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        return fs, root.rstrip("/")

    def _read_meta(self, name: str) -> dict[str, Any]:
        where = self._where(name)
        try:
            if self.remote:
                fs, root = self._fs()
                raw = fs.cat_file(f"{root}/{name}/zarr.json" if name else f"{root}/zarr.json")
            else:
                with open(os.path.join(self.path, name, "zarr.json"), "rb") as f:
                    raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            hint = (
                " (a Zarr v2 array?)"
                if not self.remote and os.path.exists(os.path.join(self.path, name, ".zarray"))
                else ""
            )
            raise DatasetError(
                f"{where}: not a Zarr v3 array or group (no zarr.json){hint}"
            ) from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise DatasetError(f"{where}/zarr.json: not valid JSON: {why}") from None
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
            raise DatasetError(f"{where}/zarr.json: not Zarr format 3")
        return doc

    def _members(self) -> list[str]:
        if self.remote:
            fs, root = self._fs()
            entries = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        else:
            entries = sorted(os.listdir(self.path))
        names = []
        for entry in sorted(entries):
            if entry == "zarr.json":
                continue
            try:
                if self._read_meta(entry).get("node_type") == "array":
                    names.append(entry)
            except DatasetError:
                continue
        return names

    # ------------------------------------------------------------------ handles
    def _open(self) -> dict[str, Any]:
        if self._handles is not None and self._pid == os.getpid():
            return self._handles
        global _TS_STARTED_IN
        handles: dict[str, Any] = {}
        self._proc_backend = self.backend
        if self.backend == "tensorstore" and _TS_STARTED_IN not in (None, os.getpid()):
            warnings.warn(
                f"{self._where('')}: this process was forked after TensorStore ran in its parent, "
                "which TensorStore does not allow; reading with zarr-python here instead (missing "
                "chunks are still errors; use the "
                "'forkserver' or 'spawn' start method, or thread workers, to keep TensorStore)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._proc_backend = "zarr"
        if self._proc_backend == "tensorstore":
            _TS_STARTED_IN = os.getpid()
            ts: Any = require("tensorstore", "zarr")
            for name in self.names:
                path = os.path.abspath(os.path.join(self.path, name))
                spec = {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": path},
                    "fill_missing_data_reads": False,  # a missing chunk is an error, not zeros
                }
                try:
                    handles[name] = ts.open(spec, read=True).result()
                except Exception as exc:
                    raise DatasetError(
                        f"{self._where(name)}: TensorStore cannot open it: {exc}"
                    ) from None
        else:
            zarr: Any = require("zarr", "zarr")
            from feedpipe.datasets._zarr_strict import strict_store

            for name in self.names:
                where = self._where(name)
                meta = self._read_meta(name)
                try:
                    if self.remote:
                        store = zarr.storage.FsspecStore.from_url(
                            where, storage_options=self.storage_options, read_only=True
                        )
                    else:
                        store = zarr.storage.LocalStore(where, read_only=True)
                except Exception as exc:
                    raise DatasetError(f"{where}: zarr cannot open it: {exc}") from None
                strict = strict_store(store, meta, where)  # missing chunks raise
                try:
                    handles[name] = zarr.open_array(strict, mode="r")
                except Exception as exc:
                    raise DatasetError(f"{where}: zarr cannot open it: {exc}") from None
        self._handles, self._pid = handles, os.getpid()
        return handles

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return self._len

    def _normalize(self, indices: Any) -> np.ndarray:
        n = self._len
        return indices_array(
            indices, n, lambda i: f"index {i} is out of range for {self._where('')} (length {n})"
        )

    def _read(self, name: str, idx: np.ndarray) -> np.ndarray:
        reader = self._preadv.get(name)
        if reader is not None:
            out = np.empty((len(idx), *self.shapes[name][1:]), reader.dtype)
            reader.read(idx, out.reshape(len(idx), -1).view(np.uint8), self._where(name))
            return out
        h = self._open()[name]
        try:
            if self._proc_backend == "tensorstore":
                return np.asarray(h[idx].read().result())
            return np.asarray(h.oindex[idx])
        except Exception as exc:
            rows = idx.tolist()
            shown = rows if len(rows) <= 8 else [*rows[:8], "..."]
            raise DatasetError(
                f"{self._where(name)}: reading records {shown} failed: {exc}"
            ) from None

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, torch.Tensor) and index.ndim == 0:
            index = int(index)
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        batch = self.read_batch([int(index)])
        if not self.is_group:
            return batch[0].clone()
        return {k: v[0].clone() for k, v in batch.items()}

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """torch's per-batch hook: one batched read per array, split into per-sample views."""
        batch = self.read_batch(indices)
        if not self.is_group:
            return list(batch)
        return [{k: v[j] for k, v in batch.items()} for j in range(len(indices))]

    def read_batch(
        self, indices: Sequence[int] | np.ndarray | torch.Tensor, out: Any = None
    ) -> Any:
        """Return what ``default_collate([ds[i] for i in indices])`` returns: one read per array.

        ``out`` (optional) is a tensor (single array) or dict of tensors (group) with room for the
        batch; the batch is copied into it and views of it are returned.
        """
        idx = self._normalize(indices)
        result: dict[str, torch.Tensor] = {}
        for name in self.names:
            shape = (len(idx), *self.shapes[name][1:])
            arr = self._read(name, idx) if len(idx) else None
            target = out.get(name) if isinstance(out, dict) else out
            if target is None:
                t = torch.from_numpy(arr) if arr is not None else None
                if t is None:
                    t = torch.from_numpy(np.empty(shape, self.dtype_of(name)))
            else:
                want = torch.from_numpy(np.empty(0, self.dtype_of(name))).dtype
                if (
                    not isinstance(target, torch.Tensor)
                    or target.dtype != want  # copy_ would cast silently
                    or tuple(target.shape[1:]) != shape[1:]
                    or target.shape[0] < shape[0]
                ):
                    raise ValueError(f"out[{name!r}] must be a {want} tensor with room for {shape}")
                t = target[: shape[0]]
                if arr is not None:
                    t.copy_(torch.from_numpy(arr))
            result[name] = t
        return result if self.is_group else result[""]

    def dtype_of(self, name: str = "") -> np.dtype:
        """The numpy dtype of array ``name`` (``""`` for a single array)."""
        if name in self._dtypes:
            return self._dtypes[name]
        h = self._open()[name]
        return np.dtype(h.dtype.numpy_dtype if self._proc_backend == "tensorstore" else h.dtype)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = None
        state["_pid"] = -1
        state["_preadv"] = {
            k: _PreadvReader.plan(v.root, v.meta, v.shape) for k, v in self._preadv.items()
        }
        return state

    def __repr__(self) -> str:
        arrays = {n or "<root>": s for n, s in self.shapes.items()}
        return (
            f"ZarrDataset({self._where('')!r}, {self._len} samples, {arrays}, "
            f"backend={self.backend!r})"
        )


def _array_meta(meta: dict[str, Any], source: str) -> tuple[tuple[int, ...], np.dtype | None]:
    """An array's shape and numpy dtype (None: a type only the backend knows) from its
    ``zarr.json``; anything malformed or unreadable as a tensor is a :class:`DatasetError`."""
    if meta.get("node_type") != "array":
        raise DatasetError(f"{source}: not a Zarr array (node_type {meta.get('node_type')!r})")
    dtype: np.dtype | None = None
    try:
        if "shape" not in meta or "data_type" not in meta:
            raise ValueError("an array needs 'shape' and 'data_type'")
        name = meta["data_type"]
        if isinstance(name, str):
            try:
                dtype = np.dtype(name)
            except TypeError:
                dtype = None  # a Zarr type name numpy does not know: the backend decides
        elif not isinstance(name, dict):  # v3 extension types are objects
            raise ValueError(f"data_type must be a string or an object, got {name!r}")
        if dtype is not None:
            check_dtype(dtype, "data_type")
        shape = check_shape(meta["shape"], dtype.itemsize if dtype is not None else 1, "array")
        _check_chunk_shapes(meta, len(shape))
    except (ValueError, TypeError, OverflowError, KeyError, AttributeError) as exc:
        raise DatasetError(f"{source}: malformed Zarr metadata: {exc}") from None
    if not shape:
        raise DatasetError(f"{source}: a 0-d array has no sample axis")
    return shape, dtype


def _check_chunk_shapes(meta: dict[str, Any], ndim: int) -> None:
    """The chunk grid's and a sharding codec's ``chunk_shape``: ``ndim`` positive integers."""
    grid = meta.get("chunk_grid")
    shapes = []
    if isinstance(grid, dict) and isinstance(grid.get("configuration"), dict):
        shapes.append(("chunk_grid", grid["configuration"].get("chunk_shape")))
    for codec in meta.get("codecs") or []:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            conf = codec.get("configuration")
            if not isinstance(conf, dict):
                raise ValueError("sharding_indexed needs a configuration object")
            shapes.append(("sharding_indexed", conf.get("chunk_shape")))
    for where, chunk in shapes:
        if (
            not isinstance(chunk, list)
            or len(chunk) != ndim
            or any(type(c) is not int or c < 1 for c in chunk)
        ):
            raise ValueError(f"{where} chunk_shape must be {ndim} positive integers, got {chunk!r}")


# ---------------------------------------------------------------------- preadv reads
_MISSING = np.uint64(2**64 - 1)


class _PreadvReader:
    """Byte-range reads of an *uncompressed* Zarr v3 array whose chunks hold whole records.

    Such chunks (a lone ``bytes`` codec, or ``sharding_indexed`` with only ``bytes`` inside) are
    plain C-order rows, so a record is one ``preadv`` at an address taken from the chunk grid
    and the shard index (its CRC32C checked). A storage engine's per-chunk overhead would
    otherwise dominate when every record is its own chunk. Anything else
    goes through TensorStore / zarr-python.
    """

    def __init__(self, root: str, meta: dict[str, Any], shape: tuple[int, ...]) -> None:
        self.root, self.meta, self.shape = root, meta, shape
        self.dtype = np.dtype(meta["data_type"])
        self.row = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.outer = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        enc = meta.get("chunk_key_encoding", {"name": "default"})
        sep = enc.get("configuration", {}).get(
            "separator", "/" if enc["name"] == "default" else "."
        )
        tail = [0] * (len(shape) - 1)
        self._key = (
            (lambda k: "c" + sep + sep.join(map(str, [k, *tail])))
            if enc["name"] == "default"
            else (lambda k: sep.join(map(str, [k, *tail])))
        )
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
        # rebuilt from its plan: open files, maps, the key function and the scratch stay behind
        return (_PreadvReader, (self.root, self.meta, self.shape))

    @staticmethod
    def plan(root: str, meta: dict[str, Any], shape: tuple[int, ...]) -> _PreadvReader | None:
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
                return dtype.itemsize == 1 or endian == "little"

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
            return _PreadvReader(root, meta, shape)
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
