"""``MixedDataset``: several datasets mixed by weight, with exact per-epoch proportions.

An epoch is ``epoch_samples`` positions. Member ``k`` owns ``counts[k]`` of them, a contiguous
range; the counts are the weights' exact shares of ``epoch_samples`` rounded by the largest
remainder method (fractions are exact rationals, ties go to the earlier member), so they always
sum to ``epoch_samples`` and each is within 1 of its share. Whatever the order, an epoch holds
exactly ``counts[k]`` samples of member ``k``: never a proportion that is right only on average.

Inside its range, position ``j`` of a member of ``n`` samples is sample ``j % n`` while ``j``
lies in a whole pass over the member (``j < count - count % n``), and ``P(j % n)`` in the last,
partial pass, where ``P`` is a Feistel permutation of ``[0, n)`` keyed by ``(seed, epoch, member
name)``. So a count above ``n`` repeats the member (up-sampling: every sample ``count // n`` or
one more times), and a count below ``n`` takes a different random subset of it each epoch,
without repeats (down-sampling). The order within the epoch is the sampler's.

The order is the sampler's: the dataset is map-style, so ``shuffle=True`` or
``feedpipe.DistributedSampler`` mixes the members, and resume and elastic resume are the
sampler's arithmetic on ``(seed, epoch, consumed)``. The dataset adds only which epoch it is and
a digest of the epoch's layout to that state (:meth:`MixedDataset.state_dict`): a few hundred
bytes whatever the number of members. ``read_batch`` reads a batch of fixed-record memmap
members in one gather over all of their maps (:mod:`._mixed_take`), and a batch of typed or
ragged memmap members (same columns, no transform) straight into one batch: each member's rows
are located once and copied into their final places, no member batch, no merge
(:mod:`._mixed_columns`). Other members' batches are read with one ``read_batch`` per member,
with all of that member's indices, and merged into the batch (:mod:`._mixed_merge`). The
positions' samples: :mod:`._mixed_layout`.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from feedpipe._permutation import FeistelPermutation, derive_key
from feedpipe.datasets._batch_pool import BatchPool
from feedpipe.datasets._mixed_columns import typed_take
from feedpipe.datasets._mixed_layout import EpochLayout
from feedpipe.datasets._mixed_shape import MemberShapes
from feedpipe.datasets._mixed_take import one_take

__all__ = ["MixedDataset", "mix_counts"]

_STATE_VERSION = 1


def mix_counts(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` in proportion to ``weights`` by the largest remainder method.

    Exact rational arithmetic: the result sums to ``total``, each count differs from its exact
    share by less than 1, and ties go to the earlier weight.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    fracs = [Fraction(w) for w in weights]
    whole = sum(fracs)
    if whole <= 0:
        raise ValueError("weights must have a positive sum")
    shares = [f * total / whole for f in fracs]
    counts = [math.floor(s) for s in shares]
    left = total - sum(counts)
    order = sorted(range(len(shares)), key=lambda k: (-(shares[k] - counts[k]), k))
    for k in order[:left]:
        counts[k] += 1
    return counts


_MAX_SAMPLES = (1 << 63) - 1  # len() and the int64 positions hold no more
_INT64, _UINT64 = np.dtype(np.int64), np.dtype(np.uint64)
_MAX = np.maximum.reduce


def _name_key(name: str) -> int:
    raw = name.encode("utf-8", "surrogatepass")  # any str, lone surrogates included
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _count(value: Any, what: str) -> int:
    """``value`` as an ``int`` (an integer type: never a silently truncated float)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{what} must be an integer, got {value!r}")


def _weight(name: str, value: Any) -> float:
    """A member's weight: a finite, non-negative real number (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"weight of {name!r} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"weight of {name!r} must be >= 0, got {value!r}")
    return float(value)


class MixedDataset:
    """A map-style dataset over named member datasets, drawn in fixed proportions per epoch.

    Args:
        datasets: ``{"name": dataset}``; each member is map-style (``len`` and ``__getitem__``)
            and, to be fast, has ``read_batch`` (every feedpipe dataset has).
        weights: ``{"name": weight}`` for every member (non-negative, any scale; a zero weight
            leaves the member out). ``None``: in proportion to the members' lengths.
        seed: seeds which samples of a down-sampled or repeated member each epoch takes.
        epoch_samples: samples per epoch (``len(self)``); ``None``: the members' total length.
            With weights, a member whose share exceeds its length is repeated; one whose share
            is smaller is subsampled.

    Call :meth:`set_epoch` with the sampler's epoch (a new subset of each down-sampled member
    every epoch). Save :meth:`state_dict` beside the loader's state; see ``docs/guides/mixing.md``.
    """

    def __init__(
        self,
        datasets: Mapping[str, Any],
        weights: Mapping[str, float] | None = None,
        *,
        seed: int = 0,
        epoch_samples: int | None = None,
    ) -> None:
        if not isinstance(datasets, Mapping) or not datasets:
            raise ValueError("datasets must be a non-empty {name: dataset} mapping")
        for name in datasets:
            if not isinstance(name, str) or not name:
                raise ValueError(f"member names must be non-empty strings, got {name!r}")
        seed = _count(seed, "seed")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.names: list[str] = list(datasets)
        self.datasets: dict[str, Any] = dict(datasets)
        self.lengths: list[int] = [len(datasets[n]) for n in self.names]
        self.seed = int(seed)
        total = (
            sum(self.lengths) if epoch_samples is None else _count(epoch_samples, "epoch_samples")
        )
        if not 1 <= total <= _MAX_SAMPLES:
            raise ValueError(f"epoch_samples must be in [1, 2**63 - 1], got {total}")
        self.epoch_samples = total
        self.weights = self._check_weights(weights)
        self.epoch = 0
        # a resumed epoch keeps the counts it was started with (see load_state_dict)
        self._held: tuple[int, list[int]] | None = None
        self._layout: EpochLayout | None = self._make_layout(self.counts)
        self._pool = BatchPool()  # the one-gather batches' memory: goes with the dataset
        self._shapes = MemberShapes()  # which lists of a member's batch are fields (the merge)

    # ------------------------------------------------------------------ the epoch's layout
    def _check_weights(self, weights: Mapping[str, float] | None) -> list[float]:
        if weights is None:
            return [float(n) for n in self.lengths]
        missing = [n for n in self.names if n not in weights]
        unknown = [n for n in weights if n not in self.datasets]
        if missing or unknown:
            raise ValueError(
                f"weights must name every member exactly: missing {missing}, unknown {unknown}"
            )
        out = [_weight(n, weights[n]) for n in self.names]
        if sum(out) <= 0:
            raise ValueError("at least one weight must be positive")
        for n, w, length in zip(self.names, out, self.lengths, strict=True):
            if w > 0 and length == 0:
                raise ValueError(f"member {n!r} is empty but has weight {w}")
        return out

    @property
    def counts(self) -> list[int]:
        """Samples of each member (in ``names`` order) in the current epoch."""
        if self._held is not None and self._held[0] == self.epoch:
            return list(self._held[1])
        return mix_counts(self.weights, self.epoch_samples)

    def _make_layout(self, counts: list[int]) -> EpochLayout:
        perms = [
            FeistelPermutation(n, derive_key(self.seed, self.epoch, _name_key(name)))
            for name, n in zip(self.names, self.lengths, strict=True)
        ]
        return EpochLayout(self.epoch, counts, self.lengths, perms)

    def _current(self) -> EpochLayout:
        layout = self._layout  # one read: thread-safe against a concurrent set_epoch
        if layout is None or layout.epoch != self.epoch:
            layout = self._make_layout(self.counts)
            self._layout = layout
        return layout

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_layout"] = None  # re-made where it is unpickled
        return state

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (call it with the sampler's ``set_epoch``)."""
        epoch = _count(epoch, "epoch")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch

    # ------------------------------------------------------------------ the dataset contract
    def __len__(self) -> int:
        return self.epoch_samples

    @property
    def takes_index_arrays(self) -> bool:
        """``read_batch`` takes 1-D ``int64`` numpy index arrays."""
        return True

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(member, sample)`` arrays for positions ``indices`` of the current epoch."""
        return self._current().locate(self._checked(indices))

    def _checked(self, indices: Any) -> np.ndarray:
        """``indices`` as a 1-D int64 array, each in range (else an ``IndexError``); anything but
        integers (floats, a bool mask, strings, 2-D) is a ``TypeError``, never truncated."""
        if (
            type(indices) is np.ndarray
            and indices.dtype is _INT64
            and indices.ndim == 1
            and indices.size
            and _MAX(indices.view(_UINT64)) < self.epoch_samples
        ):
            return indices  # what the loader passes: one reduction (negatives look huge)
        raw = np.asarray(indices)  # a CPU tensor too, with its own dtype
        if raw.size and (raw.dtype.kind not in "iu" or raw.ndim > 1):
            raise TypeError(
                f"indices must be a 1-D sequence of integers, got {raw.dtype} {raw.shape}"
            )
        if raw.dtype == np.uint64 and raw.size and int(raw.max()) > _MAX_SAMPLES:
            raise IndexError(f"index {int(raw.max())} is out of range for MixedDataset")
        idx = raw.astype(np.int64).reshape(-1)
        n = self.epoch_samples
        if idx.size and idx.view(np.uint64).max() >= n:  # negatives look huge
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"index {int(bad)} is out of range for MixedDataset of length {n}")
        return idx

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, (bool, np.bool_)):
            raise TypeError("index must be an int, got bool")
        try:
            at = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int, got {type(index).__name__}") from None
        member, sample = self.locate([at])
        return self.datasets[self.names[int(member[0])]][int(sample[0])]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        member, sample = self.locate(indices)
        out: list[Any] = [None] * len(member)
        for k in np.unique(member).tolist():
            pos = np.flatnonzero(member == k)
            ds = self.datasets[self.names[k]]
            local = sample[pos].tolist()
            many = getattr(ds, "__getitems__", None)
            items = many(local) if callable(many) else [ds[i] for i in local]
            for p, item in zip(pos.tolist(), items, strict=True):
                out[p] = item
        return out

    def read_batch(self, indices: Sequence[int] | np.ndarray, out: Any = None) -> Any:
        """``default_collate([self[i] for i in indices])``: one gather (fixed memmap members),
        one read into the batch (typed/ragged memmap members) or one ``read_batch`` per member,
        merged."""
        idx = self._checked(indices)
        layout = self._current()
        members = [self.datasets[name] for name in self.names]
        fast = one_take(members, layout, idx, out, self._pool)
        if fast is not None:  # fixed records of memmap members: one gather, no merge
            return fast
        typed = typed_take(members, layout, idx, out, self._pool)
        if typed is not None:  # typed/ragged memmap members: read into one batch, no merge
            return typed
        from feedpipe.datasets._mixed_merge import fill_out, merge_parts

        member, sample = layout.split(layout.virtual(idx))
        present = np.unique(member).tolist() if member.size else [0]
        parts: list[tuple[np.ndarray, Any]] = []
        for k in present:
            pos = np.flatnonzero(member == k)
            parts.append((pos, _member_batch(self.datasets[self.names[k]], sample[pos])))
        names = [self.names[k] for k in present]

        def shapes(j: int) -> Any:  # which lists are fields: as the member says (_mixed_shape)
            pos, k = parts[j][0], present[j]
            ds = self.datasets[self.names[k]]
            return self._shapes.of(k, ds, int(sample[pos[0]])) if len(pos) else None

        if len(parts) > 1:
            pads = [getattr(self.datasets[n], "pad_value", 0) for n in names]
            return merge_parts(parts, len(member), names, out, pads=pads, shapes=shapes)
        return parts[0][1] if out is None else fill_out(parts[0][1], out, shapes)

    # ------------------------------------------------------------------ state
    def _digest(self, counts: list[int]) -> str:
        doc = [self.names, self.lengths, counts, self.epoch_samples]
        return hashlib.blake2b(json.dumps(doc).encode(), digest_size=8).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """Which epoch, and a digest of its layout; the same on every rank, O(1) in members."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "epoch_samples": self.epoch_samples,
            "members": len(self.names),
            "layout": self._digest(self.counts),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, weights: Mapping[str, float] | None = None
    ) -> None:
        """Resume the saved epoch with the layout it was started with.

        When this dataset's weights differ from those the saved epoch used, pass the saved
        epoch's weights as ``weights``: that epoch finishes with them, and the next epoch uses
        this dataset's own. Members, their lengths, ``epoch_samples`` and ``seed`` must match.
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else state
            raise ValueError(f"unsupported MixedDataset state version {got!r}")
        for key, ours in (
            ("seed", self.seed),
            ("epoch_samples", self.epoch_samples),
            ("members", len(self.names)),
        ):
            if type(state.get(key)) is not int or state.get(key) != ours:  # 7.0, True: no
                raise ValueError(
                    f"MixedDataset state has {key} {state.get(key)!r}, this dataset {ours!r}"
                )
        epoch = state.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"MixedDataset state: bad epoch {epoch!r}")
        old = (
            mix_counts(self.weights, self.epoch_samples)
            if weights is None
            else mix_counts(self._check_weights(weights), self.epoch_samples)
        )
        if self._digest(old) != state.get("layout"):
            hint = (
                "pass the weights the saved epoch used: load_state_dict(state, weights=old)"
                if weights is None
                else "the given weights are not those of the saved epoch either"
            )
            raise ValueError(
                "MixedDataset state was saved with another layout (other weights, members or "
                f"member lengths): {hint}"
            )
        self.epoch = epoch
        self._held = (epoch, old)
        self._layout = None  # re-made with the held counts (also when the epoch is the same)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={c}" for n, c in zip(self.names, self.counts, strict=True))
        return f"MixedDataset({parts}; epoch={self.epoch}, seed={self.seed})"


def _member_batch(ds: Any, sample: np.ndarray) -> Any:
    """One batch of ``ds`` for ``sample``: its ``read_batch`` (one call), else collated items."""
    read = getattr(ds, "read_batch", None)
    if callable(read):
        arrays = getattr(ds, "takes_index_arrays", False) is True
        return read(sample if arrays else sample.tolist())
    from torch.utils.data import default_collate

    many = getattr(ds, "__getitems__", None)
    local = sample.tolist()
    return default_collate(many(local) if callable(many) else [ds[i] for i in local])
