"""The flattening of a state, cached across saves of the same structure.

``flatten`` (``ckpt.saving.flatten``) walks the state and then gives every array node its
entry: which leaf it is, whether tensors share one storage (tied weights, views) and become
views of one entry. The second part costs several tensor attribute reads and a dataclass per
leaf; for a state of thousands of small tensors it is most of the Python a save pays.

``FlattenCache.flatten`` walks the state every save (the tree must carry the current scalars,
keys and order) and then compares one *key* per array node with the last save's: for a
tensor its type, dtype, shape, strides, storage offset, address, device, layout,
``requires_grad`` and conjugate/negative bits; for an array its dtype, shape and strides; and
the node's path. When every
key matches, the entries and sharing are the last save's, and only the leaves' values are
taken afresh from this walk; otherwise the entries are assigned as ``flatten`` does and
remembered. A changed structure, shape, dtype or device, a tensor replaced by another object
(another storage), a dict reordered, a tie made or broken: each changes a key.

Soundness: the cache holds no reference to the caller's tensors (only the keys: numbers,
dtypes, shapes, devices, paths); every value comes from this save's walk. Keys are remembered
only after ``flatten``'s own assignment succeeded (an unsupported leaf raises there, every
save); a tensor whose address cannot be read (no plain storage) disables the cache for that
save.

Fast path (``capture``): from the second hit on, the walk itself is skipped while the state
has the structure of the last hit (``ckpt.saving.structure``: its containers, keys, scalars
and per tensor the facts of its key, read in C loops): the tree is the last hit's (the same
object, never modified: equal tokens mean an equal tree, scalars included) and the leaves'
values are this state's tensors in tree order. ``fast_hits`` counts those saves. A structure
is remembered only with the tree of its own walk: its columns are read before the walk and
must equal the walk's keys, its tokens must describe the walk's tree
(``Structure.describes``), and no other save may have assigned entries since the walk. So a
state changed by another thread during a save, or an object whose ``state_dict()`` returns
something else on each call (a miss calls it twice: the scan's, the walk's), never pairs one
state's structure with another's tree or entries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from operator import attrgetter, itemgetter
from typing import Any

import torch

from ckpt.saving.flatten import (
    Leaf,
    Node,
    Pending,
    assign_entries,
    own_value,
    storage_bytes,
    walk,
)
from ckpt.saving.structure import Structure

__all__ = ["Flat", "FlattenCache"]


_Slot = tuple[int, int, int, str, str, list[int], int, str, tuple[int, ...]]
"""How to remake one leaf: ``(source, how, start, kind, dtype, shape, nbytes, device,
stride)``: the value of pending node ``source`` as is (``how`` 0), as ``flatten`` stores a
tensor with ``requires_grad`` or a conjugate/negative bit (1), or ``nbytes`` of its storage
from byte ``start`` (2, a shared entry); the rest of the ``Leaf`` as last time."""
_AS_IS, _OWN, _SHARED = 0, 1, 2


_VALUES = attrgetter("value")
_ATTRS = attrgetter("dtype", "shape", "device", "requires_grad", "layout")
_NODE, _VALUE = itemgetter(0), itemgetter(1)


def _key(value: Any, path: str) -> tuple[Any, ...]:
    """What a node's entry depends on. A tensor's storage address is its ``data_ptr`` less its
    offset (both in the key, with the dtype), so ties made or broken change the key."""
    if isinstance(value, torch.Tensor):
        return (path, type(value), *_ATTRS(value), value.stride(), value.storage_offset(),
                value.data_ptr(), value.is_conj(), value.is_neg())  # fmt: skip
    return (path, value.dtype.str, value.shape, value.strides)


def _keys(pending: list[Pending]) -> list[tuple[Any, ...]] | None:
    """The keys of ``pending`` (``None`` where one cannot be read: do not cache)."""
    tensor = torch.Tensor
    try:  # ``_key`` inlined for tensors (a tenth of the cost of a save of small tensors)
        return [
            (path, type(v), v.dtype, v.shape, v.device, v.requires_grad, v.layout, v.stride(),
             v.storage_offset(), v.data_ptr(), v.is_conj(), v.is_neg())
            if isinstance(v, tensor) else _key(v, path)
            for _, v, path in pending
        ]  # fmt: skip
    except (RuntimeError, NotImplementedError, AttributeError):  # no plain storage
        return None


_KEY_PLACES = (3, 2, 7, 9, 8, 4, 5, 11)
"""Where each of a ``Structure``'s columns is in a tensor's key (``_keys``), in its order."""
_CONJ = 10


def _agree(structure: Structure | None, keys: list[tuple[Any, ...]] | None) -> bool:
    """Whether ``structure``'s columns (read before the walk) are the facts of the walk's
    ``keys``: a tensor changed between them (another thread) must not pair its entries with
    the facts read before."""
    columns = None if structure is None else structure.columns
    if structure is None or columns is None or keys is None or len(keys) != structure.count:
        return False
    try:
        for place, column in zip(_KEY_PLACES, columns, strict=False):
            if list(map(itemgetter(place), keys)) != column:
                return False
        return [keys[k][_CONJ] for k in structure.complex] == columns[-1]
    except IndexError:  # an array's key: not the scanned state
        return False


class Flat:
    """One flattening (``FlattenCache.capture``): the JSON ``tree``, the leaves' ``values`` in
    leaf order, whether the last save's entries were ``reused`` (then ``generation`` is the
    cache's, unchanged), and ``leaves()``, the ``Leaf`` records, made when first asked for."""

    def __init__(
        self,
        tree: Node,
        values: list[Any],
        reused: bool,
        generation: int,
        make: Callable[[], list[Leaf]],
    ) -> None:
        self.tree, self.values, self.reused, self.generation = tree, values, reused, generation
        self._make: Callable[[], list[Leaf]] | None = make
        self._leaves: list[Leaf] = []

    def leaves(self) -> list[Leaf]:
        """The leaves (values and manifest records), in leaf order."""
        if self._make is not None:
            self._leaves, self._make = self._make(), None
        return self._leaves


class FlattenCache:
    """``flatten`` with its entries and sharing remembered from the last save (module
    docstring). ``hits``/``misses`` count the saves that reused them or not."""

    def __init__(self) -> None:
        self._keys: list[tuple[Any, ...]] | None = None
        self._slots: list[_Slot] = []
        self._nodes: list[tuple[int, dict[str, Any] | None]] = []  # per pending: leaf, view
        self._columns: list[list[Any]] | None = None  # the leaves' fields but value (_reuse)
        self._paths: list[str] = []  # per leaf (the general path's slots have none)
        self._fast: Structure | None = None  # the last hit's structure (the fast path)
        self._tree: Node | None = None  # the last hit's tree, shared by the fast hits
        self._path = ""
        self.hits = 0
        self.fast_hits = 0
        self.misses = 0
        self.generation = 0  # changes with every new assignment: equal leaf metadata within one
        self._lock = threading.Lock()  # saves from several threads: one reads or updates

    def clear(self) -> None:
        """Forget the last save's entries (the next ``flatten`` assigns them afresh)."""
        self._keys, self._slots, self._nodes, self._columns = None, [], [], None
        self._paths, self._fast, self._tree = [], None, None

    def flatten(self, state: Any, leaves: list[Leaf], path: str = "state") -> Node:
        """The JSON tree of ``state``, its array leaves appended to ``leaves``: what
        ``ckpt.saving.flatten.flatten`` returns, byte for byte."""
        if leaves:  # indices from len(leaves): the general path
            return self._flatten(state, leaves, path)
        flat = self.capture(state, path)
        leaves.extend(flat.leaves())
        return flat.tree

    def capture(self, state: Any, path: str = "state") -> Flat:
        """``flatten`` of ``state`` as a ``Flat``: on a fast hit (module docstring) its leaves
        are made only when asked for."""
        structure = Structure.of(state) if self._keys is not None and path == self._path else None
        with self._lock:
            fast, tree = self._fast, self._tree
            if fast is not None and tree is not None and structure and fast.matches(structure):
                values = self._values(structure.tensors)
                self.hits += 1
                self.fast_hits += 1
                return Flat(tree, values, True, self.generation, self._maker(values))
        leaves: list[Leaf] = []
        generation = self.generation
        if structure is not None:  # the facts before the walk (``_unchanged``)
            structure.read_columns()
        tree = self._flatten(state, leaves, path)
        reused = generation == self.generation
        described = reused and structure is not None and structure.describes(tree)
        with self._lock:  # another thread's save since: its entries, not this tree's
            remember = described and generation == self.generation and _agree(structure, self._keys)
            self._fast, self._tree, self._path = (
                (structure, tree, path) if remember else (None, None, path)
            )
            if structure is not None:
                structure.forget()
        return Flat(tree, list(map(_VALUES, leaves)), reused, generation, lambda: leaves)

    def _values(self, tensors: list[Any]) -> list[Any]:
        """The leaves' values of a fast hit, from the state's tensors in tree order."""
        if self._columns is not None:
            return tensors
        values = []
        for k, how, start, _, _, _, nbytes, _, _ in self._slots:
            value = tensors[k]
            if how == _OWN:
                value = own_value(value)
            elif how == _SHARED:
                value = storage_bytes(value, start, nbytes)
            values.append(value)
        return values

    def _maker(self, values: list[Any]) -> Callable[[], list[Leaf]]:
        """Makes the leaves of a fast hit (the records as last time, ``values`` new)."""
        columns, slots, paths = self._columns, self._slots, self._paths
        if columns is not None:
            return lambda: list(map(Leaf, values, *columns))
        return lambda: [
            Leaf(v, kind, dtype, shape, nbytes, p, device, stride)
            for v, (_, _, _, kind, dtype, shape, nbytes, device, stride), p in zip(
                values, slots, paths, strict=True
            )
        ]

    def _flatten(self, state: Any, leaves: list[Leaf], path: str) -> Node:
        """The walk and the key check (module docstring): the general path."""
        tree, pending = walk(state, path)
        keys = _keys(pending)
        with self._lock:
            if keys is not None and keys == self._keys:
                self._reuse(pending, leaves)
                self.hits += 1
                return tree
            self.clear()
            self.generation += 1
            base = len(leaves)
            assign_entries(pending, leaves)
            if keys is not None:
                self._remember(pending, leaves[base:], base)
                self._keys = keys
            self.misses += 1
        return tree

    def _remember(self, pending: list[Pending], made: list[Leaf], base: int) -> None:
        first: dict[int, int] = {}
        for k, (node, _, _) in enumerate(pending):
            index = node["i"] - base
            view = node.get("view")
            self._nodes.append((index, dict(view) if view is not None else None))
            first.setdefault(index, k)
        for j, leaf in enumerate(made):
            k, start, how = first[j], 0, _AS_IS
            value = pending[k][1]
            if pending[k][0].get("view") is not None and isinstance(leaf.value, torch.Tensor):
                start, how = int(leaf.value.storage_offset()), _SHARED  # the entry's first byte
            elif leaf.value is not value:  # detached or a bit resolved (``flatten.own_value``)
                how = _OWN
            rest = (leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes, leaf.device, leaf.stride)
            self._slots.append((k, how, start, *rest))
            self._paths.append(leaf.path)
        if all(slot[:2] == (k, _AS_IS) for k, slot in enumerate(self._slots)) and len(
            self._slots
        ) == len(pending):  # a leaf per node, each as is: the common state, made in C loops
            fields = attrgetter("kind", "dtype", "shape", "nbytes", "path", "device", "stride")
            self._columns = [list(column) for column in zip(*map(fields, made), strict=True)]

    def _reuse(self, pending: list[Pending], leaves: list[Leaf]) -> None:
        base = len(leaves)
        if self._columns is not None:
            leaves.extend(map(Leaf, map(_VALUE, pending), *self._columns))
            for node, index in zip(map(_NODE, pending), range(base, len(leaves)), strict=True):
                node["i"] = index
            return
        append = leaves.append
        for k, how, start, kind, dtype, shape, nbytes, device, stride in self._slots:
            _, value, path = pending[k]
            if how == _OWN:
                value = own_value(value)
            elif how == _SHARED:
                value = storage_bytes(value, start, nbytes)
            append(Leaf(value, kind, dtype, shape, nbytes, path, device, stride))
        for (node, _, _), (index, view) in zip(pending, self._nodes, strict=True):
            node["i"] = base + index
            if view is not None:
                node["view"] = dict(view)
