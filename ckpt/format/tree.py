"""The checks of the manifest's ``tree``, one per node kind (``"t"``), in the table ``NODES``.

``check_node`` checks one node and returns its children (node, field) for the caller's walk to
check next (the walk bounds the nesting depth). A new node kind is one new entry in ``NODES``.
"""

from __future__ import annotations

import base64
import keyword
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format.dtypes import torch_dtype
from ckpt.format.fields import bounded_int, extent, qualname, shape, torch_itemsize, typed

__all__ = ["NODES", "Child", "NodeCheck", "check_node"]

Child = tuple[Any, str]
"""A child node to check next and the field that names it."""

NodeCheck = Callable[[dict[str, Any], str, list[dict[str, Any]]], list[Child]]
"""Checks one node of its kind: ``(node, where, entries) -> children``."""

_SCALARS = (type(None), bool, int, float, str)
_VALUED = ("v", "float", "bytes", "bytearray", "dtype", "device", "enum", "state")
_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,99}$")
_DEVICE_NAME = re.compile(r"^[a-z]{2,12}(:[0-9]{1,4})?$")


def _scalar(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    value = node["v"]
    finite = not isinstance(value, float) or math.isfinite(value)
    if not isinstance(value, _SCALARS) or not finite:
        raise CorruptCheckpointError(f"{where}.v: not a JSON scalar: {value!r:.40}")
    return []


def _float(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    if node["v"] not in ("nan", "inf", "-inf"):
        raise CorruptCheckpointError(f"{where}.v: not nan/inf/-inf: {node['v']!r:.40}")
    return []


def _bytes(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    try:
        base64.b64decode(typed(node["v"], str, f"{where}.v"), validate=True)
    except ValueError:
        raise CorruptCheckpointError(f"{where}.v: not base64") from None
    return []


def _dtype(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    torch_itemsize(node["v"])
    return []


def _device(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    value = node["v"]
    try:
        if not isinstance(value, str) or not _DEVICE_NAME.match(value):
            raise ValueError(value)
        torch.device(value)
    except (RuntimeError, ValueError):
        raise CorruptCheckpointError(f"{where}.v: not a device name: {value!r:.40}") from None
    return []


def _view(view: Any, where: str, entry: dict[str, Any]) -> None:
    """A tensor node's ``view``: a strided view into a shared-storage (uint8) entry."""
    typed(view, dict, where)
    itemsize = torch_itemsize(view.get("dtype"))
    dims = shape(view.get("shape"), f"{where}.shape")
    stride = shape(view.get("stride"), f"{where}.stride")
    off = bounded_int(view.get("offset"), f"{where}.offset")
    extent(dims, itemsize, f"{where}.shape")
    if len(stride) != len(dims) or off % itemsize:
        raise CorruptCheckpointError(f"{where}: stride/shape lengths differ or unaligned offset")
    if entry.get("kind") != "tensor" or entry.get("dtype") != "uint8":
        raise CorruptCheckpointError(f"{where}: a view needs a uint8 tensor entry")
    if 0 not in dims:
        end = off + (1 + sum((d - 1) * s for d, s in zip(dims, stride, strict=True))) * itemsize
        if end > entry["nbytes"]:
            raise CorruptCheckpointError(f"{where}: view ends at byte {end}, beyond its entry")


def _leaf(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """A ``tensor``, ``ndarray`` or ``npscalar`` node: an index into ``entries``."""
    kind = node["t"]
    i = bounded_int(node.get("i"), f"{where}.i", 0, len(entries) - 1)
    want = "tensor" if kind == "tensor" else "ndarray"
    if entries[i]["kind"] != want or (kind == "npscalar" and entries[i]["shape"]):
        raise CorruptCheckpointError(f"{where}.i: entry {i} is not a {kind}")
    for flag in ("rg", "param"):
        if flag in node:
            typed(node[flag], bool, f"{where}.{flag}")
    if "view" in node:
        _view(node["view"], f"{where}.view", entries[i])
    if node.get("rg"):
        dtype = torch_dtype((node.get("view") or entries[i])["dtype"])
        if kind != "tensor" or not (dtype.is_floating_point or dtype.is_complex):
            raise CorruptCheckpointError(f"{where}.rg: {dtype} cannot require grad")
    return []


def _mapping(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """A ``dict`` or ``odict`` node: ``[key, node]`` pairs, keys str or int and unique."""
    children: list[Child] = []
    keys: set[Any] = set()
    for k, pair in enumerate(typed(node.get("items"), list, f"{where}.items")):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CorruptCheckpointError(f"{where}.items[{k}]: not a [key, node] pair")
        key = pair[0]
        if not isinstance(key, (str, int)) or isinstance(key, bool) or key in keys:
            raise CorruptCheckpointError(f"{where}.items[{k}]: bad or repeated key {key!r:.40}")
        keys.add(key)
        children.append((pair[1], f"{where}.items[{k}][1]"))
    return children


def _items(node: dict[str, Any], where: str) -> list[Any]:
    return typed(node.get("items"), list, f"{where}.items")


def _sequence(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """A ``list`` or ``tuple`` node: its items are nodes."""
    return [(child, f"{where}.items[{k}]") for k, child in enumerate(_items(node, where))]


def _size(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """A ``torch.Size``: its items are int64 values, not nodes."""
    for k, d in enumerate(_items(node, where)):
        bounded_int(d, f"{where}.items[{k}]", -(1 << 63), (1 << 63) - 1)
    return []


def _namedtuple(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """A namedtuple: its class, one identifier per item, and the items (nodes)."""
    items = _items(node, where)
    qualname(node.get("cls"), f"{where}.cls")
    fields = typed(node.get("fields"), list, f"{where}.fields")
    bad = [f for f in fields if not (isinstance(f, str) and _IDENT.match(f))]
    bad += [f for f in fields if isinstance(f, str) and keyword.iskeyword(f)]
    if bad or len(set(fields)) != len(fields) or len(fields) != len(items):
        raise CorruptCheckpointError(f"{where}.fields: bad field names {fields!r:.80}")
    return [(child, f"{where}.items[{k}]") for k, child in enumerate(items)]


def _enum(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    qualname(node.get("cls"), f"{where}.cls")
    value = node["v"]
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise CorruptCheckpointError(f"{where}.v: enum value is not an int or str")
    return []


def _state(node: dict[str, Any], where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """A registered type's state: its class name, and the state itself (a node)."""
    typed(node.get("cls"), str, f"{where}.cls")
    return [(node["v"], f"{where}.v")]


NODES: Mapping[str, NodeCheck] = {
    "v": _scalar,
    "float": _float,
    "bytes": _bytes,
    "bytearray": _bytes,
    "dtype": _dtype,
    "device": _device,
    "tensor": _leaf,
    "ndarray": _leaf,
    "npscalar": _leaf,
    "dict": _mapping,
    "odict": _mapping,
    "list": _sequence,
    "tuple": _sequence,
    "size": _size,
    "namedtuple": _namedtuple,
    "enum": _enum,
    "state": _state,
}
"""The check of each node kind."""


def check_node(node: Any, where: str, entries: list[dict[str, Any]]) -> list[Child]:
    """Check one tree node; return its children (node, field) to check next."""
    typed(node, dict, where)
    kind = node.get("t")
    check = NODES.get(kind) if isinstance(kind, str) else None
    if check is None:
        raise CorruptCheckpointError(f"{where}.t: unknown node type {kind!r:.40}")
    if kind in _VALUED and "v" not in node:
        raise CorruptCheckpointError(f"{where}.v: missing")
    return check(node, where, entries)
