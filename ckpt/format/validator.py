"""``validate_manifest``: a whole manifest body checked as a restore relies on it.

The body is checked in named steps, each raising ``CorruptCheckpointError`` that names the
field: the header (format, version, step, created, nbytes, metadata, metrics), the file
records, the entries (dtypes, devices, shapes, byte ranges inside their file, no overlaps) and
the tree (``ckpt.format.tree``, one check per node kind, nesting bounded by ``MAX_DEPTH``).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable
from typing import Any

from ckpt._layout import MANIFEST
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.format.fields import bounded_int, extent, numpy_dtype, shape, torch_itemsize, typed
from ckpt.format.limits import ALIGN, FORMAT_VERSION, MAX_DEPTH
from ckpt.format.metrics import metrics_problem
from ckpt.format.paths import safe_relpath
from ckpt.format.tree import check_node

__all__ = ["check_entries", "check_files", "check_header", "check_tree", "validate_manifest"]

_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu)(:[0-9]{1,4})?$")


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
    typed(body, dict, "manifest body")
    check_header(body)
    sizes = check_files(body.get("files"))
    entries = check_entries(body.get("entries"), sizes)
    check_tree(body.get("tree"), entries)


def _version(body: dict[str, Any]) -> None:
    version = body.get("version")
    if body.get("format") != "ckpt" or type(version) is not int or version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"unsupported format {body.get('format')!r:.40} version {version!r:.40} "
            f"(this reader supports ckpt version {FORMAT_VERSION})"
        )


def _created(value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CorruptCheckpointError(f"created: not a number: {value!r:.40}")


def _metadata(meta: Any) -> None:
    """``metadata``: a JSON object nested at most ``MAX_DEPTH`` levels."""
    typed(meta, dict, "metadata")
    stack = [(meta, "metadata", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, f"{where}[{k!r:.40}]", depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node))


def _metrics(value: Any) -> None:
    problem = metrics_problem(value)
    if problem is not None:
        raise CorruptCheckpointError(problem)


_OPTIONAL: tuple[tuple[str, Callable[[Any], object]], ...] = (
    ("created", _created),
    ("nbytes", lambda value: bounded_int(value, "nbytes")),
    ("metadata", _metadata),
    ("metrics", _metrics),
)
"""The header's optional fields and their checks, in the order they are checked."""


def check_header(body: dict[str, Any]) -> None:
    """The format and version, then ``step`` (an int or ``None``) and each optional field."""
    _version(body)
    if body.get("step") is not None:
        bounded_int(body["step"], "step")
    for name, check in _OPTIONAL:
        if name in body:
            check(body[name])


def _file(rec: Any, where: str, sizes: dict[str, int]) -> tuple[str, int]:
    typed(rec, dict, where)
    name = safe_relpath(rec.get("name"))
    if name in sizes:
        raise CorruptCheckpointError(f"{where}.name: {name!r} listed twice")
    size = bounded_int(rec.get("size"), f"{where}.size")
    chunk = bounded_int(rec.get("chunk_bytes"), f"{where}.chunk_bytes", 1)
    crcs = typed(rec.get("crc32c"), list, f"{where}.crc32c")
    if len(crcs) != -(-size // chunk):
        raise CorruptCheckpointError(
            f"{where}.crc32c: {len(crcs)} checksums for {size} bytes in {chunk}-byte chunks"
        )
    for j, crc in enumerate(crcs):
        if not isinstance(crc, str) or not _HEX8.match(crc):
            raise CorruptCheckpointError(f"{where}.crc32c[{j}]: not 8 hex digits: {crc!r:.40}")
    return name, size


def check_files(files: Any) -> dict[str, int]:
    """The file records; returns each file's size by name (a name listed twice is refused)."""
    sizes: dict[str, int] = {}
    for k, rec in enumerate(typed(files, list, "files")):
        name, size = _file(rec, f"files[{k}]", sizes)
        sizes[name] = size
    return sizes


def _itemsize(e: dict[str, Any], where: str) -> int:
    kind = e.get("kind")
    if kind == "tensor":
        itemsize = torch_itemsize(e.get("dtype"))
        device = e.get("device", "cpu")
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise CorruptCheckpointError(f"{where}.device: unsupported device {device!r:.40}")
        return itemsize
    if kind == "ndarray":
        return numpy_dtype(e.get("dtype")).itemsize
    raise CorruptCheckpointError(f"{where}.kind: unknown kind {kind!r:.40}")


def _entry(e: Any, where: str, sizes: dict[str, int]) -> None:
    typed(e, dict, where)
    file = safe_relpath(e.get("file"))
    if file not in sizes:
        raise CorruptCheckpointError(f"{where}.file: {file!r} is not in files")
    dims = shape(e.get("shape"), f"{where}.shape")
    itemsize = _itemsize(e, where)
    off = bounded_int(e.get("offset"), f"{where}.offset")
    n = bounded_int(e.get("nbytes"), f"{where}.nbytes")
    if n != math.prod(dims) * itemsize:
        raise CorruptCheckpointError(f"{where}.nbytes: {n} != prod(shape) * itemsize")
    extent(dims, itemsize, f"{where}.shape")
    if off % ALIGN or off + n > sizes[file]:
        raise CorruptCheckpointError(
            f"{where}.offset: bytes {off}-{off + n} are unaligned or beyond {file} "
            f"({sizes[file]} bytes)"
        )


def check_entries(entries: Any, sizes: dict[str, int]) -> list[dict[str, Any]]:
    """Every entry (inside a listed file), and no two entries' bytes overlapping: overlaps would
    let a small file claim unbounded memory."""
    checked: list[dict[str, Any]] = typed(entries, list, "entries")
    spans = []
    for i, e in enumerate(checked):
        _entry(e, f"entries[{i}]", sizes)
        if e["nbytes"]:
            spans.append((e["file"], e["offset"], e["offset"] + e["nbytes"], i))
    spans.sort()
    for (f0, _, end0, i0), (f1, start1, _, i1) in itertools.pairwise(spans):
        if f0 == f1 and start1 < end0:
            raise CorruptCheckpointError(f"entries[{i1}].offset: overlaps entries[{i0}]")
    return checked


def check_tree(tree: Any, entries: list[dict[str, Any]]) -> None:
    """Every node of ``tree`` (``ckpt.format.tree.check_node``), at most ``MAX_DEPTH`` deep."""
    stack = [(tree, "tree", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        for child, field in check_node(node, where, entries):
            stack.append((child, field, depth + 1))
