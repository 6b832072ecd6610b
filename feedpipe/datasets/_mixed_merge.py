"""Scatter the per-member batches of a :class:`~feedpipe.datasets.mixed.MixedDataset` into one.

Each part is ``(positions, batch)``: the rows of ``batch`` (a collated batch of one member) go to
``positions`` of the merged batch. Tensors are scattered with one indexed copy per leaf and
part; per-sample lists (strings, records of varying size) are interleaved. Every member must give
the same structure, dtypes and trailing shapes: a mismatch is a ``DatasetError`` naming the two
members, never a silent cast.

Ragged columns (:mod:`feedpipe.datasets._ragged_batch`) are the one allowed difference: a padded
column ``NAME`` (beside its ``NAME_lengths``) is padded by each member to its own longest record,
so the parts are first padded on to the widest, each with its own member's ``pad_value``; jagged
nested tensors are interleaved row by row into one jagged tensor. The merged batch is the one a
single dataset holding the same samples would give.

The merge walks the batches' structure once (:class:`_Merge`): each node is merged by the rule
for its type (tensor, nested tensor, mapping, list of collated fields, per-sample list). Whether
a list is a list of collated fields or a per-sample list is what the members' shapes say
(:mod:`._mixed_shape`), never guessed from its values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._mixed_shape import Shape
from feedpipe.datasets._ragged_batch import lengths_key, nest, widen
from feedpipe.errors import DatasetError

__all__ = ["fill_out", "merge_parts"]


def _NO_FIELDS(j: int) -> Shape:  # noqa: N802 (a constant function)
    """A batch with no list of collated fields: every list is per-sample."""
    return None


def merge_parts(
    parts: list[tuple[np.ndarray, Any]],
    n: int,
    names: list[str],
    out: Any = None,
    *,
    pads: list[Any] | None = None,
    shapes: Callable[[int], Shape] = _NO_FIELDS,
) -> Any:
    """The batch of ``n`` rows made of ``parts`` (positions, member batch); into ``out``.
    ``pads`` (one per part, default 0) pads a part's ragged columns on to the widest part's;
    ``shapes(j)``: part ``j``'s batch shape (:mod:`._mixed_shape`: which lists are lists of
    collated fields), asked for only where a batch has a list."""
    values = _widened([p for _, p in parts], pads or [0] * len(parts))
    merge = _Merge([pos for pos, _ in parts], n, names, shapes)
    return merge.merge(values, out, "batch", ())


def fill_out(batch: Any, out: Any, shape: Callable[[int], Shape] = _NO_FIELDS) -> Any:
    """Copy ``batch`` (of shape ``shape(0)``) into the first rows of ``out`` and return views
    of ``out``."""
    n = _rows(batch)
    if n is None:
        return batch
    merge = _Merge([np.arange(n, dtype=np.int64)], n, ["member"], shape)
    return merge.merge([batch], out, "batch", ())


# ---------------------------------------------------------------------- widening padded columns
def _widened(values: list[Any], pads: list[Any]) -> list[Any]:
    """``values`` with every padded ragged column (``NAME`` beside ``NAME_lengths``, in dicts at
    any depth) padded on to the widest part's width, each part with its own pad value; the
    same objects when there is nothing to pad."""
    if not all(isinstance(v, Mapping) for v in values):
        return values
    changes = {k: new for k in values[0] if (new := _widened_key(values, k, pads)) is not None}
    if not changes:
        return values
    out = []
    for j, v in enumerate(values):
        copy = {k: changes[k][j] if k in changes else x for k, x in v.items()}
        out.append(copy if type(v) is dict else type(v)(copy))
    return out


def _widened_key(values: list[Mapping[Any, Any]], key: Any, pads: list[Any]) -> list[Any] | None:
    """The parts' values of ``key`` widened (see :func:`_widened`), or None if unchanged."""
    col: list[Any] = [v.get(key) for v in values]
    if all(isinstance(c, Mapping) for c in col):
        sub = _widened(col, pads)
        return sub if any(a is not b for a, b in zip(sub, col, strict=True)) else None
    if not _padded_column(values, key, col):
        return None
    width = max(int(c.shape[1]) for c in col)
    if all(int(c.shape[1]) == width for c in col):
        return None
    return [widen(t, width, pad) for t, pad in zip(col, pads, strict=True)]


def _padded_column(values: list[Mapping[Any, Any]], key: Any, col: list[Any]) -> bool:
    """Whether ``key`` is a padded ragged column in every part (a 2-D+ tensor with lengths)."""
    if not isinstance(key, str) or not all(lengths_key(key) in v for v in values):
        return False
    return all(isinstance(c, torch.Tensor) and c.ndim >= 2 and not c.is_nested for c in col)


def _rows(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for v in batch:
            r = _rows(v)
            if r is not None:
                return r
    return None


# ---------------------------------------------------------------------- the merge
class _Merge:
    """Merges the parts' batches: part ``j``'s rows go to ``positions[j]`` of a batch of ``n``
    rows; ``names`` are the members (for errors); ``shapes(j)``: part ``j``'s batch shape."""

    def __init__(
        self,
        positions: list[np.ndarray],
        n: int,
        names: list[str],
        shapes: Callable[[int], Shape],
    ) -> None:
        self.positions, self.n, self.names = positions, n, names
        self._shapes = shapes
        self._roots: dict[int, Shape] = {}

    def mismatch(self, where: str, what: str) -> DatasetError:
        names = self.names
        return DatasetError(
            f"MixedDataset: members {names[0]!r} and {names[-1]!r} give different batches at "
            f"{where}: {what}"
        )

    def merge(self, values: list[Any], out: Any, where: str, path: tuple[Any, ...]) -> Any:
        """One node of the batches (the same node of every part, at ``path``), into ``out``
        when given."""
        first = values[0]
        if isinstance(first, torch.Tensor):
            if any(isinstance(v, torch.Tensor) and v.is_nested for v in values):
                return self.nested(values, where)
            return self.tensors(values, out, where)
        if isinstance(first, Mapping):
            return self.mapping(values, out, where, path)
        if isinstance(first, (list, tuple)):
            if self.is_fields(values, where, path):
                return self.fields(values, out, where, path)
            return self.samples(values, where)
        raise self.mismatch(where, f"cannot merge a {type(first).__name__}")

    def mapping(self, values: list[Any], out: Any, where: str, path: tuple[Any, ...]) -> Any:
        first = values[0]
        for v in values[1:]:
            if not isinstance(v, Mapping) or set(v) != set(first):  # any order, as torch
                keys = list(v) if isinstance(v, Mapping) else type(v).__name__
                raise self.mismatch(where, f"keys {list(first)} and {keys}")
        dests: Mapping[Any, Any] = out if isinstance(out, Mapping) else {}
        merged = {
            k: self.merge([v[k] for v in values], dests.get(k), f"{where}[{k!r}]", (*path, k))
            for k in first
        }
        return merged if type(first) is dict else type(first)(merged)

    def shape(self, j: int, path: tuple[Any, ...]) -> Shape:
        """Part ``j``'s shape at ``path`` (None: no list of fields there)."""
        if j not in self._roots:
            self._roots[j] = self._shapes(j)
        node = self._roots[j]
        for step in path:
            if isinstance(node, dict):
                node = node.get(step)
            elif isinstance(node, tuple) and isinstance(step, int) and step < len(node):
                node = node[step]
            else:
                return None
        return node

    def is_fields(self, values: list[Any], where: str, path: tuple[Any, ...]) -> bool:
        """A list of collated fields (default_collate of tuple samples), not a per-sample list:
        as each part's shape says (they must agree, and have as many fields)."""
        for v in values:
            if not isinstance(v, (list, tuple)):
                raise self.mismatch(where, f"a {type(values[0]).__name__} and a {type(v).__name__}")
        said = [self.shape(j, path) for j in range(len(values))]
        fields = [isinstance(s, tuple) for s in said]
        if not any(fields):
            return False
        if not all(fields):
            a, b = self.names[fields.index(True)], self.names[fields.index(False)]
            raise self.mismatch(
                where, f"a list of fields in {a!r}'s batches, a per-sample list in {b!r}'s"
            )
        for j, (v, s) in enumerate(zip(values, said, strict=True)):
            if len(v) != len(s) or len(v) != len(values[0]):
                raise self.mismatch(
                    where,
                    f"{len(v)} fields in {self.names[j]!r}'s batch, {len(s)} in its samples, "
                    f"{len(values[0])} in {self.names[0]!r}'s batch",
                )
        return True

    def fields(self, values: list[Any], out: Any, where: str, path: tuple[Any, ...]) -> Any:
        first, width = values[0], len(values[0])
        sub: Any = out if isinstance(out, (list, tuple)) and len(out) == width else [None] * width
        items = [
            self.merge([v[i] for v in values], sub[i], f"{where}[{i}]", (*path, i))
            for i in range(width)
        ]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)

    def samples(self, values: list[Any], where: str) -> list[Any]:
        """Per-sample lists interleaved."""
        merged: list[Any] = [None] * self.n
        for v, pos in zip(values, self.positions, strict=True):
            if len(v) != len(pos):
                raise self.mismatch(where, f"a list of {len(v)} for {len(pos)} samples")
            for p, item in zip(pos.tolist(), v, strict=True):
                merged[p] = item
        return merged

    def tensors(self, values: list[Any], out: Any, where: str) -> torch.Tensor:
        """Tensors of the same dtype and trailing shape scattered into one (``out``'s rows)."""
        self.check_tensors(values, where)
        dest = _dest(values[0], self.n, out, where)
        if len(values) == 1:
            dest.copy_(values[0])
            return dest
        pairs = zip(values, self.positions, strict=True)
        if dest.device.type != "cpu" or not dest.is_contiguous() or dest.dtype == torch.bfloat16:
            for v, pos in pairs:
                dest[torch.from_numpy(pos)] = v.to(dest.device)
            return dest
        flat = dest.view(self.n, -1).numpy() if self.n and dest[0].numel() else None
        for v, pos in pairs:  # numpy: one single-threaded scatter
            if flat is not None and len(pos):
                flat[pos] = v.reshape(len(pos), -1).numpy(force=True)
        return dest

    def check_tensors(self, values: list[Any], where: str) -> None:
        first = values[0]
        for v, pos in zip(values, self.positions, strict=True):
            if not isinstance(v, torch.Tensor):
                raise self.mismatch(where, f"a tensor and a {type(v).__name__}")
            if v.dtype != first.dtype or v.shape[1:] != first.shape[1:]:
                raise self.mismatch(
                    where,
                    f"{first.dtype} {tuple(first.shape[1:])} and {v.dtype} {tuple(v.shape[1:])} "
                    "per sample",
                )
            if v.ndim == 0 or v.shape[0] != len(pos):
                raise self.mismatch(where, f"{tuple(v.shape)} for {len(pos)} samples")

    def nested(self, values: list[Any], where: str) -> torch.Tensor:
        """Jagged nested tensors (ragged columns, ``ragged="nested"``) interleaved row by row."""
        if len(values) == 1:
            return values[0]  # type: ignore[no-any-return]
        first = values[0]
        rows: list[Any] = [None] * self.n
        for v, pos in zip(values, self.positions, strict=True):
            if not (isinstance(v, torch.Tensor) and v.is_nested):
                raise self.mismatch(where, f"a nested tensor and a {type(v).__name__}")
            parts = v.unbind()
            if v.dtype != first.dtype or (
                parts and parts[0].shape[1:] != first.unbind()[0].shape[1:]
            ):
                raise self.mismatch(where, f"nested {first.dtype} and {v.dtype} records")
            if len(parts) != len(pos):
                raise self.mismatch(where, f"{len(parts)} records for {len(pos)} samples")
            for p, row in zip(pos.tolist(), parts, strict=True):
                rows[p] = row
        return nest(rows)


def _dest(first: torch.Tensor, n: int, out: Any, where: str) -> torch.Tensor:
    """Where a merged tensor goes: ``out``'s first ``n`` rows (checked), or a new tensor."""
    shape = (n, *first.shape[1:])
    if out is None:
        return torch.empty(shape, dtype=first.dtype)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out{where[5:]}: expected a tensor, got {type(out).__name__}")
    if out.dtype != first.dtype or out.ndim != len(shape) or out.shape[1:] != shape[1:]:
        raise ValueError(
            f"out{where[5:]}: {out.dtype} {tuple(out.shape)} cannot hold {first.dtype} {shape}"
        )
    if out.shape[0] < n:
        raise ValueError(f"out{where[5:]}: {out.shape[0]} rows, the batch has {n}")
    return out[:n]
