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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._ragged_batch import lengths_key, nest, widen
from feedpipe.errors import DatasetError

__all__ = ["fill_out", "merge_parts"]


def merge_parts(
    parts: list[tuple[np.ndarray, Any]],
    n: int,
    names: list[str],
    out: Any = None,
    pads: list[Any] | None = None,
) -> Any:
    """The batch of ``n`` rows made of ``parts`` (positions, member batch); into ``out``.
    ``pads`` (one per part, default 0) pads a part's ragged columns on to the widest part's."""
    values = _widened([p for _, p in parts], pads or [0] * len(parts))
    return _merge(values, [pos for pos, _ in parts], n, names, out, "batch")


def _widened(values: list[Any], pads: list[Any]) -> list[Any]:
    """``values`` with every padded ragged column (``NAME`` beside ``NAME_lengths``, in dicts at
    any depth) padded on to the widest part's width, each part with its own pad value; the
    same objects when there is nothing to pad."""
    if not all(isinstance(v, Mapping) for v in values):
        return values
    changes: dict[Any, list[Any]] = {}
    for k in values[0]:
        col = [v.get(k) for v in values]
        if all(isinstance(c, Mapping) for c in col):
            sub = _widened(col, pads)
            if any(a is not b for a, b in zip(sub, col, strict=True)):
                changes[k] = sub
            continue
        ragged = isinstance(k, str) and all(lengths_key(k) in v for v in values)
        if not ragged or not all(
            isinstance(c, torch.Tensor) and c.ndim >= 2 and not c.is_nested for c in col
        ):
            continue
        width = max(int(c.shape[1]) for c in col)
        if any(int(c.shape[1]) != width for c in col):
            changes[k] = [widen(t, width, pad) for t, pad in zip(col, pads, strict=True)]
    if not changes:
        return values
    out = []
    for j, v in enumerate(values):
        copy = {k: changes[k][j] if k in changes else x for k, x in v.items()}
        out.append(copy if type(v) is dict else type(v)(copy))
    return out


def fill_out(batch: Any, out: Any) -> Any:
    """Copy ``batch`` into the first rows of ``out`` and return views of ``out``."""
    n = _rows(batch)
    if n is None:
        return batch
    return _merge([batch], [np.arange(n, dtype=np.int64)], n, ["member"], out, "batch")


def _rows(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, Mapping):
        for v in batch.values():
            r = _rows(v)
            if r is not None:
                return r
    if isinstance(batch, (list, tuple)):
        for v in batch:
            r = _rows(v)
            if r is not None:
                return r
    return None


def _mismatch(names: list[str], where: str, what: str) -> DatasetError:
    return DatasetError(
        f"MixedDataset: members {names[0]!r} and {names[-1]!r} give different batches at "
        f"{where}: {what}"
    )


def _merge(  # noqa: PLR0917 - internal recursion
    values: list[Any], positions: list[np.ndarray], n: int, names: list[str], out: Any, where: str
) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return _merge_tensors(values, positions, n, names, out, where)
    if isinstance(first, Mapping):
        for v in values[1:]:
            if not isinstance(v, Mapping) or set(v) != set(first):  # any order, as torch
                raise _mismatch(names, where, f"keys {list(first)} and {_keys(v)}")
        dests: Mapping[Any, Any] = out if isinstance(out, Mapping) else {}
        fields = {
            k: _merge([v[k] for v in values], positions, n, names, dests.get(k), f"{where}[{k!r}]")
            for k in first
        }
        return fields if type(first) is dict else type(first)(fields)  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)):
        if _is_fields(values, positions):
            width = len(first)
            sub: Any = (
                out if isinstance(out, (list, tuple)) and len(out) == width else [None] * width
            )
            items = [
                _merge([v[i] for v in values], positions, n, names, sub[i], f"{where}[{i}]")
                for i in range(width)
            ]
            if isinstance(first, tuple) and hasattr(first, "_fields"):
                return type(first)(*items)
            return type(first)(items)
        merged: list[Any] = [None] * n
        for v, pos in zip(values, positions, strict=True):
            if len(v) != len(pos):
                raise _mismatch(names, where, f"a list of {len(v)} for {len(pos)} samples")
            for p, item in zip(pos.tolist(), v, strict=True):
                merged[p] = item
        return merged
    raise _mismatch(names, where, f"cannot merge a {type(first).__name__}")


def _keys(v: Any) -> Any:
    return list(v) if isinstance(v, Mapping) else type(v).__name__


def _is_fields(values: list[Any], positions: list[np.ndarray]) -> bool:
    """A list of collated fields (default_collate of tuple samples), not a per-sample list."""
    width = len(values[0])
    for v, pos in zip(values, positions, strict=True):
        if not isinstance(v, (list, tuple)) or len(v) != width:
            return False
        for item in v:
            if isinstance(item, torch.Tensor):
                if item.ndim == 0 or item.shape[0] != len(pos):
                    return False
            elif not isinstance(item, (Mapping, list, tuple)):
                return False
    return True


def _merge_tensors(  # noqa: PLR0917 - internal
    values: list[Any], positions: list[np.ndarray], n: int, names: list[str], out: Any, where: str
) -> torch.Tensor:
    first = values[0]
    if any(isinstance(v, torch.Tensor) and v.is_nested for v in values):
        return _merge_nested(values, positions, n, names, where)
    for v, pos in zip(values, positions, strict=True):
        if not isinstance(v, torch.Tensor):
            raise _mismatch(names, where, f"a tensor and a {type(v).__name__}")
        if v.dtype != first.dtype or v.shape[1:] != first.shape[1:]:
            raise _mismatch(
                names,
                where,
                f"{first.dtype} {tuple(first.shape[1:])} and {v.dtype} {tuple(v.shape[1:])} "
                "per sample",
            )
        if v.ndim == 0 or v.shape[0] != len(pos):
            raise _mismatch(names, where, f"{tuple(v.shape)} for {len(pos)} samples")
    shape = (n, *first.shape[1:])
    if out is None:
        dest = torch.empty(shape, dtype=first.dtype)
    else:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out{where[5:]}: expected a tensor, got {type(out).__name__}")
        if out.dtype != first.dtype or out.ndim != len(shape) or out.shape[1:] != shape[1:]:
            raise ValueError(
                f"out{where[5:]}: {out.dtype} {tuple(out.shape)} cannot hold {first.dtype} {shape}"
            )
        if out.shape[0] < n:
            raise ValueError(f"out{where[5:]}: {out.shape[0]} rows, the batch has {n}")
        dest = out[:n]
    if len(values) == 1:
        dest.copy_(values[0])
        return dest
    if dest.device.type != "cpu" or not dest.is_contiguous() or dest.dtype == torch.bfloat16:
        for v, pos in zip(values, positions, strict=True):
            dest[torch.from_numpy(pos)] = v.to(dest.device)
        return dest
    flat = dest.view(n, -1).numpy() if n and dest[0].numel() else None
    for v, pos in zip(values, positions, strict=True):  # numpy: one single-threaded scatter
        if flat is not None and len(pos):
            flat[pos] = v.reshape(len(pos), -1).numpy(force=True)
    return dest


def _merge_nested(
    values: list[Any], positions: list[np.ndarray], n: int, names: list[str], where: str
) -> torch.Tensor:
    """Jagged nested tensors (ragged columns, ``ragged="nested"``) interleaved row by row."""
    if len(values) == 1:
        return values[0]  # type: ignore[no-any-return]
    first = values[0]
    rows: list[Any] = [None] * n
    for v, pos in zip(values, positions, strict=True):
        if not (isinstance(v, torch.Tensor) and v.is_nested):
            raise _mismatch(names, where, f"a nested tensor and a {type(v).__name__}")
        parts = v.unbind()
        if v.dtype != first.dtype or (parts and parts[0].shape[1:] != first.unbind()[0].shape[1:]):
            raise _mismatch(names, where, f"nested {first.dtype} and {v.dtype} records")
        if len(parts) != len(pos):
            raise _mismatch(names, where, f"{len(parts)} records for {len(pos)} samples")
        for p, row in zip(pos.tolist(), parts, strict=True):
            rows[p] = row
    return nest(rows)
