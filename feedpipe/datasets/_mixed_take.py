"""One gather for a :class:`~feedpipe.datasets.mixed.MixedDataset` batch of fixed-size records.

When every member in a batch is a :class:`~feedpipe.MemmapDataset` whose batch is one gather
from its one-range map (``record_space()``: local fixed records, no side fields, no transform)
and all have the same record shape and dtype, the batch is read with one ``np.take`` straight
into the output: each member's share is located in its own map (:meth:`ShardSpace.rows`), the
rows are laid side by side in batch order, and one gather over a window spanning every member's
map copies each record once. Every space is range-aligned to its record size, so the rows of
all of them are whole rows of one window. Each member's shards are checked by its own guard
before the gather (:meth:`ShardSpace.enter`), as in the member's own ``read_batch``.

Anything else (other layouts, a CUDA ``out``, mixed record types) returns ``None``: the caller
reads member by member and merges (:mod:`._mixed_merge`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._gather import ShardSpace, window

__all__ = ["one_take"]

_WINDOWS: dict[tuple[int, int, int], np.ndarray] = {}  # (first, end, record bytes) -> view


def _spaces(members: Sequence[Any]) -> list[ShardSpace] | None:
    """Every member's one-range map when each has one, all of one record type, else None."""
    spaces = []
    first = members[0]
    for ds in members:
        get = getattr(ds, "record_space", None)
        space = get() if callable(get) else None
        if space is None:
            return None
        if ds is not first and (ds.shape != first.shape or ds.dtype != first.dtype):
            return None
        spaces.append(space)
    return spaces


def _window(spaces: list[ShardSpace]) -> tuple[int, np.ndarray]:
    """The first row and the view of a window spanning every space's rows (cached)."""
    lo = min(s.first_row for s in spaces)
    hi = max(s.end_row for s in spaces)
    rb = spaces[0].record_bytes
    view = _WINDOWS.get((lo, hi, rb))
    if view is None:
        if len(_WINDOWS) > 64:
            _WINDOWS.clear()
        view = _WINDOWS[(lo, hi, rb)] = window(lo, hi, rb)
    return lo, view


def _fits(out: Any, n: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> torch.Tensor | None:
    """``out``'s first ``n`` rows when they are a contiguous CPU tensor of ``dtype`` with rows
    of ``shape``, else None."""
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or out.ndim == 0:
        return None
    want = torch.from_numpy(np.empty(0, dtype)).dtype
    if out.dtype != want or tuple(out.shape[1:]) != tuple(shape):
        return None
    view = out[:n]
    return view if view.shape[0] == n and view.is_contiguous() else None


def one_take(
    members: Sequence[Any], present: list[int], member: np.ndarray, sample: np.ndarray, out: Any
) -> torch.Tensor | None:
    """The batch of ``sample[j]`` of member ``member[j]`` (``members[k]``; ``present``: the ``k``
    in the batch) in one gather into a new tensor or ``out``; None where that cannot be had."""
    n = len(member)
    spaces = _spaces([members[k] for k in present]) if n else None
    if spaces is None:
        return None
    first = members[present[0]]
    if out is None:
        arr = np.empty((n, *first.shape), first.dtype)
        dest = torch.from_numpy(arr)
    else:
        dest = _fits(out, n, first.shape, first.dtype)
        if dest is None:
            return None  # the merge fills (or refuses) it, as ever
        arr = dest.numpy()
    if arr.size == 0:
        return dest
    rows = np.empty(n, np.int64)
    sids = []
    for k, space in zip(present, spaces, strict=True):
        pos = np.flatnonzero(member == k) if len(present) > 1 else slice(None)
        sid, got = space.rows(sample[pos])
        rows[pos] = got
        sids.append(sid)
    lo, view = _window(spaces)
    rows -= lo
    _gather(spaces, sids, view, rows, arr.reshape(n, -1).view(np.uint8))
    return dest


def _gather(
    spaces: list[ShardSpace], sids: list[np.ndarray], view: np.ndarray, rows: np.ndarray,
    flat: np.ndarray,
) -> None:
    """``np.take`` of ``rows`` of ``view`` into ``flat`` with every space entered meanwhile."""
    entered: list[ShardSpace] = []
    try:
        for space, sid in zip(spaces, sids, strict=True):
            space.enter(sid)
            entered.append(space)
        np.take(view, rows, axis=0, out=flat, mode="clip")
    finally:
        for space in entered:
            space.leave()
