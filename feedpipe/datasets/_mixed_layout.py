"""One epoch's layout of a :class:`~feedpipe.datasets.mixed.MixedDataset`: which member and
which of its samples each position of the epoch is (see the ``mixed`` module docstring).

:meth:`EpochLayout.locate` is vectorised over a batch: one ``searchsorted`` for the members, one
remainder for the whole passes, and one lookup, for every member at once, into the partial
passes' permutations, tabulated once per epoch (a member whose partial pass exceeds
``TABLE_MAX`` samples evaluates its permutation per batch instead). :meth:`EpochLayout.virtual`
numbers every member's samples after the previous members' (one index for the fast path of
:mod:`._mixed_take`); an epoch of up to ``POSITIONS_MAX`` positions is tabulated whole, so a
batch is then one lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from feedpipe._permutation import FeistelPermutation

__all__ = ["POSITIONS_MAX", "TABLE_MAX", "EpochLayout"]

T = TypeVar("T")
_SPLIT = "split"  # the key of split_at's tables (see derived)
TABLE_MAX = 1 << 22  # a partial pass up to this many samples is tabulated once per epoch
POSITIONS_MAX = 1 << 20  # an epoch up to this many positions is tabulated whole (8 MiB)


class EpochLayout:
    """Epoch ``epoch``: member ``k`` owns ``counts[k]`` positions (a contiguous range) of its
    ``lengths[k]`` samples, its partial pass permuted by ``perms[k]``."""

    def __init__(
        self, epoch: int, counts: list[int], lengths: list[int], perms: list[FeistelPermutation]
    ) -> None:
        self.epoch, self.counts, self.perms = epoch, counts, perms
        counted = np.asarray(counts, dtype=np.int64)
        self.ends = np.cumsum(counted)
        self.starts = self.ends - counted
        self.lengths = np.maximum(np.asarray(lengths, dtype=np.int64), 1)  # empty: never read
        self.extra = counted % self.lengths  # samples in the partial pass
        self.whole = counted - self.extra  # positions before it
        self._lookup: tuple[np.ndarray, np.ndarray] | None = None
        # member k's samples are numbered from vbase[k] on: the *virtual* index of a sample
        sizes = np.asarray(lengths, dtype=np.int64)
        self.vends = np.cumsum(sizes)
        self.vbase = self.vends - sizes
        self._virtual: np.ndarray | None = None  # per position, made on first use
        self._derived: dict[object, Any] = {}  # tables made from it (see derived)

    def virtual(self, idx: np.ndarray) -> np.ndarray:
        """The virtual index of the sample at each of positions ``idx`` (int64, in range): one
        lookup in a table of the epoch (made once, when it has at most ``POSITIONS_MAX``
        positions), else from :meth:`locate`."""
        table = self.table()
        if table is None:
            member, sample = self.locate(idx)
            computed: np.ndarray = self.vbase[member] + sample
            return computed
        looked: np.ndarray = table.take(idx)
        return looked

    def table(self) -> np.ndarray | None:
        """The virtual index of every position of the epoch (made once, on first use), or None
        for an epoch of more than ``POSITIONS_MAX`` positions. Never write it."""
        table = self._virtual
        if table is None:
            total = int(self.ends[-1])
            if total > POSITIONS_MAX:
                return None
            member, sample = self.locate(np.arange(total, dtype=np.int64))
            table = self._virtual = self.vbase[member] + sample
        return table

    def derived(self, key: object, make: Callable[[np.ndarray], T]) -> T | None:
        """``make(self.table())``, made once per ``key`` (held: no id is reused) for this
        epoch; None where the positions are not tabulated (see :meth:`table`)."""
        try:
            return self._derived[key]  # type: ignore[no-any-return]
        except KeyError:
            pass
        table = self.table()
        if table is None:
            return None
        if len(self._derived) > 8:
            self._derived.clear()
        got = self._derived[key] = make(table)  # a race makes it twice: the same
        return got

    def split_at(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(member, sample)`` of positions ``idx`` (int64, in range): two lookups in tables
        of the epoch (the members in the smallest type that holds them), where it is
        tabulated; else :meth:`split` of :meth:`virtual`."""
        made = self.derived(_SPLIT, self._split_table)
        if made is None:
            return self.split(self.virtual(idx))
        return made[0].take(idx), made[1].take(idx)

    def _split_table(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        member, sample = self.split(table)
        return member.astype(np.min_scalar_type(len(self.counts) - 1)), sample

    def split(self, virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(member, sample)`` of virtual indices (those :meth:`virtual` gives)."""
        member = np.searchsorted(self.vends, virtual, side="right")
        return member, virtual - self.vbase[member]

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(member, sample)`` of positions ``idx`` (int64, in range)."""
        member = np.searchsorted(self.ends, idx, side="right")
        local = idx - self.starts[member]
        sample = local % self.lengths[member]
        partial = np.flatnonzero(local >= self.whole[member])  # in a partial pass
        if partial.size:
            self._permute(member[partial], partial, sample)
        return member, sample

    def _permute(self, members: np.ndarray, partial: np.ndarray, sample: np.ndarray) -> None:
        """``sample[partial]`` (of ``members``) through the partial passes' permutations."""
        table, offset = self.lookup()
        start = offset[members]
        tabled = start >= 0
        if tabled.all():
            sample[partial] = table[start + sample[partial]]
            return
        pick = partial[tabled]
        sample[pick] = table[start[tabled] + sample[pick]]
        for k in np.unique(members[~tabled]).tolist():  # too big to tabulate
            sel = partial[members == k]
            sample[sel] = self.perms[k](sample[sel])

    def lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """Every tabulated partial pass side by side, and where each member's starts (-1: not
        tabulated); made once per epoch, on first use."""
        made = self._lookup
        if made is None:
            offset = np.full(len(self.counts), -1, np.int64)
            parts, at = [], 0
            for k, extra in enumerate(self.extra.tolist()):
                if 0 < extra <= TABLE_MAX:
                    offset[k] = at
                    parts.append(self.perms[k](np.arange(extra, dtype=np.int64)))
                    at += extra
            table = np.concatenate(parts) if parts else np.empty(0, np.int64)
            made = self._lookup = (table, offset)
        return made
