"""What ``default_collate(samples)`` would build, planned before any byte is written.

:class:`SlotLayout` reads the samples' structure (``dict``, ``list``/``tuple``, namedtuple) and
one leaf per position, each by the reader of its kind (tensors, numeric numpy arrays and scalars,
Python ``int``/``float``/``bool``); anything else is an :class:`UnsupportedLayoutError` and goes
through ``default_collate`` itself. :mod:`feedpipe.loader.slots` writes a layout into a worker's
slot and :func:`rebuild` makes the batch again from the slot's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGN", "SlotLayout", "UnsupportedLayoutError", "align", "rebuild"]

ALIGN = 64  # each leaf of a slot starts at a multiple of this


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class UnsupportedLayoutError(Exception):
    """The samples hold something ``collate_into`` leaves to ``default_collate``."""


@dataclass(frozen=True)
class _Leaf:
    """One leaf position of the samples: its column, and the dtype, per-sample shape and kind
    (``"tensor"``, ``"array"``, ``"npscalar"`` or ``"py"``) ``default_collate`` gives it."""

    column: list[Any]
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str

    def nbytes(self, n: int) -> int:
        """Bytes of the collated column for ``n`` samples."""
        return n * int(np.prod(self.shape)) * self.dtype.itemsize

    def write(self, out: torch.Tensor) -> None:
        """Stack the column into ``out`` (``n`` rows of ``shape``)."""
        if self.kind == "tensor":
            torch.stack(self.column, 0, out=out)
        elif self.kind == "array":
            np.stack(self.column, axis=0, out=out.numpy())
        else:  # Python or numpy scalars
            out.numpy()[...] = self.column


def _same(samples: list[Any], attr: str) -> bool:
    """Whether every sample has the first one's ``shape`` or ``dtype``."""
    first = getattr(samples[0], attr)
    return all(getattr(s, attr) == first for s in samples)


def _tensor_leaf(samples: list[Any]) -> _Leaf:
    elem = samples[0]
    if elem.is_sparse or elem.device.type != "cpu" or elem.requires_grad:
        raise UnsupportedLayoutError
    if not _same(samples, "shape") or not _same(samples, "dtype"):
        raise UnsupportedLayoutError  # default_collate raises its own error for a shape mismatch
    return _Leaf(samples, elem.dtype, tuple(elem.shape), "tensor")


def _array_leaf(samples: list[Any]) -> _Leaf:
    """numpy arrays and memmaps (``default_collate`` treats both the same)."""
    elem = samples[0]
    if elem.dtype.kind not in "biufc" or elem.dtype.byteorder == ">":
        raise UnsupportedLayoutError
    size = elem.dtype.itemsize  # torch.as_tensor refuses negative or partial strides
    if any(st < 0 or st % size for s in samples for st in s.strides):
        raise UnsupportedLayoutError
    dtype = _torch_dtype(elem)
    if not _same(samples, "shape") or not _same(samples, "dtype"):
        raise UnsupportedLayoutError
    return _Leaf(samples, dtype, tuple(elem.shape), "array")


def _npscalar_leaf(samples: list[Any]) -> _Leaf:
    if samples[0].dtype.kind not in "biufc":
        raise UnsupportedLayoutError
    dtype = _torch_dtype(samples[0])
    if not _same(samples, "dtype"):
        raise UnsupportedLayoutError
    return _Leaf(samples, dtype, (), "npscalar")


_PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


def _py_leaf(samples: list[Any]) -> _Leaf:
    return _Leaf(samples, _PY_DTYPES[type(samples[0])], (), "py")


# the leaf kinds by the samples' exact type (numpy scalars: any np.generic but np.object_)
_LEAF_KINDS: dict[type, Callable[[list[Any]], _Leaf]] = {
    torch.Tensor: _tensor_leaf,
    np.ndarray: _array_leaf,
    np.memmap: _array_leaf,
    bool: _py_leaf,
    int: _py_leaf,
    float: _py_leaf,
}


def _leaf_of(samples: list[Any]) -> _Leaf:
    """One leaf position, as ``default_collate`` makes it (all samples of one exact type)."""
    kind = type(samples[0])
    if any(type(s) is not kind for s in samples):
        raise UnsupportedLayoutError
    make = _LEAF_KINDS.get(kind)
    if make is None and isinstance(samples[0], np.generic) and kind is not np.object_:
        make = _npscalar_leaf
    if make is None:
        raise UnsupportedLayoutError
    return make(samples)


def _torch_dtype(elem: Any) -> torch.dtype:
    """The dtype ``torch.as_tensor`` gives a numpy leaf; one it refuses is left to torch."""
    try:
        return torch.as_tensor(elem.reshape(-1)[:0] if isinstance(elem, np.ndarray) else elem).dtype
    except (TypeError, ValueError, RuntimeError):  # np.uint64 scalars, np.longdouble, ...
        raise UnsupportedLayoutError from None


class SlotLayout:
    """What ``default_collate(samples)`` would build, planned before any byte is written.

    ``spec`` is the batch's structure (``("leaf", i)``, ``("dict", keys, children)``,
    ``("list", children)`` or ``("named", type, children)``), travelling with the
    :class:`~feedpipe.loader.slots.SlotRef`; ``leaves`` are its leaf columns in order. Raises
    :class:`UnsupportedLayoutError` for anything ``collate_into`` leaves to ``default_collate``.
    """

    def __init__(self, samples: list[Any]) -> None:
        self.leaves: list[_Leaf] = []
        self.spec = self._node(samples)

    def _node(self, samples: list[Any]) -> Any:
        elem = samples[0]
        kind = type(elem)
        if kind is dict:
            keys = list(elem)
            if any(type(s) is not dict or list(s) != keys for s in samples):
                raise UnsupportedLayoutError
            return ("dict", keys, [self._node([s[k] for s in samples]) for k in keys])
        if kind is tuple and hasattr(elem, "_fields"):
            raise UnsupportedLayoutError  # a subclass of tuple that is not exactly a namedtuple
        if isinstance(elem, tuple) and hasattr(kind, "_fields"):
            return ("named", kind, self._columns(samples))
        if kind is list or kind is tuple:  # default_collate: a list of the collated columns
            return ("list", self._columns(samples))
        if isinstance(elem, (Mapping, Sequence)) and not isinstance(elem, (str, bytes)):
            raise UnsupportedLayoutError  # other containers: default_collate's own rules
        self.leaves.append(_leaf_of(samples))
        return ("leaf", len(self.leaves) - 1)

    def _columns(self, samples: list[Any]) -> list[Any]:
        """The nodes of a sequence's columns (all samples of one type and length)."""
        kind, length = type(samples[0]), len(samples[0])
        if any(type(s) is not kind or len(s) != length for s in samples):
            raise UnsupportedLayoutError
        return [self._node(list(col)) for col in zip(*samples, strict=True)]

    def sizes(self, n: int) -> list[int]:
        """Each leaf's aligned bytes for ``n`` samples."""
        return [align(leaf.nbytes(n)) for leaf in self.leaves]

    def write(self, buffer: torch.Tensor, base: int, n: int) -> list[tuple[Any, ...]]:
        """Write every leaf into ``buffer`` from byte ``base`` on; ``(offset, dtype, shape)``
        of each, as :meth:`~feedpipe.loader.slots.Slots.resolve` reads them back."""
        placed: list[tuple[Any, ...]] = []
        offset = base
        for leaf, size in zip(self.leaves, self.sizes(n), strict=True):
            out = buffer[offset : offset + leaf.nbytes(n)].view(leaf.dtype).view(n, *leaf.shape)
            leaf.write(out)
            placed.append((offset, leaf.dtype, (n, *leaf.shape)))
            offset += size
        return placed


def rebuild(spec: Any, tensors: list[torch.Tensor]) -> Any:
    """The batch of structure ``spec`` (:attr:`SlotLayout.spec`) with its leaves ``tensors``."""
    tag = spec[0]
    if tag == "leaf":
        return tensors[spec[1]]
    if tag == "dict":
        return {k: rebuild(c, tensors) for k, c in zip(spec[1], spec[2], strict=True)}
    if tag == "named":
        return spec[1](*(rebuild(c, tensors) for c in spec[2]))
    return [rebuild(c, tensors) for c in spec[1]]
