"""One read, into the batch, for a :class:`~feedpipe.datasets.mixed.MixedDataset` of typed or
ragged :class:`~feedpipe.MemmapDataset` members.

Where every member has the same columns (layout, side fields, ``ragged=`` mode) and reads
without a transform (:meth:`MemmapDataset.column_reader`), a batch is read as one dataset of
the members' records would read it, with no per-member batch and no merge: the batch's
``(member, sample)`` are split once, and each present member locates its rows once
(:class:`_Rows`). A variable-length column (ragged arrays, ``str``, ``json``) gets every row's
byte length first, in the batch's order, so the output offsets of the whole batch are known;
then every member's shard maps of the batch are held (each checked by its guard; the process's
inotify watcher drained once for all of them) and the rows' byte ranges are copied straight
into their places in one buffer, in one gather over a window spanning those maps (as one map's
rows), which is assembled as a single dataset's is (a ragged
column padded with each row's own member's ``pad_value``). A fixed side field is one ``take``
from the members' in-memory columns side by side; fixed records one gather over the members'
maps (:func:`~._mixed_take.one_take`). Anything else (another layout, a transform, remote members,
an ``out``, no rows) returns ``None``: the caller reads member by member and merges.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._batch_pool import BatchPool
from feedpipe.datasets._gather import window
from feedpipe.datasets._memmap_columns import ColumnReader
from feedpipe.datasets._memmap_open import OpenShard, OpenShards
from feedpipe.datasets._mixed_layout import EpochLayout
from feedpipe.datasets._mixed_take import one_take
from feedpipe.datasets.columns import Column, assemble, gather
from feedpipe.errors import DatasetError

__all__ = ["HELD_MAX", "typed_take"]

_PAGE = mmap.PAGESIZE  # a map starts on a page: the window's rows are its bytes
HELD_MAX = 64  # a batch's maps held at once (one gather over them) up to this many


@dataclass
class _Rows:
    """Member ``k``'s rows of the batch: their positions ``pos``, shards ``sid`` and records in
    them ``local``; ``groups``: ``(shard, positions, records)`` per shard, in reading order."""

    k: int
    pos: np.ndarray
    sid: np.ndarray
    local: np.ndarray
    groups: list[tuple[int, np.ndarray, np.ndarray]]


def _member_rows(k: int, pos: np.ndarray, sample: np.ndarray, files: Any) -> _Rows:
    """Member ``k``'s rows at ``pos`` (its samples ``sample``), located once."""
    sid, local = files.locate(sample)
    order = files.order([0] if len(files.starts) == 2 else np.unique(sid).tolist())
    if len(order) == 1:
        return _Rows(k, pos, sid, local, [(order[0], pos, local)])
    groups = []
    for s in order:
        pick = np.flatnonzero(sid == s)
        groups.append((s, pos[pick], local[pick]))
    return _Rows(k, pos, sid, local, groups)


class _RecordSpace:
    """A member's fixed-record map, as :func:`~._mixed_take.one_take` takes a member."""

    def __init__(self, ds: Any, reader: ColumnReader) -> None:
        self.shape, self.dtype, self.reader = ds.shape, ds.dtype, reader

    def record_space(self) -> Any:
        return self.reader.files.space()


class _Plan:
    """What the members share (checked once per set of members): the layout, the columns in
    the batch's key order, the mode, and each member's reader and pad value."""

    def __init__(self, members: Sequence[Any], readers: list[ColumnReader]) -> None:
        first = members[0]
        self.readers = readers
        self.kind: str = first.kind
        self.mode: str = first.ragged
        self.fields: list[str] = list(first.fields)
        self.variable: dict[str, Column] = dict(readers[0].variable)
        self.spaces = [_RecordSpace(ds, r) for ds, r in zip(members, readers, strict=True)]
        self._whole: dict[str, np.ndarray] = {}  # fixed side fields, every member's side by side

    def pads(self) -> list[Any]:
        """Each member's pad value now (as its own read pads: an assignment is followed)."""
        return [r.pad_value for r in self.readers]

    def whole(self, name: str, members: Iterable[int]) -> np.ndarray:
        """Fixed side field ``name`` of every member, concatenated in member order; the files
        of ``members`` (those the batch reads) checked first, as before every use."""
        for k in members:
            self.readers[k].check_column(name)
        col = self._whole.get(name)
        if col is None:
            parts = [r.column(name, check=False) for r in self.readers]  # checked when read
            col = self._whole[name] = np.concatenate(parts)
        return col


def _shared(members: Sequence[Any]) -> _Plan | None:
    """The plan when every member reads its typed columns without a transform, locally, with
    the same layout, fields and ``ragged=`` mode; else None."""
    readers = []
    for ds in members:
        get = getattr(ds, "column_reader", None)
        reader = get() if callable(get) else None
        if not isinstance(reader, ColumnReader) or reader.files.source.remote:
            return None
        readers.append(reader)
    first, ref = members[0], readers[0]
    if first.kind not in ("none", "ragged", "fixed") or (first.kind == "fixed" and not ref.fields):
        return None
    for ds, reader in zip(members, readers, strict=True):
        same = (ds.kind, ds.ragged, ds.shape, ds.dtype) == (
            first.kind,
            first.ragged,
            first.shape,
            first.dtype,
        )
        if not same or reader.fields != ref.fields or reader.variable != ref.variable:
            return None
        if list(reader.fields) != list(ref.fields):  # the batch's key order
            return None
    return _Plan(members, readers)


_PLANS: dict[tuple[object, ...], _Plan | None] = {}  # per process: the members -> plan


def _plan(members: Sequence[Any]) -> _Plan | None:
    key: list[object] = []  # readers by identity (held: no id is reused), and ragged= modes
    for ds in members:
        get = getattr(ds, "column_reader", None)
        reader = get() if callable(get) else None
        if not isinstance(reader, ColumnReader):
            return None
        key += (reader, ds.ragged)
    return _cached(tuple(key), members)


def _cached(key: tuple[object, ...], members: Sequence[Any]) -> _Plan | None:
    try:
        return _PLANS[key]
    except KeyError:
        pass
    plan = _shared(members)  # a race makes it twice: the same plan
    if len(_PLANS) > 64:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def typed_take(
    members: Sequence[Any], layout: EpochLayout, idx: np.ndarray, out: Any, pool: BatchPool
) -> Any:
    """The batch of positions ``idx`` of ``layout``'s epoch of typed or ragged members, read
    straight into one batch; None where that cannot be had."""
    n = len(idx)
    if out is not None or n == 0:
        return None
    plan = _plan(members)
    if plan is None:
        return None
    member, sample = layout.split_at(idx)
    rows = []
    for k in np.bincount(member).nonzero()[0].tolist():  # one locate per member per batch
        pos = np.flatnonzero(member == k)
        rows.append(_member_rows(k, pos, sample[pos], plan.readers[k].files))
    batch: dict[str, Any] = {}
    virtual: np.ndarray | None = None  # made for the first fixed side field
    if plan.kind == "ragged":
        batch.update(_variable(plan, plan.variable["data"], rows, member, n))
    elif plan.kind == "fixed":
        data = one_take(plan.spaces, layout, idx, None, pool)
        if data is None:
            return None
        batch["data"] = data
    for name in plan.fields:
        col = plan.variable.get(name)
        if col is not None:
            batch.update(_variable(plan, col, rows, member, n))
        else:
            virtual = layout.virtual(idx) if virtual is None else virtual
            batch[name] = torch.from_numpy(
                plan.whole(name, {r.k for r in rows}).take(virtual, axis=0)
            )
    if not plan.fields and plan.mode == "nested":
        return batch["data"]
    return batch


def _variable(
    plan: _Plan, col: Column, rows: list[_Rows], member: np.ndarray, n: int
) -> dict[str, Any]:
    """Variable-length column ``col`` of the batch: every row's byte range, then each member's
    rows copied into their places in one buffer, assembled as one dataset's batch."""
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    for r in rows:
        reader = plan.readers[r.k]
        for s, p, at in r.groups:
            off = reader.offsets(s, col)
            begin = off[at]
            starts[p] = begin
            lengths[p] = off[at + 1] - begin
    dest = np.cumsum(lengths) - lengths  # the output offsets of the whole batch, in its order
    values = np.empty(int(lengths.sum()), np.uint8)
    groups = [(plan.readers[r.k].files, s, p) for r in rows for s, p, _ in r.groups]
    if len(groups) <= HELD_MAX:  # at once: one gather (see _copy)
        pinned: list[tuple[OpenShards, OpenShard]] = []
        try:
            maps = _pin(groups, col.data_role, pinned)  # checked like every read (_shard_guard)
            _copy(maps, starts, lengths, values, dest)
        finally:
            for opened, shard in pinned:
                opened.unpin(shard)
    for files, s, p in groups if len(groups) > HELD_MAX else ():  # one map at a time
        with files.mapped(col.data_role, s) as buf:
            gather(buf, starts[p], lengths[p], values, dest[p])

    def where(j: int) -> str:
        r = next(r for r in rows if r.k == int(member[j]))
        i = int(np.searchsorted(r.pos, j))
        s = int(r.sid[i])
        path = plan.readers[r.k].files.source.local_path(s, col.data_role)
        return f"{path}: record {int(r.local[i])} (shard {s})"

    every = plan.pads()
    pads = {every[r.k] for r in rows}
    if col.kind == "ragged" and plan.mode == "pad" and len(pads) > 1:
        return _padded(col, values, lengths, np.asarray(every, dtype=col.dtype)[member])
    got = assemble(col, values, lengths, plan.mode, pad_value=pads.pop(), where=where)
    if not isinstance(got, dict):
        raise DatasetError(f"column {col.name!r}: unexpected list batch")  # mode is pad/nested
    return got


def _pin(
    groups: list[tuple[Any, int, np.ndarray]],
    role: str,
    pinned: list[tuple[OpenShards, OpenShard]],
) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """Each group's ``(files, shard, positions)`` map of ``role``, open, checked by its
    member's guard and pinned (appended to ``pinned``, which the caller unpins, whatever
    happens): ``(map, its address, positions)`` each. The process's inotify watcher is drained
    once for every member's guard (the first check that has watches drains it; the others see
    the events it read), as one dataset's read drains it once per batch."""
    maps = []
    drained = False
    for files, s, p in groups:
        opened = files.files(role)
        shard, drained = opened.pin(s, drained)
        pinned.append((opened, shard))
        maps.append((opened.rows(shard, 0), shard.address, p))
    return maps


def _copy(
    maps: list[tuple[np.ndarray, int, np.ndarray]],
    starts: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    dest: np.ndarray,
) -> None:
    """Every row's bytes (``starts`` in its group's map, ``(map, address, positions)`` per
    group) into ``values`` at ``dest``: one :func:`~.columns.gather` over one window spanning
    every map (the rows of several maps at once, as one map's), or one per group where a map
    is not a whole mapped range of its own (then only the rows asked for are read either
    way)."""
    spans = [(a, buf.nbytes, p) for buf, a, p in maps if buf.nbytes]
    if len(spans) < 2 or any(a % _PAGE for a, _, _ in spans):
        for buf, _a, p in maps:
            gather(buf, starts[p], lengths[p], values, dest[p])
        return
    lo = min(a for a, _, _ in spans)
    hi = max(a + size for a, size, _ in spans)
    view = window(lo, -(-hi // _PAGE) * _PAGE, 1).reshape(-1)
    at = starts.copy()
    for a, _, p in spans:
        at[p] += a - lo
    gather(view, at, lengths, values, dest)


def _padded(
    col: Column, values: np.ndarray, lengths: np.ndarray, pad: np.ndarray
) -> dict[str, Any]:
    """A padded ragged column whose rows pad with their own member's value (``pad[j]``)."""
    dt, shape = np.dtype(col.dtype), col.shape
    rows = lengths // col.row_bytes if col.row_bytes else np.zeros_like(lengths)
    n = len(rows)
    width = int(rows.max())
    padded = np.empty((n, width, *shape), dtype=dt)
    padded[...] = pad.reshape(n, *([1] * (1 + len(shape))))
    total = int(rows.sum())
    if total:
        elems = values.view(dt).reshape(-1, *shape)
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
        target = np.repeat(np.arange(n, dtype=np.int64) * width, rows) + within
        padded.reshape(n * width, *shape)[target] = elems
    lens = torch.from_numpy(rows.astype(np.int64))
    data = torch.from_numpy(padded)
    if not padded.size:  # plain strides, the column's dtype (as assemble gives)
        data = torch.empty(padded.shape, dtype=data.dtype)
    got: dict[str, Any] = {col.name: data, f"{col.name}_lengths": lens}
    return got
