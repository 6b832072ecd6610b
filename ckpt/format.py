"""The on-disk format (version 1; see docs/ckpt-format.md): data files of raw tensor bytes plus a
JSON manifest with the tree, dtype, shape, file, offset, length and a CRC32C per chunk.

These functions are the storage layer on their own (planning a layout, staging into a buffer,
writing a data file with checksums, writing/reading/validating a manifest, reading a data file
back verified) so that other writers (e.g. a DCP ``StorageWriter``) can reuse them. No pickle.
"""

from __future__ import annotations

import base64
import bisect
import errno
import itertools
import json
import keyword
import math
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt import _faults
from ckpt._layout import DATA_FILE, MANIFEST
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.saving.flatten import ALIGN, MAX_DEPTH, Leaf, torch_dtype
from ckpt.saving.pool import Buffer
from feedpipe.io import crc32c, readinto_exactly, to_hex
from feedpipe.io.trace import span

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "IO_BYTES",
    "MANIFEST",
    "MAX_DEPTH",
    "MAX_MANIFEST_BYTES",
    "MAX_METRICS",
    "ChunkedWriter",
    "Target",
    "check_file",
    "check_metrics",
    "inside",
    "load_arrays",
    "new_manifest",
    "numpy_dtype",
    "open_data",
    "open_regular",
    "plan",
    "read_manifest",
    "safe_relpath",
    "stage",
    "stream_file",
    "torch_itemsize",
    "validate_manifest",
    "verify_file",
    "write_file",
    "write_manifest",
]

FORMAT_VERSION = 1
CHUNK_BYTES = 16 << 20  # one CRC32C per 16 MiB of each data file
IO_BYTES = 16 << 20  # the largest single read of a restore: its buffer per reader thread
MAX_MANIFEST_BYTES = 1 << 30  # a manifest is read whole: bounded, whatever its file claims
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def safe_relpath(name: Any) -> str:
    """Return ``name`` if it is a relative path of plain components (no ``..``, not absolute)."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest")
    if not all(_NAME.match(part) for part in name.split("/")):
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest")
    return name


def plan(leaves: Sequence[Leaf], file: str = DATA_FILE, start: int = 0) -> tuple[list[dict], int]:
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
            with span("ckpt/write"):  # in the write pool's thread
                crc = crc32c(piece)
                _pwrite_all(fd, piece, start)
            return to_hex(crc)

        crcs = list(pool.map(one, range(0, size, chunk_bytes)))
        _faults.pause("fsync")
        with span("ckpt/fsync"):
            os.fsync(fd)
    finally:
        os.close(fd)
        if own:
            pool.shutdown()
    return _file_record(Path(path).name, size, chunk_bytes, crcs)


def _file_record(name: str, size: int, chunk_bytes: int, crcs: list[str]) -> dict:
    return {"name": name, "size": size, "chunk_bytes": chunk_bytes, "crc32c": crcs}


class ChunkedWriter:
    """Appends pieces to a new data file with ``pwrite``, keeping one running CRC32C per chunk
    (the streaming counterpart of ``write_file``, for writers that get their bytes piece by
    piece, such as a DCP ``StorageWriter``). ``close`` fsyncs and returns the file's record."""

    def __init__(self, path: Path, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path, self.chunk = path, chunk_bytes
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.size, self.crc = 0, 0
        self.crcs: list[str] = []

    def write(self, view: memoryview) -> None:
        """Append ``view``."""
        while view:
            room = self.chunk - self.size % self.chunk
            piece, view = view[:room], view[room:]
            _pwrite_all(self.fd, piece, self.size)
            self.crc = crc32c(piece, self.crc)
            self.size += len(piece)
            if self.size % self.chunk == 0:
                self.crcs.append(to_hex(self.crc))
                self.crc = 0

    def pad(self, align: int) -> None:
        """Append zero bytes up to the next multiple of ``align``."""
        extra = -self.size % align
        if extra:
            self.write(memoryview(bytes(extra)))

    def close(self) -> dict:
        """Fsync and close the file; return its manifest record (as ``write_file`` does)."""
        try:
            if self.size % self.chunk:
                self.crcs.append(to_hex(self.crc))
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return _file_record(self.path.name, self.size, self.chunk, self.crcs)


def new_manifest(
    *,
    step: int | None,
    nbytes: int,
    tree: dict,
    entries: list[dict],
    files: list[dict],
    metadata: dict | None = None,
    created: float | None = None,
    metrics: dict | None = None,
) -> dict:
    """A manifest body of this format version (``write_manifest`` writes it). ``step`` is
    ``None`` for a lone ``ckpt.save``; ``created`` (seconds since the epoch) is left out when
    ``None``; ``metrics`` (``check_metrics``) only when given."""
    body: dict[str, Any] = {"format": "ckpt", "version": FORMAT_VERSION, "step": step}
    if created is not None:
        body["created"] = created
    body.update(nbytes=nbytes, tree=tree, entries=entries, files=files, metadata=metadata or {})
    if metrics:
        body["metrics"] = dict(metrics)
    return body


MAX_METRICS = 256
_METRIC = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./:@+-]{0,127}$")
_METRIC_LIMIT = float(1 << 63)


def _metrics_problem(metrics: Any) -> str | None:
    """Why ``metrics`` is not a valid metrics dict (the field at fault first), else ``None``."""
    if not isinstance(metrics, dict):
        return f"metrics: expected a dict of metric name -> number, got {metrics!r:.80}"
    if len(metrics) > MAX_METRICS:
        return f"metrics: {len(metrics)} metrics, over the limit of {MAX_METRICS}"
    for name, value in metrics.items():
        if not isinstance(name, str) or not _METRIC.fullmatch(name):
            return (
                f"metrics: bad metric name {name!r:.80} (letters, digits and _./:@+-, "
                "at most 128 characters)"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metrics[{name!r}]: expected a finite number, got {value!r:.80}"
        if isinstance(value, int) and not -_METRIC_LIMIT <= value <= _METRIC_LIMIT:
            return f"metrics[{name!r}]: int out of range: {value!r:.40}"
        if not math.isfinite(value):
            return f"metrics[{name!r}]: expected a finite number, got {value!r}"
    return None


def check_metrics(metrics: Any) -> dict:
    """``metrics`` as ``save`` stores them: a dict of at most ``MAX_METRICS`` names (letters,
    digits, ``_./:@+-``) to finite numbers (a NumPy scalar or a 0-dim real tensor counts, as
    its Python number); anything else raises ``ValueError`` naming the metric. Leave a metric
    out to mark it missing."""
    if isinstance(metrics, dict):
        metrics = {name: _number(value) for name, value in metrics.items()}
    problem = _metrics_problem(metrics)
    if problem is not None:
        raise ValueError(problem)
    return dict(metrics)


def _number(value: Any) -> Any:
    """A NumPy integer or float scalar, or a 0-dim integer or float tensor, as a Python number
    (anything else unchanged, for ``_metrics_problem`` to judge)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):  # float(): a longdouble's item() stays a longdouble
        return float(value)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not (value.dtype == torch.bool or value.is_complex())
        and value.device.type != "meta"  # no value to read: refused as not a number
    ):
        return value.item()
    return value


def _check_metadata(meta: Any) -> None:
    """``metadata``: a JSON object nested at most ``MAX_DEPTH`` levels."""
    _typed(meta, dict, "metadata")
    stack = [(meta, "metadata", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, f"{where}[{k!r:.40}]", depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node))


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


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def read_manifest(directory: str | os.PathLike[str], name: str = MANIFEST) -> dict:
    """Read, checksum and validate a manifest; raises ``CorruptCheckpointError`` naming the file.

    The CRC32C covers the body's exact bytes, so any changed byte is detected.
    """
    path = Path(directory) / name
    try:
        with open(open_regular(path), "rb") as f:  # never a symlink, a FIFO or a device
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:  # a (sparse) giant is refused before it is read
                raise CorruptCheckpointError(
                    f"{path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
                )
            raw = f.read(size)  # never more than it claimed (a growing file is cut)
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
        body = json.loads(body_raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest is not valid: {exc}") from None
    validate_manifest(body, path)
    return body


MAX_NDIM = 64
_MAX_BYTES = 1 << 62  # sizes and offsets beyond this are refused (no real file is that large)
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_NP_DTYPE = re.compile(r"^[<>|=][biufcmMSUV][0-9]{1,6}(\[[0-9]{0,3}[A-Za-z]{1,2}\])?$")
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu)(:[0-9]{1,4})?$")
_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,99}$")
_QUALNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|<locals>)){0,31}$")


def torch_itemsize(name: Any) -> int:
    """The element size of a supported torch dtype name; ``CorruptCheckpointError`` otherwise."""
    try:
        return torch_dtype(name).itemsize
    except CheckpointError as exc:
        raise CorruptCheckpointError(str(exc)) from None


def numpy_dtype(name: Any) -> np.dtype:
    """A plain (non-object, non-structured) numpy dtype from its ``dtype.str``."""
    if not isinstance(name, str) or not _NP_DTYPE.match(name):
        raise CorruptCheckpointError(f"unsupported numpy dtype {name!r}")
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError):
        raise CorruptCheckpointError(f"unsupported numpy dtype {name!r}") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise CorruptCheckpointError(f"unsupported numpy dtype {name!r}")
    return dt


def _int(value: Any, field: str, low: int = 0, high: int = _MAX_BYTES) -> int:
    if type(value) is not int or not low <= value <= high:
        raise CorruptCheckpointError(f"{field}: expected an int in [{low}, {high}], got {value!r}")
    return value


def _typed(value: Any, kind: type, field: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CorruptCheckpointError(f"{field}: expected {kind.__name__}, got {value!r:.80}")
    return value


def _shape(value: Any, field: str) -> list[int]:
    dims = _typed(value, list, field)
    if len(dims) > MAX_NDIM:
        raise CorruptCheckpointError(f"{field}: more than {MAX_NDIM} dimensions")
    return [_int(d, f"{field}[{k}]") for k, d in enumerate(dims)]


def _extent(shape: list[int], itemsize: int, field: str) -> None:
    """Refuse a shape whose dims (a zero dim counted as 1) span more than ``_MAX_BYTES``: torch's
    stride calculation and numpy's size check overflow on it even when it holds no element."""
    if math.prod(max(d, 1) for d in shape) * max(itemsize, 1) > _MAX_BYTES:
        raise CorruptCheckpointError(f"{field}: dimensions {shape} overflow (over 2**62 bytes)")


def _validate_files(files: Any) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for k, rec in enumerate(_typed(files, list, "files")):
        where = f"files[{k}]"
        _typed(rec, dict, where)
        name = safe_relpath(rec.get("name"))
        if name in sizes:
            raise CorruptCheckpointError(f"{where}.name: {name!r} listed twice")
        size = _int(rec.get("size"), f"{where}.size")
        chunk = _int(rec.get("chunk_bytes"), f"{where}.chunk_bytes", 1)
        crcs = _typed(rec.get("crc32c"), list, f"{where}.crc32c")
        if len(crcs) != -(-size // chunk):
            raise CorruptCheckpointError(
                f"{where}.crc32c: {len(crcs)} checksums for {size} bytes in {chunk}-byte chunks"
            )
        for j, crc in enumerate(crcs):
            if not isinstance(crc, str) or not _HEX8.match(crc):
                raise CorruptCheckpointError(f"{where}.crc32c[{j}]: not 8 hex digits: {crc!r:.40}")
        sizes[name] = size
    return sizes


def _validate_entry(e: Any, where: str, sizes: dict[str, int]) -> None:
    _typed(e, dict, where)
    file = safe_relpath(e.get("file"))
    if file not in sizes:
        raise CorruptCheckpointError(f"{where}.file: {file!r} is not in files")
    shape = _shape(e.get("shape"), f"{where}.shape")
    kind = e.get("kind")
    if kind == "tensor":
        itemsize = torch_itemsize(e.get("dtype"))
        device = e.get("device", "cpu")
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise CorruptCheckpointError(f"{where}.device: unsupported device {device!r:.40}")
    elif kind == "ndarray":
        itemsize = numpy_dtype(e.get("dtype")).itemsize
    else:
        raise CorruptCheckpointError(f"{where}.kind: unknown kind {kind!r:.40}")
    off, n = _int(e.get("offset"), f"{where}.offset"), _int(e.get("nbytes"), f"{where}.nbytes")
    if n != math.prod(shape) * itemsize:
        raise CorruptCheckpointError(f"{where}.nbytes: {n} != prod(shape) * itemsize")
    _extent(shape, itemsize, f"{where}.shape")
    if off % ALIGN or off + n > sizes[file]:
        raise CorruptCheckpointError(
            f"{where}.offset: bytes {off}-{off + n} are unaligned or beyond {file} "
            f"({sizes[file]} bytes)"
        )


def _validate_view(view: Any, where: str, entry: dict) -> None:
    """A tensor node's ``view``: a strided view into a shared-storage (uint8) entry."""
    _typed(view, dict, where)
    itemsize = torch_itemsize(view.get("dtype"))
    shape = _shape(view.get("shape"), f"{where}.shape")
    stride = _shape(view.get("stride"), f"{where}.stride")
    off = _int(view.get("offset"), f"{where}.offset")
    _extent(shape, itemsize, f"{where}.shape")
    if len(stride) != len(shape) or off % itemsize:
        raise CorruptCheckpointError(f"{where}: stride/shape lengths differ or unaligned offset")
    if entry.get("kind") != "tensor" or entry.get("dtype") != "uint8":
        raise CorruptCheckpointError(f"{where}: a view needs a uint8 tensor entry")
    if 0 not in shape:
        end = off + (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))) * itemsize
        if end > entry["nbytes"]:
            raise CorruptCheckpointError(f"{where}: view ends at byte {end}, beyond its entry")


_SCALARS = (type(None), bool, int, float, str)
_VALUED = ("v", "float", "bytes", "bytearray", "dtype", "device", "enum", "state")


def _validate_node(node: Any, where: str, entries: list[dict]) -> list[tuple[Any, str]]:
    """Check one tree node; return its children (node, field) to check next."""
    _typed(node, dict, where)
    kind = node.get("t")
    value = node.get("v")
    if kind in _VALUED and "v" not in node:
        raise CorruptCheckpointError(f"{where}.v: missing")
    if kind == "v":
        finite = not isinstance(value, float) or math.isfinite(value)
        if not isinstance(value, _SCALARS) or not finite:
            raise CorruptCheckpointError(f"{where}.v: not a JSON scalar: {value!r:.40}")
    elif kind == "float":
        if value not in ("nan", "inf", "-inf"):
            raise CorruptCheckpointError(f"{where}.v: not nan/inf/-inf: {value!r:.40}")
    elif kind in ("bytes", "bytearray"):
        try:
            base64.b64decode(_typed(value, str, f"{where}.v"), validate=True)
        except ValueError:
            raise CorruptCheckpointError(f"{where}.v: not base64") from None
    elif kind == "dtype":
        torch_itemsize(value)
    elif kind == "device":
        try:
            if not isinstance(value, str) or not re.match(r"^[a-z]{2,12}(:[0-9]{1,4})?$", value):
                raise ValueError(value)
            torch.device(value)
        except (RuntimeError, ValueError):
            raise CorruptCheckpointError(f"{where}.v: not a device name: {value!r:.40}") from None
    elif kind in ("tensor", "ndarray", "npscalar"):
        i = _int(node.get("i"), f"{where}.i", 0, len(entries) - 1)
        want = "tensor" if kind == "tensor" else "ndarray"
        if entries[i]["kind"] != want or (kind == "npscalar" and entries[i]["shape"]):
            raise CorruptCheckpointError(f"{where}.i: entry {i} is not a {kind}")
        for flag in ("rg", "param"):
            if flag in node:
                _typed(node[flag], bool, f"{where}.{flag}")
        if "view" in node:
            _validate_view(node["view"], f"{where}.view", entries[i])
        if node.get("rg"):
            dtype = torch_dtype((node.get("view") or entries[i])["dtype"])
            if kind != "tensor" or not (dtype.is_floating_point or dtype.is_complex):
                raise CorruptCheckpointError(f"{where}.rg: {dtype} cannot require grad")
    elif kind in ("dict", "odict"):
        children, keys = [], set()
        for k, pair in enumerate(_typed(node.get("items"), list, f"{where}.items")):
            if not isinstance(pair, list) or len(pair) != 2:
                raise CorruptCheckpointError(f"{where}.items[{k}]: not a [key, node] pair")
            key = pair[0]
            if not isinstance(key, (str, int)) or isinstance(key, bool) or key in keys:
                raise CorruptCheckpointError(f"{where}.items[{k}]: bad or repeated key {key!r:.40}")
            keys.add(key)
            children.append((pair[1], f"{where}.items[{k}][1]"))
        return children
    elif kind in ("list", "tuple", "size", "namedtuple"):
        items = _typed(node.get("items"), list, f"{where}.items")
        if kind == "size":
            [_int(d, f"{where}.items[{k}]", -(1 << 63), (1 << 63) - 1) for k, d in enumerate(items)]
            return []
        if kind == "namedtuple":
            _qualname(node.get("cls"), f"{where}.cls")
            fields = _typed(node.get("fields"), list, f"{where}.fields")
            bad = [f for f in fields if not (isinstance(f, str) and _IDENT.match(f))]
            bad += [f for f in fields if isinstance(f, str) and keyword.iskeyword(f)]
            if bad or len(set(fields)) != len(fields) or len(fields) != len(items):
                raise CorruptCheckpointError(f"{where}.fields: bad field names {fields!r:.80}")
        return [(child, f"{where}.items[{k}]") for k, child in enumerate(items)]
    elif kind == "enum":
        _qualname(node.get("cls"), f"{where}.cls")
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            raise CorruptCheckpointError(f"{where}.v: enum value is not an int or str")
    elif kind == "state":
        _typed(node.get("cls"), str, f"{where}.cls")
        return [(value, f"{where}.v")]
    else:
        raise CorruptCheckpointError(f"{where}.t: unknown node type {kind!r:.40}")
    return []


def _qualname(value: Any, field: str) -> str:
    if not isinstance(value, str) or not _QUALNAME.match(value):
        raise CorruptCheckpointError(f"{field}: not a dotted class name: {value!r:.80}")
    return value


def validate_manifest(body: Any, path: str | os.PathLike[str] = MANIFEST) -> None:
    """Check a whole manifest body as a restore relies on it: JSON types, file records, entries
    (dtypes, devices, shapes, byte ranges inside their file), and every tree node (types, entry
    indices, nesting depth). Any defect raises ``CorruptCheckpointError`` naming ``path`` and
    the field; nothing else escapes, whatever the body holds."""
    try:
        _validate_body(body)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from None
    except (CheckpointError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest is malformed: {exc!r:.200}") from None


def _validate_body(body: Any) -> None:
    _typed(body, dict, "manifest body")
    if (
        body.get("format") != "ckpt"
        or type(body.get("version")) is not int
        or (body["version"] != FORMAT_VERSION)
    ):
        raise CorruptCheckpointError(
            f"unsupported format {body.get('format')!r:.40} version {body.get('version')!r:.40} "
            f"(this reader supports ckpt version {FORMAT_VERSION})"
        )
    if body.get("step") is not None:
        _int(body["step"], "step")
    if "created" in body and (
        not isinstance(body["created"], (int, float)) or isinstance(body["created"], bool)
    ):
        raise CorruptCheckpointError(f"created: not a number: {body['created']!r:.40}")
    if "nbytes" in body:
        _int(body["nbytes"], "nbytes")
    if "metadata" in body:
        _check_metadata(body["metadata"])
    if "metrics" in body:
        problem = _metrics_problem(body["metrics"])
        if problem is not None:
            raise CorruptCheckpointError(problem)
    sizes = _validate_files(body.get("files"))
    entries = _typed(body.get("entries"), list, "entries")
    spans = []
    for i, e in enumerate(entries):
        _validate_entry(e, f"entries[{i}]", sizes)
        if e["nbytes"]:
            spans.append((e["file"], e["offset"], e["offset"] + e["nbytes"], i))
    spans.sort()
    for (f0, _, end0, i0), (f1, start1, _, i1) in itertools.pairwise(spans):
        if f0 == f1 and start1 < end0:  # overlaps would let a small file claim unbounded memory
            raise CorruptCheckpointError(f"entries[{i1}].offset: overlaps entries[{i0}]")
    stack = [(body.get("tree"), "tree", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        for child, field in _validate_node(node, where, entries):
            stack.append((child, field, depth + 1))


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


def open_regular(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o644,
    error: type[CheckpointError] = CorruptCheckpointError,
) -> int:
    """``os.open`` of a regular file only: never through a symlink (``ELOOP``), and a FIFO,
    device or directory is an ``error`` naming ``path`` (opened ``O_NONBLOCK``, so a FIFO never
    blocks the open; the flag changes nothing for regular files)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except IsADirectoryError:
        raise error(f"{path}: not a regular file (a directory)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        kind = stat.filemode(os.fstat(fd).st_mode)
        os.close(fd)
        raise error(f"{path}: not a regular file ({kind})")
    return fd


def open_data(path: Path) -> int:
    """Open a data file for reading (``open_regular``); a missing file or a symlink is a
    ``CorruptCheckpointError`` naming it."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # never read through a symlink out of the checkpoint
            raise CorruptCheckpointError(f"{path}: data file is a symlink") from None
        raise


def check_file(directory: Path, rec: dict) -> None:
    """Check that a data file exists with exactly the size its record claims (before any
    allocation sized by that claim)."""
    path = inside(directory, rec["name"])
    fd = open_data(path)
    try:
        _check_size(path, rec, fd)
    finally:
        os.close(fd)


Target = tuple[int, torch.Tensor]
"""Where one entry's bytes go: (its offset in the data file, a uint8 tensor of its bytes)."""


def stream_file(
    directory: Path, rec: dict, targets: Sequence[Target], verify: bool, executor: Executor | None
) -> float:
    """Read a data file chunk by chunk into ``targets`` (non-overlapping byte ranges; CPU or CUDA
    tensors), checking its size first and, if ``verify``, every chunk's CRC32C. Each read is at
    most ``IO_BYTES`` into a buffer per worker thread, so the extra host memory is one such buffer
    per thread, whatever the file or ``chunk_bytes`` claim. Returns the seconds spent
    checksumming. With ``targets=[]`` this only verifies."""
    path = inside(directory, rec["name"])
    order = sorted((t for t in targets if t[1].numel()), key=lambda t: t[0])
    starts = [off for off, _ in order]
    chunk, size = rec["chunk_bytes"], rec["size"]
    local = threading.local()
    fd = open_data(path)

    def one(i: int) -> float:
        scratch = getattr(local, "buf", None)
        if scratch is None:
            scratch = local.buf = memoryview(bytearray(max(1, min(IO_BYTES, chunk, size))))
        lo, hi = i * chunk, min((i + 1) * chunk, size)
        value, crc_s = 0, 0.0
        for pos in range(lo, hi, len(scratch)):
            piece = scratch[: min(len(scratch), hi - pos)]
            _read_exact(fd, piece, pos, path)
            if verify:
                t0 = time.perf_counter()
                value = crc32c(piece, value)
                crc_s += time.perf_counter() - t0
            _scatter(order, starts, pos, piece)
        if verify and to_hex(value) != rec["crc32c"][i]:
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch in chunk {i} (bytes {lo}-{hi}): "
                f"{to_hex(value)} != {rec['crc32c'][i]}"
            )
        return crc_s

    try:
        _check_size(path, rec, fd)
        chunks = range(len(rec["crc32c"]))
        if executor is None:
            return sum(map(one, chunks))
        futures = [executor.submit(one, i) for i in chunks]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:  # after a bad chunk, read no further
            f.cancel()
        wait(futures)  # every read is over before fd is closed (and its number reused)
        for f in futures:
            error = None if f.cancelled() else f.exception()
            if error is not None:
                raise error
        return sum(f.result() for f in futures)
    finally:
        os.close(fd)


def _read_exact(fd: int, piece: memoryview, pos: int, path: Path) -> None:
    got = readinto_exactly(fd, [piece], pos, len(piece))
    if got < len(piece):
        raise CorruptCheckpointError(f"{path}: unexpected end of file at byte {pos + got}")


def _scatter(order: list[Target], starts: list[int], pos: int, piece: memoryview) -> None:
    """Copy the bytes ``[pos, pos + len(piece))`` of a file into the targets they overlap."""
    end = pos + len(piece)
    j = max(0, bisect.bisect_right(starts, pos) - 1)
    src: torch.Tensor | None = None
    while j < len(order) and order[j][0] < end:
        off, dst = order[j]
        a, b = max(pos, off), min(end, off + dst.numel())
        if a < b:
            if src is None:
                src = torch.frombuffer(piece, dtype=torch.uint8)
            dst[a - off : b - off].copy_(src[a - pos : b - pos])
        j += 1


def verify_file(directory: Path, rec: dict, executor: Executor | None = None) -> None:
    """Check a data file's size and every chunk's CRC32C without keeping its bytes."""
    stream_file(directory, rec, [], True, executor)


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
        elif e["nbytes"] == 0:
            out.append(np.empty(e["shape"], dtype=np.dtype(e["dtype"])))
        else:
            out.append(raw.numpy().view(np.dtype(e["dtype"])).reshape(e["shape"]))
    return out
