"""A cheap check that a state has the structure of an earlier save (``FlattenCache``'s fast path).

``flatten``'s walk makes a JSON node and a path per value, and ``FlattenCache`` then reads a
key of a dozen tensor attributes per leaf in Python: for a state of thousands of small tensors
that is many times the copy itself. ``Structure.of`` reads the same facts with C loops:

- ``scan`` walks only the containers. Per dict, list or tuple it records its type, its keys
  with their types (or its length) and the types of its values; per scalar its value (a float
  by ``float.hex``, so ``-0.0`` and ``0.0`` differ); per tensor nothing more: the tensors are
  collected, in tree order. A container of tensors only costs a few C calls. Anything else
  (arrays, enums, bytes, sizes, dtypes, subclassed containers, objects with ``state_dict``
  other than modules and optimizers) makes the scan give up (``None``): ``flatten`` then runs
  as before.
- the tensors' *columns*: per tensor its shape, dtype, strides, data pointer, storage offset,
  device, ``requires_grad``, negative bit and parameter flag (one ``map`` each), and the
  conjugate bit of the complex ones (a layout other than strided, or a nested tensor, cannot
  be read: ``_COLUMNS``).

Two states whose tokens and columns are equal flatten to the same tree (scalars included)
and the same entries: the tokens fix every node of the tree and every path, the columns every
key ``FlattenCache`` compares (a tensor's storage address is its data pointer less its offset,
so ties made or broken, a tensor replaced or resized in place, change a column). A
``Structure`` holds no reference to the state: only types, keys, scalars and numbers.
``describes`` checks that a walk's tree is the one these tokens stand for (``FlattenCache``
remembers a structure only with such a tree).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any

import torch

from ckpt._torch_compat import param_flags
from ckpt.format.limits import MAX_DEPTH
from ckpt.types import type_name

__all__ = ["Structure", "scan"]

_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_SCALARS = frozenset((str, int, bool, type(None)))
_OWNERS = (torch.nn.Module, torch.optim.Optimizer)
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))
_T = torch.Tensor
_COLUMNS: tuple[Callable[[torch.Tensor], Any], ...] = (
    attrgetter("shape"),
    attrgetter("dtype"),
    _T.stride,
    _T.data_ptr,
    _T.storage_offset,
    attrgetter("device"),
    attrgetter("requires_grad"),
    _T.is_neg,
)
"""One column each (a tuple of them costs more to build and compare). The layout and
nestedness need none: ``stride`` or ``data_ptr`` raise for every layout but strided and for a
strided nested tensor, and a jagged one is another type (the scan gives up)."""
_DTYPE = 1  # the column of the dtypes
_RG = 6  # the column of the requires_grad flags


class _GiveUpError(Exception):
    """A value the scan does not handle: ``flatten`` decides."""


def scan(state: Any) -> tuple[list[Any], list[torch.Tensor]] | None:
    """The tokens of ``state``'s structure and its tensors in tree order (``None``: a value
    the scan does not handle, or nesting deeper than ``MAX_DEPTH``)."""
    tokens: list[Any] = []
    tensors: list[torch.Tensor] = []
    try:
        _items(None, [state], tokens, tensors, 0)
    except _GiveUpError:
        return None
    return tokens, tensors


def _items(keys: Any, values: list[Any], tokens: list[Any], tensors: list[Any], depth: int) -> None:
    """Record one container's keys (``None``: its length) and values."""
    if depth > MAX_DEPTH + 1:
        raise _GiveUpError
    types = tuple(map(type, values))
    tokens += (keys if keys is not None else len(values), types)
    if _TENSORS.issuperset(types):  # a container of tensors: no Python per value
        tensors += values
        return
    for value, kind in zip(values, types, strict=True):
        if kind in _TENSORS:
            tensors.append(value)
        elif kind in _SCALARS:
            tokens.append(value)
        elif kind is float:
            tokens.append(value.hex())
        else:
            _container(value, kind, tokens, tensors, depth + 1)


def _container(value: Any, kind: type, tokens: list[Any], tensors: list[Any], depth: int) -> None:
    if kind is dict or kind is OrderedDict:
        keys = tuple(value)
        tokens.append(tuple(map(type, keys)))
        _items(keys, list(value.values()), tokens, tensors, depth)
    elif kind is list or kind is tuple:
        _items(None, list(value), tokens, tensors, depth)
    elif isinstance(value, _OWNERS) and not isinstance(value, (Mapping, list, tuple)):
        _items(None, [value.state_dict()], tokens, tensors, depth)
    else:
        raise _GiveUpError


class Structure:
    """The tokens and tensor columns of one state (module docstring); ``tensors`` are that
    state's tensors in tree order (dropped by ``forget``)."""

    def __init__(self, tokens: list[Any], tensors: list[torch.Tensor]) -> None:
        self.tokens = tokens
        self.tensors: list[torch.Tensor] = tensors
        self.count = len(tensors)
        self.columns: list[list[Any]] | None = None  # None: a tensor without plain storage
        self.complex: list[int] = []  # the tensors of a complex dtype

    @classmethod
    def of(cls, state: Any) -> Structure | None:
        """The structure of ``state`` (``None`` where ``scan`` gives up)."""
        scanned = scan(state)
        return None if scanned is None else cls(*scanned)

    def read_columns(self) -> list[list[Any]] | None:
        """Every column of the tensors (``None`` where one cannot be read)."""
        if self.columns is None:
            try:
                ts = self.tensors
                self.columns = [list(map(get, ts)) for get in _COLUMNS]
                dtypes = self.columns[_DTYPE]
                self.complex = [k for k, dtype in enumerate(dtypes) if dtype in _COMPLEX]
                self.columns += [param_flags(ts), [ts[k].is_conj() for k in self.complex]]
            except (RuntimeError, NotImplementedError, AttributeError):
                self.columns = None
        return self.columns

    def matches(self, other: Structure) -> bool:
        """Whether ``self`` (the last save's, columns read) and ``other`` flatten alike: the
        tokens first, then the columns one by one, stopping at the first difference; the
        conjugate bits last, of the tensors whose dtype is complex (only they can have one;
        the dtypes are equal by then)."""
        columns = self.columns
        if columns is None or self.count != other.count or self.tokens != other.tokens:
            return False
        ts = other.tensors
        try:
            for get, column in zip(_COLUMNS, columns, strict=False):
                if list(map(get, ts)) != column:
                    return False
            conj = [ts[k].is_conj() for k in self.complex]
            return param_flags(ts) == columns[-2] and conj == columns[-1]
        except (RuntimeError, NotImplementedError, AttributeError):
            return False

    def describes(self, tree: dict[str, Any]) -> bool:
        """Whether ``tree`` (a walk's, of this state) is the tree these tokens and columns
        stand for: every container, key and scalar, and each tensor's parameter and
        ``requires_grad`` flags. ``False`` where the state changed between the scan and the
        walk, or an object's ``state_dict()`` returned another value for each."""
        columns = self.columns
        if columns is None:
            return False
        check = _TreeCheck(self.tokens, columns)
        try:
            return check.items([tree]) and check.done()
        except (KeyError, TypeError, ValueError, IndexError, StopIteration):
            return False

    def forget(self) -> None:
        """Drop the references to the state's tensors (kept: tokens and columns)."""
        self.tensors = []


class _TreeCheck:
    """One pass of ``Structure.describes``: the tokens read in ``scan``'s order."""

    def __init__(self, tokens: list[Any], columns: list[list[Any]]) -> None:
        self.tokens = iter(tokens)
        self.rg, self.params = columns[_RG], columns[-2]
        self.tensor = 0  # the next tensor's index

    def done(self) -> bool:
        """Whether every token was read and every tensor met."""
        return next(self.tokens, self) is self and self.tensor == len(self.rg)

    def items(self, nodes: list[Any]) -> bool:
        """The values of a list, a tuple, an owner's ``state_dict()`` or the root: their
        count and types, then each (``scan``'s ``_items``)."""
        if next(self.tokens) != len(nodes):
            return False
        types = next(self.tokens)
        return len(types) == len(nodes) and all(map(self.value, types, nodes))

    def value(self, kind: type, node: dict[str, Any]) -> bool:
        if kind in _TENSORS:
            k, self.tensor = self.tensor, self.tensor + 1
            param = kind is torch.nn.Parameter or bool(self.params[k])
            return (node["t"], "param" in node, "rg" in node) == ("tensor", param, self.rg[k])
        if kind in _SCALARS:
            v = node["v"]
            return node["t"] == "v" and type(v) is kind and v == next(self.tokens)
        if kind is float:
            v = node["v"] if node["t"] == "v" else float(node["v"]) if node["t"] == "float" else 0j
            return type(v) is float and v.hex() == next(self.tokens)
        return self.container(kind, node)

    def container(self, kind: type, node: dict[str, Any]) -> bool:
        if kind is dict or kind is OrderedDict:
            next(self.tokens)  # the keys' types: the walk keeps str and int keys as they are
            items = node["items"]
            keys = next(self.tokens)
            same = node["t"] == ("odict" if kind is OrderedDict else "dict")
            return same and [k for k, _ in items] == list(keys) and self._values(items)
        if kind is list or kind is tuple:
            return node["t"] == kind.__name__ and self.items(node["items"])
        if node["t"] != "state" or node["cls"] != type_name(kind):
            return False
        return self.items([node["v"]])

    def _values(self, items: list[Any]) -> bool:
        nodes = [child for _, child in items]
        types = next(self.tokens)
        return len(types) == len(nodes) and all(map(self.value, types, nodes))
