"""The checks of single manifest fields, each raising ``CorruptCheckpointError`` that names the
field: typed values, bounded ints, shapes, dtypes and class names. The validator
(``ckpt.format.validator``) and the tree checks (``ckpt.format.tree``) are built from these."""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

import numpy as np

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.format.dtypes import torch_dtype
from ckpt.format.limits import MAX_BYTES, MAX_NDIM

__all__ = [
    "MAX_NDIM",
    "bounded_int",
    "extent",
    "numpy_dtype",
    "qualname",
    "shape",
    "torch_itemsize",
    "typed",
]

_T = TypeVar("_T")
_NP_DTYPE = re.compile(r"^[<>|=][biufcmMSUV][0-9]{1,6}(\[[0-9]{0,3}[A-Za-z]{1,2}\])?$")
_QUALNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|<locals>)){0,31}$")


def torch_itemsize(name: Any) -> int:
    """The element size of a supported torch dtype name; ``CorruptCheckpointError`` otherwise."""
    try:
        return torch_dtype(name).itemsize
    except CheckpointError as exc:
        raise CorruptCheckpointError(str(exc)) from None


def numpy_dtype(name: Any) -> np.dtype[Any]:
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


def bounded_int(value: Any, field: str, low: int = 0, high: int = MAX_BYTES) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``."""
    if type(value) is not int or not low <= value <= high:
        raise CorruptCheckpointError(f"{field}: expected an int in [{low}, {high}], got {value!r}")
    return value


def typed(value: Any, kind: type[_T], field: str) -> _T:
    """``value`` if it is a ``kind`` (a bool counts only as a bool)."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CorruptCheckpointError(f"{field}: expected {kind.__name__}, got {value!r:.80}")
    return value


def shape(value: Any, field: str) -> list[int]:
    """A list of at most ``MAX_NDIM`` non-negative ints."""
    dims = typed(value, list, field)
    if len(dims) > MAX_NDIM:
        raise CorruptCheckpointError(f"{field}: more than {MAX_NDIM} dimensions")
    return [bounded_int(d, f"{field}[{k}]") for k, d in enumerate(dims)]


def extent(dims: list[int], itemsize: int, field: str) -> None:
    """Refuse a shape whose dims (a zero dim counted as 1) span more than ``MAX_BYTES``: torch's
    stride calculation and numpy's size check overflow on it even when it holds no element."""
    if math.prod(max(d, 1) for d in dims) * max(itemsize, 1) > MAX_BYTES:
        raise CorruptCheckpointError(f"{field}: dimensions {dims} overflow (over 2**62 bytes)")


def qualname(value: Any, field: str) -> str:
    """A dotted class name (``<locals>`` allowed as a component)."""
    if not isinstance(value, str) or not _QUALNAME.match(value):
        raise CorruptCheckpointError(f"{field}: not a dotted class name: {value!r:.80}")
    return value
