"""One gather for a :class:`~feedpipe.datasets.mixed.MixedDataset` batch of fixed-size records.

When every member is a :class:`~feedpipe.MemmapDataset` whose batch is one gather from its
one-range map (``record_space()``: local fixed records, no side fields, no transform) and all
have the same record shape and dtype, a batch is read with one ``np.take`` straight into the
output, whatever the number of members and shards. Each member's records are numbered after
the previous members' (a *virtual* index: ``member_start + sample``); the members' shards side
by side are one table (:class:`_Spans`), so one lookup (a table of every record's shard, for
members of up to ``SHARD_TABLE_MAX`` records; else one ``searchsorted``) finds every record's
shard and one add its row. Every map is aligned to its record size, so the rows of all of them
are rows of one window over the address space (:func:`~._gather.window`), read in one
``np.take``: each record is copied once, into its row of the batch (or, where the batch's
memory lies between two members' maps, into a new array: :func:`gather`). A batch too small for
the dataset's pool, of records up to ``NEW_RECORD_MAX`` bytes, is copied in the widest word a
record allows into memory ``take`` allocates, as a single dataset's read does. Each member's shards
touched are mapped and checked by its own guard first (:meth:`ShardSpace.ensure`,
:meth:`ShardSpace.enter`), as its own ``read_batch`` does; the process's inotify watcher is
drained once per batch for all of them (the first guard's check; the others see the events
it read).

Anything else (other layouts or members, a CUDA or an ill-fitting ``out``) returns ``None``:
the caller reads member by member and merges (:mod:`._mixed_merge`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._batch_pool import BatchPool
from feedpipe.datasets._gather import MapsClosedError, ShardSpace, window, word_rows
from feedpipe.datasets._mixed_layout import EpochLayout
from feedpipe.errors import DatasetError

__all__ = ["ENTER_ALL_MAX", "NEW_RECORD_MAX", "SHARD_TABLE_MAX", "gather", "one_take"]


SHARD_TABLE_MAX = 1 << 21  # members' records up to this many: each one's shard tabulated
#: records up to this many bytes, in batches the pool does not keep, are gathered into memory
#: that ``take`` allocates (as one dataset's read does; larger ones into cache-line-aligned
#: memory from the pool, where row copies are faster)
NEW_RECORD_MAX = 4096
ENTER_ALL_MAX = 8  # members of one shard each, up to this many: each guard checks every batch
_ONE = np.zeros(1, np.intp)  # the shards of a one-shard member


class _Spans:
    """The members' maps (``spaces``, member ``k``'s records numbered from ``vbase[k]``) as one
    table of shards, and one window over all of them.

    Per batch (:meth:`read`): each position's row of the window and shard of the table, two
    lookups in tables of the epoch's positions (made once per epoch: :meth:`tables`; an epoch
    too long to tabulate finds each record's shard by a table of every record's shard, made
    once when the members hold at most ``SHARD_TABLE_MAX`` records, else a ``searchsorted``);
    each member's shards touched checked by its guard (the process's inotify watcher drained
    once for all of them), then one ``take``."""

    def __init__(self, spaces: list[ShardSpace], vbase: np.ndarray) -> None:
        self.spaces = spaces
        counts = [len(s.starts) - 1 for s in spaces]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.starts = np.concatenate(
            [s.starts[:-1] + v for s, v in zip(spaces, vbase.tolist(), strict=True)]
        )
        self.first = min(s.first_row for s in spaces)
        self.view = window(self.first, max(s.end_row for s in spaces), spaces[0].record_bytes)
        self.shift = np.concatenate(
            [s.row_shift() - v - self.first for s, v in zip(spaces, vbase.tolist(), strict=True)]
        )
        total = int(vbase[-1]) + int(spaces[-1].starts[-1])
        self.shard_of: np.ndarray | None = None
        if total <= SHARD_TABLE_MAX:  # shards cover [0, total) in order: empty ones get none
            sizes = np.diff(np.append(self.starts, total))
            self.shard_of = np.repeat(np.arange(len(sizes), dtype=np.intp), sizes)
        self.one_each = len(self.starts) == len(spaces)  # every member's records in one shard
        self.few = self.one_each and len(spaces) <= ENTER_ALL_MAX  # see read
        #: the window in the widest word that divides a record and its address (a batch of new
        #: memory is copied in words: 8-byte ones are faster than bytes at 512 B records)
        self.words = word_rows(self.view, self.first * spaces[0].record_bytes)

    def copy(self, rows: np.ndarray, flat: np.ndarray | None) -> np.ndarray:
        """Rows ``rows`` of the window: into ``flat`` (:func:`gather`), or, with ``flat``
        None, into a new array that ``take`` allocates (as a single dataset's read does)."""
        if flat is None:
            got: np.ndarray = self.words.take(rows, axis=0, mode="clip")
            return got.view(np.uint8)
        return gather(self.view, rows, flat)

    def shards(self, virtual: np.ndarray) -> np.ndarray:
        """The shard (of the table) of each of records ``virtual``."""
        if self.shard_of is not None:
            return self.shard_of.take(virtual)
        shard = np.searchsorted(self.starts, virtual, side="right")
        shard -= 1
        return shard

    def read(self, layout: EpochLayout, idx: np.ndarray, flat: np.ndarray | None) -> np.ndarray:
        """Positions ``idx`` of ``layout``'s epoch as ``(n, record_bytes)`` uint8 (:meth:`take`).

        Members of one shard each (at most ``ENTER_ALL_MAX``), all mapped: every member's guard
        checks its shard (one lookup less than finding the members touched first); where one
        refuses (a file changed, maps closed), the batch is read as :meth:`take` reads it: it
        fails only if it touches that member, as a single dataset's read does."""
        made = layout.derived(self, self.tables)
        if made is None:  # too many positions to tabulate: per batch
            return self.take(*self.rows(layout.virtual(idx)), flat)
        rows = made[0].take(idx)
        if self.few and all(space.complete for space in self.spaces):
            entered = self.enter_all()
            if entered is not None:
                try:
                    return self.copy(rows, flat)
                finally:
                    for space in entered:
                        space.leave()
        return self.take(rows, made[1].take(idx), flat)

    def enter_all(self) -> list[ShardSpace] | None:
        """Every member's shard checked by its guard (:meth:`ShardSpace.enter`), the watcher
        drained once; None (none entered) where one refuses (a file changed: DatasetError; its
        maps closed: MapsClosedError). Any other error is raised, none left entered."""
        entered: list[ShardSpace] = []
        drained = False
        try:
            for space in self.spaces:
                drained = space.enter(_ONE, drained)
                entered.append(space)
        except BaseException as exc:  # every one entered is left, whatever was raised
            for space in entered:
                space.leave()
            if isinstance(exc, (DatasetError, MapsClosedError)):
                return None
            raise
        return entered

    def rows(self, virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows of the window, shards of the table)`` of records ``virtual``."""
        shard = self.shards(virtual)
        rows = self.shift.take(shard)
        rows += virtual
        return rows, shard

    def tables(self, virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`rows` of records ``virtual`` in the smallest integer types that hold them
        (a batch's lookups then touch half the memory or less)."""
        rows, shard = self.rows(virtual)
        small = np.int32 if len(self.view) <= np.iinfo(np.int32).max else np.int64
        return rows.astype(small), shard.astype(np.min_scalar_type(len(self.starts) - 1))

    def take(self, rows: np.ndarray, shard: np.ndarray, flat: np.ndarray | None) -> np.ndarray:
        """Rows ``rows`` (of shards ``shard``) as ``(n, record_bytes)`` uint8, in one gather:
        ``flat``, or a new array where ``flat`` lies between two members' maps (:func:`gather`).
        Every member's shards touched are mapped and checked by its guard first."""
        hit = np.bincount(shard, minlength=len(self.starts)).nonzero()[0]
        entered: list[ShardSpace] = []
        drained = False  # the watcher is drained once for every member's guard
        try:
            for k, sids in self.touched(hit):
                space = self.spaces[k]
                if not space.complete:
                    space.ensure(sids)
                drained = space.enter(sids, drained)
                entered.append(space)
            return self.copy(rows, flat)
        finally:
            for space in entered:
                space.leave()

    def touched(self, hit: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(member, its shards)`` of the table's shards ``hit`` (sorted), per member touched."""
        if self.one_each:  # shard k of the table is member k's only one
            return [(k, _ONE) for k in hit.tolist()]
        cuts = np.searchsorted(hit, self.offsets).tolist()
        return [
            (k, hit[a:b] - self.offsets[k])
            for k, (a, b) in enumerate(itertools.pairwise(cuts))
            if a < b
        ]


def gather(view: np.ndarray, rows: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of ``view`` (a :func:`~._gather.window`), copied once: into ``flat`` (and
    returned) where ``flat`` lies outside ``view``'s bounds, else into a new array (returned).

    ``np.take(..., out=)`` checks only the bounds of its operands for overlap, and the window's
    bounds span the gaps between the members' maps, where ``malloc`` places memory too (a
    thread's arena, a large block): a batch there would be copied twice, through a temporary
    that numpy allocates and faults in (what made a mix slow in loader worker threads)."""
    if not np.may_share_memory(view, flat):  # the same bounds check, without a copy
        view.take(rows, axis=0, out=flat, mode="clip")
        return flat
    got: np.ndarray = view.take(rows, axis=0, mode="clip")
    return got


_SPANS: dict[tuple[ShardSpace, ...], _Spans] = {}  # per process: the members' maps -> table


def _spans(members: Sequence[Any], vbase: np.ndarray) -> _Spans | None:
    """The table of the members' maps, when each has one and all hold one record type."""
    spaces = []
    for ds in members:
        get = getattr(ds, "record_space", None)
        space = get() if callable(get) else None
        if space is None:
            return None
        spaces.append(space)
    key = tuple(spaces)  # by identity; the table holds them: no id is reused meanwhile
    spans = _SPANS.get(key)
    if spans is None:
        first = members[0]
        if any(ds.shape != first.shape or ds.dtype != first.dtype for ds in members):
            return None
        if len(_SPANS) > 64:
            _SPANS.clear()
        spans = _SPANS[key] = _Spans(spaces, vbase)
    return spans


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


def _read(
    spans: _Spans, layout: EpochLayout, idx: np.ndarray, flat: np.ndarray | None
) -> np.ndarray | None:
    """:meth:`_Spans.read`, or None where a member's maps were closed meanwhile (by another
    thread): the caller then reads member by member, each reopened, as its own read is."""
    try:
        return spans.read(layout, idx, flat)
    except MapsClosedError:  # ShardSpace.ensure / enter: another thread closed the maps
        return None


def one_take(
    members: Sequence[Any], layout: EpochLayout, idx: np.ndarray, out: Any, pool: BatchPool
) -> torch.Tensor | None:
    """The batch of positions ``idx`` of ``layout``'s epoch (member ``k``'s sample ``i`` is
    record ``layout.vbase[k] + i``) in one gather, into a new tensor (memory from ``pool``, the
    dataset's own: it goes with the dataset) or ``out``; None where that cannot be had."""
    n = len(idx)
    try:
        spans = _spans(members, layout.vbase) if n else None
    except MapsClosedError:  # a member's maps closed meanwhile (another thread): see _read
        return None
    if spans is None:
        return None
    first = members[0]
    rb = spans.view.shape[1]
    if out is None and 0 < rb <= NEW_RECORD_MAX and n * rb < pool.min_bytes:  # as one dataset
        got = _read(spans, layout, idx, None)
        if got is None:
            return None
        return torch.from_numpy(got.view(first.dtype).reshape(n, *first.shape))
    if out is None:
        arr = pool.empty((n, *first.shape), first.dtype)
        dest = torch.from_numpy(arr)
    else:
        fit = _fits(out, n, first.shape, first.dtype)
        if fit is None:
            return None  # the merge fills (or refuses) it, as ever
        dest, arr = fit, fit.numpy()
    if arr.size:
        flat = arr.reshape(n, -1).view(np.uint8)
        got = _read(spans, layout, idx, flat)
        if got is None:
            return None
        if got is not flat:  # the batch's memory lay between the members' maps
            if out is not None:
                np.copyto(flat, got)  # the caller's memory: as numpy's own take would
            else:
                dest = torch.from_numpy(got.view(first.dtype).reshape(n, *first.shape))
    return dest
