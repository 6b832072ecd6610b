"""The on-disk format (version 1; see docs/ckpt-format.md): data files of raw tensor bytes plus a
JSON manifest with the tree, dtype, shape, file, offset, length and a CRC32C per chunk.

These functions are the storage layer on their own (planning a layout, staging into a buffer,
writing a data file with checksums, writing/reading/validating a manifest, reading a data file
back verified) so that other writers (e.g. a DCP ``StorageWriter``) can reuse them. No pickle.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt import _faults
from ckpt._flatten import Leaf, torch_dtype
from ckpt._pool import Buffer
from ckpt.errors import CheckpointError, CorruptCheckpointError
from feedpipe._crc import crc32c, to_hex

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "MANIFEST",
    "inside",
    "load_arrays",
    "plan",
    "read_file",
    "read_manifest",
    "safe_relpath",
    "stage",
    "validate",
    "verify_file",
    "write_file",
    "write_manifest",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ALIGN = 64  # every entry starts at a multiple of 64 bytes (any dtype can be viewed in place)
CHUNK_BYTES = 16 << 20  # one CRC32C per 16 MiB of each data file
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def safe_relpath(name: Any) -> str:
    """Return ``name`` if it is a relative path of plain components (no ``..``, not absolute)."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest")
    if not all(_NAME.match(part) for part in name.split("/")):
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest")
    return name


def plan(leaves: Sequence[Leaf], file: str = "data.bin", start: int = 0) -> tuple[list[dict], int]:
    """Lay ``leaves`` out in one data file; returns the manifest entries and the file size."""
    entries, offset = [], start
    for leaf in leaves:
        offset = -(-offset // ALIGN) * ALIGN
        entries.append(
            {
                "kind": leaf.kind,
                "dtype": leaf.dtype,
                "shape": leaf.shape,
                "file": file,
                "offset": offset,
                "nbytes": leaf.nbytes,
                "device": leaf.device,
            }
        )
        offset += leaf.nbytes
    return entries, offset


def stage(leaves: Sequence[Leaf], entries: Sequence[dict], buf: Buffer) -> None:
    """Copy every leaf into ``buf`` at its planned offset; CUDA copies are synchronized."""
    devices = set()
    for leaf, entry in zip(leaves, entries, strict=True):
        off, n = entry["offset"], entry["nbytes"]
        if n == 0:
            continue
        if isinstance(leaf.value, torch.Tensor):
            src = leaf.value
            dst = buf.tensor[off : off + n].view(src.dtype).view(src.shape)
            if src.is_cuda:
                devices.add(src.device)
                dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
        else:
            arr = leaf.value
            buf.array[off : off + n].view(arr.dtype).reshape(arr.shape)[...] = arr
    for device in devices:
        torch.cuda.synchronize(device)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_file(
    path: str | os.PathLike[str],
    data: memoryview,
    executor: Executor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict:
    """Write ``data`` to ``path`` in large pwrites (chunks checksummed and written in parallel on
    ``executor``), fsync it and return its manifest record (name, size, chunk size, CRC32Cs)."""
    size = len(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    own = executor is None
    pool = executor or ThreadPoolExecutor(2, thread_name_prefix="ckpt-write")
    try:
        if size:
            try:  # reserve the space first: a full disk fails here, before any data is written
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
        _faults.pause("write")

        def one(start: int) -> str:
            piece = data[start : start + chunk_bytes]
            crc = crc32c(piece)
            _pwrite_all(fd, piece, start)
            return to_hex(crc)

        crcs = list(pool.map(one, range(0, size, chunk_bytes)))
        _faults.pause("fsync")
        os.fsync(fd)
    finally:
        os.close(fd)
        if own:
            pool.shutdown()
    return {"name": Path(path).name, "size": size, "chunk_bytes": chunk_bytes, "crc32c": crcs}


_HEAD, _MID, _TAIL = b'{"crc32c":"', b'","body":', b"}\n"


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_manifest(directory: str | os.PathLike[str], body: dict, name: str = MANIFEST) -> Path:
    """Write ``body`` as the manifest (with its own CRC32C) into ``directory`` and fsync it."""
    canon = _canonical(body)
    text = _HEAD + to_hex(crc32c(canon)).encode() + _MID + canon + _TAIL
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, memoryview(text), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_manifest(directory: str | os.PathLike[str], name: str = MANIFEST) -> dict:
    """Read, checksum and validate a manifest; raises ``CorruptCheckpointError`` naming the file.

    The CRC32C covers the body's exact bytes, so any changed byte is detected.
    """
    path = Path(directory) / name
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:  # never a symlink
            raw = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: manifest missing") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CorruptCheckpointError(f"{path}: manifest is a symlink") from None
    start = len(_HEAD) + 8 + len(_MID)
    if not (raw.startswith(_HEAD) and raw[len(_HEAD) + 8 : start] == _MID and raw.endswith(_TAIL)):
        raise CorruptCheckpointError(f"{path}: manifest is not valid: bad framing")
    stored, body_raw = raw[len(_HEAD) : len(_HEAD) + 8], raw[start : -len(_TAIL)]
    actual = to_hex(crc32c(body_raw)).encode()
    if actual != stored:
        want = stored.decode(errors="replace")
        raise CorruptCheckpointError(
            f"{path}: manifest checksum mismatch ({actual.decode()} != {want})"
        )
    try:
        body = json.loads(body_raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: manifest is not valid: {exc}") from None
    try:
        validate(body)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from None
    return body


def validate(body: Any) -> None:
    """Check a manifest body's structure, names, dtypes and byte ranges."""
    try:
        if body.get("format") != "ckpt" or body.get("version") != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"unsupported format {body.get('format')!r} version {body.get('version')!r} "
                f"(this reader supports ckpt version {FORMAT_VERSION})"
            )
        sizes = {}
        for rec in body["files"]:
            name = safe_relpath(rec["name"])
            size, chunk = int(rec["size"]), int(rec["chunk_bytes"])
            if size < 0 or chunk <= 0 or len(rec["crc32c"]) != math.ceil(size / chunk):
                raise CorruptCheckpointError(f"file record {name!r} is inconsistent")
            sizes[name] = size
        for i, e in enumerate(body["entries"]):
            file = safe_relpath(e["file"])
            shape = [int(d) for d in e["shape"]]
            if file not in sizes or any(d < 0 for d in shape):
                raise CorruptCheckpointError(f"entry {i} refers to unknown file or bad shape")
            if e["kind"] == "tensor":
                itemsize = torch.empty((), dtype=torch_dtype(e["dtype"])).element_size()
            elif e["kind"] == "ndarray":
                dt = np.dtype(str(e["dtype"]))
                if dt.hasobject:
                    raise CorruptCheckpointError(f"entry {i} has an object dtype")
                itemsize = dt.itemsize
            else:
                raise CorruptCheckpointError(f"entry {i} has unknown kind {e['kind']!r}")
            off, n = int(e["offset"]), int(e["nbytes"])
            if n != math.prod(shape) * itemsize or off < 0 or off % ALIGN or off + n > sizes[file]:
                raise CorruptCheckpointError(f"entry {i} byte range is inconsistent")
        if not isinstance(body["tree"], dict):
            raise CorruptCheckpointError("tree is not an object")
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"manifest is malformed: {exc!r}") from None
    except CheckpointError as exc:
        raise CorruptCheckpointError(str(exc)) from None


def _check_size(path: Path, rec: dict, fd: int) -> None:
    size = os.fstat(fd).st_size
    if size != rec["size"]:
        raise CorruptCheckpointError(f"{path}: size {size} != {rec['size']} bytes (truncated?)")


def inside(directory: Path, name: str) -> Path:
    """``directory/name``, refusing a symlink at any component of ``name`` (never followed out of
    the checkpoint directory); the last component is opened with ``O_NOFOLLOW`` as well."""
    path = directory
    for part in safe_relpath(name).split("/"):
        path = path / part
        if path.is_symlink():
            raise CorruptCheckpointError(f"{path}: data file is a symlink")
    return path


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # never read through a symlink out of the checkpoint
            raise CorruptCheckpointError(f"{path}: data file is a symlink") from None
        raise


def _check_chunk(path: Path, rec: dict, i: int, piece: memoryview) -> None:
    actual = to_hex(crc32c(piece))
    if actual != rec["crc32c"][i]:
        start = i * rec["chunk_bytes"]
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in chunk {i} (bytes {start}-{start + len(piece)}): "
            f"{actual} != {rec['crc32c'][i]}"
        )


def read_file(
    directory: Path, rec: dict, verify: bool, executor: Executor
) -> tuple[torch.Tensor, float]:
    """Read a data file into a new uint8 tensor, checking size and (if ``verify``) every chunk's
    CRC32C; returns the tensor and the seconds spent checksumming."""
    path = inside(directory, rec["name"])
    fd = _open(path)
    try:
        _check_size(path, rec, fd)
        out = torch.empty(rec["size"], dtype=torch.uint8)
        view = out.numpy().data.cast("B")
        chunk = rec["chunk_bytes"]

        def one(i: int) -> float:
            piece = view[i * chunk : (i + 1) * chunk]
            got = 0
            while got < len(piece):
                n = os.preadv(fd, [piece[got:]], i * chunk + got)
                if n == 0:
                    raise CorruptCheckpointError(f"{path}: unexpected end of file")
                got += n
            if not verify:
                return 0.0
            t0 = time.perf_counter()
            _check_chunk(path, rec, i, piece)
            return time.perf_counter() - t0

        crc_s = sum(executor.map(one, range(len(rec["crc32c"]))))
    finally:
        os.close(fd)
    return out, crc_s


def verify_file(directory: Path, rec: dict) -> None:
    """Check a data file's size and every chunk's CRC32C without keeping its bytes."""
    path = inside(directory, rec["name"])
    fd = _open(path)
    try:
        _check_size(path, rec, fd)
        chunk = rec["chunk_bytes"]
        scratch = memoryview(bytearray(min(chunk, max(rec["size"], 1))))
        for i in range(len(rec["crc32c"])):
            n = os.preadv(fd, [scratch], i * chunk)
            _check_chunk(path, rec, i, scratch[:n])
    finally:
        os.close(fd)


def load_arrays(body: dict, files: dict[str, torch.Tensor]) -> list[Any]:
    """Views of each entry into the loaded (or memory-mapped) data-file tensors."""
    out: list[Any] = []
    for e in body["entries"]:
        raw = files[e["file"]][e["offset"] : e["offset"] + e["nbytes"]]
        if e["kind"] == "tensor":
            dtype = torch_dtype(e["dtype"])
            if e["nbytes"] == 0:
                out.append(torch.empty(e["shape"], dtype=dtype))
            else:
                out.append(raw.view(dtype).view(e["shape"]))
        else:
            dt = np.dtype(e["dtype"])
            out.append(raw.numpy().view(dt).reshape(e["shape"]))
    return out
