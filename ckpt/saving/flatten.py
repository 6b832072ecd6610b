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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckpt.errors import CheckpointError
from ckpt.format.dtypes import TORCH_DTYPES, torch_dtype
from ckpt.format.limits import ALIGN, MAX_DEPTH
from ckpt.types import make_enum, make_namedtuple, type_name

__all__ = [
    "ALIGN",
    "MAX_DEPTH",
    "TORCH_DTYPES",
    "Leaf",
    "flatten",
    "rng_state",
    "set_rng_state",
    "torch_dtype",
    "unflatten",
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
_DEVICE_NAMES: dict[torch.device, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def _tensor_leaf(t: torch.Tensor, path: str) -> Leaf:
    if t.layout != torch.strided or t.is_quantized:
        raise CheckpointError(f"{path}: only dense strided tensors are supported, got {t.layout}")
    device = t.device
    if device.type == "meta":
        raise CheckpointError(f"{path}: cannot save a meta tensor (it has no data)")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    name = _dtype_name(t.dtype)
    if name not in TORCH_DTYPES:
        raise CheckpointError(f"{path}: dtype {t.dtype} is not supported")
    nbytes = t.numel() * t.element_size()
    shape, stride = list(t.shape), t.stride()
    return Leaf(t, "tensor", name, shape, nbytes, path, _device_name(device), stride)


def _array_leaf(a: np.ndarray, path: str) -> Leaf:
    if a.dtype.hasobject or a.dtype.fields is not None:
        raise CheckpointError(f"{path}: numpy dtype {a.dtype} (object/structured) is not supported")
    return Leaf(a, "ndarray", a.dtype.str, list(a.shape), int(a.nbytes), path, "cpu", a.strides)


def flatten(state: Any, leaves: list[Leaf] | None = None, path: str = "state") -> dict[str, Any]:
    """Return the JSON tree of ``state``, appending its array leaves to ``leaves``.

    Tensors that share one storage (tied weights, views) become one entry holding the storage's
    bytes they span, and each tensor a view of it (dtype, shape, stride, offset), when that span
    is no larger than the tensors' own bytes together; otherwise each is stored as a copy."""
    if leaves is None:
        leaves = []
    tensors: list[tuple[dict[str, Any], torch.Tensor, str]] = []
    tree = _flatten(state, leaves, tensors, path, 0)
    _tensor_entries(tensors, leaves)
    return tree


def _flatten(obj: Any, leaves: list[Leaf], tensors: list, path: str, depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{path}: the state is nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, torch.Tensor):  # the common leaf first
        if obj.is_nested:
            raise CheckpointError(
                f"{path}: cannot save a nested tensor (no dense strided storage); save its "
                "components instead, e.g. list(t.unbind())"
            )
        node: dict[str, Any] = {"t": "tensor"}
        if obj.requires_grad:
            node["rg"] = True
        if _is_parameter(obj):
            node["param"] = True
        tensors.append((node, obj, path))
        return node
    if obj is None or isinstance(obj, bool):
        return {"t": "v", "v": obj}
    if isinstance(obj, enum.Enum):
        if type(obj.value) not in (int, str):
            raise CheckpointError(f"{path}: cannot save {obj!r} (enum values must be int or str)")
        return {"t": "enum", "cls": type_name(type(obj)), "v": obj.value}
    if isinstance(obj, str):
        return {"t": "v", "v": str(obj)}
    if isinstance(obj, int) and not isinstance(obj, np.generic):
        return {"t": "v", "v": int(obj)}
    if isinstance(obj, float):
        return {"t": "v", "v": obj} if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
    if isinstance(obj, (np.ndarray, np.generic)):
        node = {"t": "ndarray" if isinstance(obj, np.ndarray) else "npscalar"}
        tensors.append((node, np.asarray(obj), path))
        return node
    if isinstance(obj, (bytes, bytearray)):
        kind = "bytearray" if isinstance(obj, bytearray) else "bytes"
        return {"t": kind, "v": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"t": "device", "v": str(obj)}
    if isinstance(obj, Mapping):
        items = []
        for key, value in obj.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CheckpointError(f"{path}: dict key {key!r} must be str or int")
            key = str(key) if isinstance(key, str) else int(key)
            items.append([key, _flatten(value, leaves, tensors, f"{path}[{key!r}]", depth + 1)])
        return {"t": "odict" if isinstance(obj, OrderedDict) else "dict", "items": items}
    if isinstance(obj, torch.Size):
        return {"t": "size", "items": [int(d) for d in obj]}
    if isinstance(obj, (list, tuple)):
        elems = [_flatten(v, leaves, tensors, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        fields = getattr(type(obj), "_fields", None)
        if isinstance(obj, tuple) and isinstance(fields, tuple):
            return {
                "t": "namedtuple",
                "cls": type_name(type(obj)),
                "fields": list(fields),
                "items": elems,
            }
        return {"t": "list" if isinstance(obj, list) else "tuple", "items": elems}
    if callable(getattr(obj, "state_dict", None)):
        cls = type_name(type(obj))
        value = _flatten(obj.state_dict(), leaves, tensors, path, depth + 1)
        return {"t": "state", "cls": cls, "v": value}
    raise CheckpointError(
        f"{path}: cannot save a {type(obj).__name__} (use tensors, arrays, scalars, strings, "
        "dicts/lists or objects with state_dict())"
    )


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)``, without the metaclass hook's cost for plain tensors."""
    if type(t) is torch.Tensor:  # what Parameter's __instancecheck__ does for a plain tensor
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, torch.nn.Parameter)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """Which storage ``t`` views (``None`` where sharing cannot apply)."""
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or not t.numel():
        return None
    device = t.device
    if device.type == "meta" or _dtype_name(t.dtype) not in TORCH_DTYPES:
        return None
    try:
        return _device_name(device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None


def _tensor_entries(tensors: list[tuple[dict, Any, str]], leaves: list[Leaf]) -> None:
    """Give every array node its entry, in tree order: a storage shared by tensors is one uint8
    entry (at its first tensor) that each of them views."""
    groups: dict[Any, list[int]] = {}
    for k, (_, t, _) in enumerate(tensors):
        key = _storage_key(t) if isinstance(t, torch.Tensor) else None
        groups.setdefault(key if key is not None else ("own", k), []).append(k)
    shared: dict[int, list[int]] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        spans = [_byte_span(tensors[k][1]) for k in members]
        lo, hi = min(a for a, _ in spans) // ALIGN * ALIGN, max(b for _, b in spans)
        if hi - lo <= sum(b - a for a, b in spans):
            shared[members[0]] = members
    done: set[int] = set()
    for k, (node, value, path) in enumerate(tensors):
        if k in done:
            continue
        if k in shared:
            _shared_entry([tensors[j] for j in shared[k]], leaves)
            done.update(shared[k])
        elif isinstance(value, torch.Tensor):
            leaves.append(_tensor_leaf(value, path))
            node["i"] = len(leaves) - 1
        else:
            leaves.append(_array_leaf(value, path))
            node["i"] = len(leaves) - 1


def _shared_entry(members: list[tuple[dict, torch.Tensor, str]], leaves: list[Leaf]) -> None:
    ts = [t for _, t, _ in members]
    spans = [_byte_span(t) for t in ts]
    lo, hi = min(a for a, _ in spans) // ALIGN * ALIGN, max(b for _, b in spans)
    with torch.no_grad():
        base = torch.empty(0, dtype=torch.uint8, device=ts[0].device)
        base.set_(ts[0].untyped_storage(), lo, (hi - lo,), (1,))
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
    if kind == "v":
        return tree["v"]
    if kind == "float":
        return float(tree["v"])
    if kind == "tensor":
        return _tensor(tree, arrays[tree["i"]])
    if kind == "ndarray":
        return arrays[tree["i"]]
    if kind == "npscalar":
        return arrays[tree["i"]][()]
    if kind in ("bytes", "bytearray"):
        raw = base64.b64decode(tree["v"])
        return raw if kind == "bytes" else bytearray(raw)
    if kind == "dtype":
        return torch_dtype(tree["v"])
    if kind == "device":
        return torch.device(tree["v"])
    if kind in ("dict", "odict"):
        pairs = [(k, unflatten(v, arrays, f"{path}[{k!r}]")) for k, v in tree["items"]]
        return dict(pairs) if kind == "dict" else OrderedDict(pairs)
    if kind == "size":
        return torch.Size(tree["items"])
    if kind == "enum":
        return make_enum(tree["cls"], tree["v"])
    if kind in ("list", "tuple", "namedtuple"):
        items = [unflatten(v, arrays, f"{path}[{i}]") for i, v in enumerate(tree["items"])]
        if kind == "namedtuple":
            return make_namedtuple(tree["cls"], tree["fields"], items)
        return items if kind == "list" else tuple(items)
    if kind == "state":
        return unflatten(tree["v"], arrays, path)
    raise CheckpointError(f"manifest tree node at {path} has unknown type {kind!r}")


def _tensor(node: dict, value: torch.Tensor) -> torch.Tensor:
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
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
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
