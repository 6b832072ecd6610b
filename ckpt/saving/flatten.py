"""State tree <-> (JSON tree, array leaves).

A state is a nested dict/list/tuple of tensors (any device, any dtype incl. bf16/float8), numpy
arrays, Python scalars/strings/bytes and objects with ``state_dict()``. ``flatten`` turns it into a
JSON-able tree whose array leaves are replaced by indices into a list of ``Leaf`` records;
``unflatten`` builds the nested state back from the tree and the loaded arrays. Nothing is pickled.
"""

from __future__ import annotations

import base64
import enum
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckpt._torch_compat import is_parameter
from ckpt.errors import CheckpointError
from ckpt.format.dtypes import TORCH_DTYPES, torch_dtype
from ckpt.format.limits import ALIGN, MAX_DEPTH
from ckpt.types import make_enum, make_namedtuple, type_name
from feedpipe.io.rng_reader import one_reader

__all__ = [
    "ALIGN",
    "MAX_DEPTH",
    "TORCH_DTYPES",
    "Leaf",
    "Pending",
    "assign_entries",
    "flatten",
    "own_value",
    "rng_state",
    "set_rng_state",
    "storage_bytes",
    "torch_dtype",
    "unflatten",
    "walk",
]

RNG_KEY = "__rng__"


@dataclass
class Leaf:
    """One array leaf: its value (a tensor or ndarray) and what the manifest records about it."""

    value: torch.Tensor | np.ndarray
    kind: str  # "tensor" | "ndarray"
    dtype: str  # torch dtype name ("bfloat16") or numpy dtype str ("<f4")
    shape: list[int]
    nbytes: int
    path: str
    device: str = "cpu"
    stride: tuple[int, ...] = ()  # a tensor's strides (elements), an array's (bytes)


_DTYPE_NAMES: dict[torch.dtype, str] = {}
"""The name of every supported dtype met so far (an unsupported one is never cached)."""
_DEVICE_NAMES: dict[torch.device, str] = {}
"""The name of every device with data met so far (``meta`` is never cached)."""


def _dtype_name(t: torch.Tensor, path: str) -> str:
    """The name of ``t``'s dtype, checked supported (``CheckpointError`` naming ``path``)."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        if t.is_quantized:  # its dtypes (qint8, ...) are none of TORCH_DTYPES
            raise CheckpointError(f"{path}: only dense strided tensors are supported ({t.dtype})")
        raise CheckpointError(f"{path}: dtype {t.dtype} is not supported")
    _DTYPE_NAMES[t.dtype] = name
    return name


def _device_name(device: torch.device, path: str) -> str:
    """The name of ``device``, checked to hold data (``CheckpointError`` naming ``path``)."""
    if device.type == "meta":
        raise CheckpointError(f"{path}: cannot save a meta tensor (it has no data)")
    name = _DEVICE_NAMES[device] = str(device)
    return name


def _tensor_leaf(t: torch.Tensor, path: str) -> Leaf:
    """``t``'s own leaf. The checks in this order: layout, device, dtype; a device and a dtype
    seen before are known good (one dict lookup each, a save of thousands of tensors makes
    thousands of leaves)."""
    if t.layout != torch.strided:
        raise CheckpointError(f"{path}: only dense strided tensors are supported, got {t.layout}")
    device = t.device
    where = _DEVICE_NAMES.get(device) or _device_name(device, path)
    name = _DTYPE_NAMES.get(t.dtype) or _dtype_name(t, path)
    if t.requires_grad or t.is_conj() or t.is_neg():
        t = own_value(t)
    return Leaf(t, "tensor", name, list(t.shape), t.nbytes, path, where, t.stride())


def _array_leaf(a: np.ndarray, path: str) -> Leaf:
    if a.dtype.hasobject or a.dtype.fields is not None:
        raise CheckpointError(f"{path}: numpy dtype {a.dtype} (object/structured) is not supported")
    return Leaf(a, "ndarray", a.dtype.str, list(a.shape), int(a.nbytes), path, "cpu", a.strides)


Node = dict[str, Any]
Pending = tuple[Node, Any, str]
"""An array node waiting for its entry (``"i"``, ``"view"``), its value and its path."""
_Pending = Pending


def flatten(state: Any, leaves: list[Leaf] | None = None, path: str = "state") -> dict[str, Any]:
    """Return the JSON tree of ``state``, appending its array leaves to ``leaves``.

    Tensors that share one storage (tied weights, views) become one entry holding the storage's
    bytes they span, and each tensor a view of it (dtype, shape, stride, offset), when that span
    is no larger than the tensors' own bytes together; otherwise each is stored as a copy."""
    if leaves is None:
        leaves = []
    tree, pending = walk(state, path)
    assign_entries(pending, leaves)
    return tree


def walk(state: Any, path: str = "state") -> tuple[Node, list[Pending]]:
    """The JSON tree of ``state`` and its array nodes, in tree order, before their entries are
    assigned (``assign_entries``); ``flatten`` is the two in a row."""
    walker = _Flattener()
    return walker.node(state, path, 0), walker.tensors


def assign_entries(pending: list[Pending], leaves: list[Leaf]) -> None:
    """Give every array node of ``pending`` its entry, appending the leaves to ``leaves``: a
    storage shared by tensors is one uint8 entry (at its first tensor) that each of them views."""
    _tensor_entries(pending, leaves)


class _Flattener:
    """One walk of a state: a node per value, by the first rule of ``RULES`` its type matches
    (order matters: a bool is an int, an ``IntEnum`` an int, a ``torch.Size`` a tuple); array
    values are collected in ``tensors`` for their entries."""

    def __init__(self) -> None:
        self.tensors: list[_Pending] = []

    def node(self, obj: Any, path: str, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path}: the state is nested deeper than {MAX_DEPTH} levels")
        rule = _BY_TYPE.get(type(obj))
        if rule is not None:
            return rule(self, obj, path, depth)
        for types, rule in _RULES:
            if isinstance(obj, types):
                _BY_TYPE[type(obj)] = rule
                return rule(self, obj, path, depth)
        if callable(getattr(obj, "state_dict", None)):
            value = self.node(obj.state_dict(), path, depth + 1)
            return {"t": "state", "cls": type_name(type(obj)), "v": value}
        raise CheckpointError(
            f"{path}: cannot save a {type(obj).__name__} (use tensors, arrays, scalars, strings, "
            "dicts/lists or objects with state_dict())"
        )

    def tensor(self, obj: torch.Tensor, path: str, depth: int) -> Node:
        if obj.is_nested:
            raise CheckpointError(
                f"{path}: cannot save a nested tensor (no dense strided storage); save its "
                "components instead, e.g. list(t.unbind())"
            )
        node: Node = {"t": "tensor"}
        if obj.requires_grad:
            node["rg"] = True
        if is_parameter(obj):
            node["param"] = True
        self.tensors.append((node, obj, path))
        return node

    def value(self, obj: Any, path: str, depth: int) -> Node:
        return {"t": "v", "v": obj}

    def enum(self, obj: enum.Enum, path: str, depth: int) -> Node:
        if type(obj.value) not in (int, str):
            raise CheckpointError(f"{path}: cannot save {obj!r} (enum values must be int or str)")
        return {"t": "enum", "cls": type_name(type(obj)), "v": obj.value}

    def string(self, obj: str, path: str, depth: int) -> Node:
        return {"t": "v", "v": str(obj)}

    def integer(self, obj: int, path: str, depth: int) -> Node:
        if isinstance(obj, np.generic):
            return self.numpy(obj, path, depth)
        return {"t": "v", "v": int(obj)}

    def real(self, obj: float, path: str, depth: int) -> Node:
        return {"t": "v", "v": obj} if math.isfinite(obj) else {"t": "float", "v": repr(obj)}

    def numpy(self, obj: np.ndarray | np.generic, path: str, depth: int) -> Node:
        node: Node = {"t": "ndarray" if isinstance(obj, np.ndarray) else "npscalar"}
        self.tensors.append((node, np.asarray(obj), path))
        return node

    def raw(self, obj: bytes | bytearray, path: str, depth: int) -> Node:
        kind = "bytearray" if isinstance(obj, bytearray) else "bytes"
        return {"t": kind, "v": base64.b64encode(bytes(obj)).decode("ascii")}

    def dtype(self, obj: torch.dtype, path: str, depth: int) -> Node:
        return {"t": "dtype", "v": str(obj).removeprefix("torch.")}

    def device(self, obj: torch.device, path: str, depth: int) -> Node:
        return {"t": "device", "v": str(obj)}

    def mapping(self, obj: Mapping[Any, Any], path: str, depth: int) -> Node:
        items: list[list[Any]] = []
        node, deeper = self.node, depth + 1
        for key, value in obj.items():
            if type(key) is str:  # the common key: checked and converted below otherwise
                items.append([key, node(value, f"{path}[{key!r}]", deeper)])
                continue
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CheckpointError(f"{path}: dict key {key!r} must be str or int")
            key = str(key) if isinstance(key, str) else int(key)
            items.append([key, self.node(value, f"{path}[{key!r}]", depth + 1)])
        return {"t": "odict" if isinstance(obj, OrderedDict) else "dict", "items": items}

    def size(self, obj: torch.Size, path: str, depth: int) -> Node:
        return {"t": "size", "items": [int(d) for d in obj]}

    def sequence(self, obj: list[Any] | tuple[Any, ...], path: str, depth: int) -> Node:
        elems = [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        fields = getattr(type(obj), "_fields", None)
        if isinstance(obj, tuple) and isinstance(fields, tuple):
            cls = type_name(type(obj))
            return {"t": "namedtuple", "cls": cls, "fields": list(fields), "items": elems}
        return {"t": "list" if isinstance(obj, list) else "tuple", "items": elems}


_Rule = Callable[[_Flattener, Any, str, int], Node]
_RULES: tuple[tuple[type | tuple[type, ...], _Rule], ...] = (
    (torch.Tensor, _Flattener.tensor),  # the common leaf first
    ((type(None), bool), _Flattener.value),
    (enum.Enum, _Flattener.enum),
    (str, _Flattener.string),
    (int, _Flattener.integer),
    (float, _Flattener.real),
    ((np.ndarray, np.generic), _Flattener.numpy),
    ((bytes, bytearray), _Flattener.raw),
    (torch.dtype, _Flattener.dtype),
    (torch.device, _Flattener.device),
    (Mapping, _Flattener.mapping),
    (torch.Size, _Flattener.size),
    ((list, tuple), _Flattener.sequence),
)
"""Which node a value becomes: the first rule whose types it is an instance of."""
_BY_TYPE: dict[type, _Rule] = {}
"""The rule each type met so far resolved to (the same for every instance of a type): one
dict lookup per node instead of a walk down ``_RULES``."""


def _storage_key(t: torch.Tensor, leaf: Leaf, k: int) -> tuple[Any, int]:
    """Which storage tensor ``t`` (validated: its ``leaf`` made) views, or ``("own", k)`` where
    sharing cannot apply (no bytes, a conjugate/negative bit, no plain storage). The leaf's
    value is ``t`` itself unless ``t`` was detached or had a bit resolved."""
    if not leaf.nbytes or (leaf.value is not t and (t.is_conj() or t.is_neg())):
        return ("own", k)
    try:
        # the storage's address (its data pointer less the tensor's offset in bytes): a third
        # of the cost of ``t.untyped_storage().data_ptr()``, which makes a storage object
        return leaf.device, t.data_ptr() - int(t.storage_offset()) * t.element_size()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return ("own", k)


def _own_leaves(tensors: list[_Pending]) -> tuple[list[Leaf], list[tuple[Any, int]]]:
    """Per array node, in tree order: its own leaf (an unsupported value raises here, the
    first in tree order) and the key of the storage it views (one read of each attribute)."""
    made: list[Leaf] = []
    keys: list[tuple[Any, int]] = []
    for k, (_, value, path) in enumerate(tensors):
        if isinstance(value, torch.Tensor):
            leaf = _tensor_leaf(value, path)
            keys.append(_storage_key(value, leaf, k))
        else:
            leaf = _array_leaf(value, path)
            keys.append(("own", k))
        made.append(leaf)
    return made, keys


def _tensor_entries(tensors: list[_Pending], leaves: list[Leaf]) -> None:
    """Give every array node its entry, in tree order: a storage shared by tensors is one uint8
    entry (at its first tensor) that each of them views."""
    made, keys = _own_leaves(tensors)
    shared = _shared_groups(tensors, keys)
    done: set[int] = set()
    for k, (node, _, _) in enumerate(tensors):
        if k in done:
            continue
        if k in shared:
            _shared_entry([tensors[j] for j in shared[k]], leaves)
            done.update(shared[k])
            continue
        leaves.append(made[k])
        node["i"] = len(leaves) - 1


def _shared_groups(tensors: list[_Pending], keys: list[tuple[Any, int]]) -> dict[int, list[int]]:
    """The tensors stored as views of one shared entry: first member -> members, for each
    storage viewed by several tensors whose span is no larger than their bytes together."""
    groups: dict[Any, list[int]] = {}
    for k, key in enumerate(keys):
        groups.setdefault(key, []).append(k)
    shared: dict[int, list[int]] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        spans = [_byte_span(tensors[k][1]) for k in members]
        lo, hi = min(a for a, _ in spans) // ALIGN * ALIGN, max(b for _, b in spans)
        if hi - lo <= sum(b - a for a, b in spans):
            shared[members[0]] = members
    return shared


def _shared_entry(members: list[_Pending], leaves: list[Leaf]) -> None:
    ts: list[torch.Tensor] = [t for _, t, _ in members]
    spans = [_byte_span(t) for t in ts]
    lo, hi = min(a for a, _ in spans) // ALIGN * ALIGN, max(b for _, b in spans)
    base = storage_bytes(ts[0], lo, hi - lo)
    leaves.append(
        Leaf(base, "tensor", "uint8", [hi - lo], hi - lo, members[0][2], str(base.device), (1,))
    )
    for node, t, _ in members:
        node["i"] = len(leaves) - 1
        node["view"] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset() * t.element_size() - lo,
        }


def storage_bytes(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[start, start + nbytes)`` of the storage ``t`` views, as a flat uint8 tensor."""
    with torch.no_grad():
        base = torch.empty(0, dtype=torch.uint8, device=t.device)
        base.set_(t.untyped_storage(), start, (nbytes,), (1,))
    return base


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that tensor ``t`` covers."""
    start = int(t.storage_offset()) * t.element_size()
    last = sum((int(d) - 1) * int(s) for d, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def unflatten(tree: Any, arrays: list[Any], path: str = "state") -> Any:
    """Rebuild the nested state from a (validated) manifest tree and its loaded arrays."""
    if not isinstance(tree, dict) or "t" not in tree:
        raise CheckpointError(f"manifest tree node at {path} is malformed")
    kind = tree["t"]
    build = _BUILDERS.get(kind)
    if build is None:
        raise CheckpointError(f"manifest tree node at {path} has unknown type {kind!r}")
    return build(tree, arrays, path)


def _items(tree: Node, arrays: list[Any], path: str) -> list[Any]:
    return [unflatten(v, arrays, f"{path}[{i}]") for i, v in enumerate(tree["items"])]


def _pairs(tree: Node, arrays: list[Any], path: str) -> list[tuple[Any, Any]]:
    return [(k, unflatten(v, arrays, f"{path}[{k!r}]")) for k, v in tree["items"]]


def _namedtuple(tree: Node, arrays: list[Any], path: str) -> Any:
    return make_namedtuple(tree["cls"], tree["fields"], _items(tree, arrays, path))


_Builder = Callable[[Node, list[Any], str], Any]
_BUILDERS: dict[str, _Builder] = {
    "v": lambda tree, arrays, path: tree["v"],
    "float": lambda tree, arrays, path: float(tree["v"]),
    "tensor": lambda tree, arrays, path: _tensor(tree, arrays[tree["i"]]),
    "ndarray": lambda tree, arrays, path: arrays[tree["i"]],
    "npscalar": lambda tree, arrays, path: arrays[tree["i"]][()],
    "bytes": lambda tree, arrays, path: base64.b64decode(tree["v"]),
    "bytearray": lambda tree, arrays, path: bytearray(base64.b64decode(tree["v"])),
    "dtype": lambda tree, arrays, path: torch_dtype(tree["v"]),
    "device": lambda tree, arrays, path: torch.device(tree["v"]),
    "dict": lambda tree, arrays, path: dict(_pairs(tree, arrays, path)),
    "odict": lambda tree, arrays, path: OrderedDict(_pairs(tree, arrays, path)),
    "size": lambda tree, arrays, path: torch.Size(tree["items"]),
    "enum": lambda tree, arrays, path: make_enum(tree["cls"], tree["v"]),
    "list": _items,
    "tuple": lambda tree, arrays, path: tuple(_items(tree, arrays, path)),
    "namedtuple": _namedtuple,
    "state": lambda tree, arrays, path: unflatten(tree["v"], arrays, path),
}
"""How each kind of manifest tree node becomes a value again (``unflatten``)."""


def _tensor(node: Node, value: torch.Tensor) -> torch.Tensor:
    view = node.get("view")
    if view is not None:
        dtype = torch_dtype(view["dtype"])
        start = value.storage_offset() + view["offset"]  # value is a uint8 tensor: bytes
        t = torch.empty(0, dtype=dtype, device=value.device)
        offset, shape, stride = start // dtype.itemsize, view["shape"], view["stride"]
        value = t.set_(value.untyped_storage(), offset, shape, stride)
    if node.get("param"):
        return torch.nn.Parameter(value, requires_grad=node.get("rg", False))
    if node.get("rg") and not value.requires_grad:
        value.requires_grad_(True)
    return value


def rng_state() -> dict[str, Any]:
    """The Python, numpy, torch CPU and (when available) CUDA generator states."""
    return one_reader(_rng_state)  # feedpipe's thread workers read it too (see one_reader)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generator states saved by ``rng_state``."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"]).cpu().clone())  # a view segfaults
    if "cuda" in state and torch.cuda.is_available():
        # one state per device saved; a process that sees fewer devices (restored on a smaller
        # node) sets those it has: set_rng_state_all raised IndexError past the last one
        saved = list(state["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([torch.as_tensor(s).cpu().clone() for s in saved])


def own_value(t: torch.Tensor) -> torch.Tensor:
    """The value a tensor of its own entry is stored as: detached, conj and neg bits resolved."""
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t
