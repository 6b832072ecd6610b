"""Seeded permutations of ``[0, n)`` that are evaluated at any positions, never materialised.

* :class:`FeistelPermutation` is a keyed bijection on ``[0, n)``: a balanced Feistel network on
  the smallest even number of bits that covers ``n``, restricted to ``[0, n)`` by cycle-walking
  (re-encrypt until the value falls inside). Evaluating it at ``k`` positions costs ``O(k)`` time
  and memory, whatever ``n`` is; the state is two integers.
* :class:`BlockPermutation` shuffles the order of fixed-size blocks, groups consecutive blocks of
  that order into windows, and shuffles the samples inside each window: any run of consecutive
  positions touches at most two windows' blocks, yet every epoch visits the blocks in a new order.
* :class:`TorchPermutation` is ``torch.randperm(n, generator=g)`` with ``g.manual_seed(seed)``: it
  reproduces ``torch.utils.data.DistributedSampler`` exactly and, like it, holds ``n`` integers.

All of them map an ``int64`` array of positions to an ``int64`` array of sample indices.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = [
    "BlockPermutation",
    "FeistelPermutation",
    "IdentityPermutation",
    "Permutation",
    "TorchPermutation",
    "derive_key",
]

_MASK64 = (1 << 64) - 1
_ROUNDS = 6
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)


def _splitmix64(x: int) -> int:
    """One step of splitmix64 on a Python int (the standard 64-bit seed expander)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """A 64-bit key from any number of non-negative integers (seed, epoch, stream, ...)."""
    key = 0x6A09E667F3BCC908
    for part in parts:
        key = _splitmix64(key ^ (part & _MASK64))
        key = _splitmix64(key ^ (part >> 64))
    return key


def _fmix(x: np.ndarray) -> np.ndarray:
    """The murmur3 64-bit finaliser, element-wise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(33))
    x = x * _C1
    x = x ^ (x >> np.uint64(33))
    x = x * _C2
    out: np.ndarray = x ^ (x >> np.uint64(33))
    return out


class Permutation(Protocol):
    """A bijection on ``[0, n)``, evaluated at an array of positions."""

    n: int

    def __call__(self, positions: np.ndarray) -> np.ndarray: ...


class IdentityPermutation:
    """``p -> p`` (``shuffle=False``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)


class TorchPermutation:
    """``torch.randperm(n)`` seeded exactly as ``torch.utils.data.DistributedSampler`` seeds it."""

    def __init__(self, n: int, seed: int) -> None:
        import torch

        self.n = n
        g = torch.Generator()
        g.manual_seed(seed)
        self._perm = torch.randperm(n, generator=g).numpy()

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self._perm[np.asarray(positions, dtype=np.int64)].astype(np.int64, copy=False)


def _network(x: np.ndarray, keys: list[np.ndarray], half: int, decrypt: bool) -> np.ndarray:
    """A balanced Feistel network on ``2 * half`` bits; keys are scalars or per-element arrays."""
    h, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> h, x & mask
    if decrypt:
        for key in reversed(keys):
            left, right = right ^ (_fmix(left ^ key) & mask), left
    else:
        for key in keys:
            left, right = right, left ^ (_fmix(right ^ key) & mask)
    out: np.ndarray = (left << h) | right
    return out


def _cycle_walk(
    x: np.ndarray, n: int, keys: list[np.ndarray], half: int, decrypt: bool = False
) -> np.ndarray:
    """Apply the network until every value lands in ``[0, n)``: a bijection on ``[0, n)``."""
    y = _network(x, keys, half, decrypt)
    out = np.flatnonzero(y >= np.uint64(n))
    while out.size:
        sub = [k[out] if k.ndim else k for k in keys]
        y[out] = _network(y[out], sub, half, decrypt)
        out = out[y[out] >= np.uint64(n)]
    return y


def _half_bits(n: int) -> int:
    """Half the (even) number of bits of the smallest Feistel domain covering ``[0, n)``."""
    return (max(2, (n - 1).bit_length()) + 1) // 2


def _check(positions: np.ndarray, n: int) -> np.ndarray:
    x = np.asarray(positions, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= n):
        raise IndexError(f"positions out of range [0, {n})")
    return x


class FeistelPermutation:
    """A keyed pseudo-random bijection on ``[0, n)`` (Feistel network with cycle-walking).

    The network works on ``2h`` bits with ``2**(2h) < 4n`` (for n >= 4), so on average fewer
    than four encryptions land a value in ``[0, n)``; the walk always terminates because the
    network is a permutation of the larger domain.
    """

    def __init__(self, n: int, key: int, rounds: int = _ROUNDS) -> None:
        if n < 0:
            raise ValueError(f"permutation size must be >= 0, got {n}")
        self.n = n
        self._half = _half_bits(n)
        self._keys = [np.array(derive_key(key, r), dtype=np.uint64) for r in range(rounds)]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = _check(positions, self.n).astype(np.uint64)
        return _cycle_walk(x, self.n, self._keys, self._half).astype(np.int64)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The position at which each value appears."""
        x = _check(values, self.n).astype(np.uint64)
        return _cycle_walk(x, self.n, self._keys, self._half, decrypt=True).astype(np.int64)


class BlockPermutation:
    """A shuffle that keeps reads local: blocks are shuffled, then samples within windows.

    ``[0, n)`` is cut into ``ceil(n / block_size)`` blocks (the last may be short). A Feistel
    permutation orders the blocks; consecutive ``window`` blocks of that order form a window, and
    a second Feistel permutation, keyed per window, shuffles the samples of the window's blocks
    together. Position ``p`` therefore lies in one window, and any ``window * block_size``
    consecutive positions read from at most ``2 * window`` blocks.
    """

    def __init__(self, n: int, key: int, block_size: int, window: int) -> None:
        if block_size < 1 or window < 1:
            raise ValueError(f"block_size and window must be >= 1, got {block_size}, {window}")
        self.n = n
        self._bs = block_size
        self._window = window
        self._nblocks = -(-n // block_size)
        self._tail = n - (self._nblocks - 1) * block_size if n else 0  # size of the last block
        self._order = FeistelPermutation(self._nblocks, derive_key(key, 1))
        # slot (place in the block order) that holds the short last block
        if self._nblocks:
            last = np.array([self._nblocks - 1], dtype=np.int64)
            self._short_slot = int(self._order.inverse(last)[0])
        else:
            self._short_slot = 0
        self._window_keys = [np.uint64(derive_key(key, 2, r)) for r in range(_ROUNDS)]

    def _slot_start(self, slot: np.ndarray) -> np.ndarray:
        """First position of each slot (slots after the short block start earlier)."""
        start = slot * self._bs
        return np.where(slot > self._short_slot, start - (self._bs - self._tail), start)

    def _slot_of(self, pos: np.ndarray) -> np.ndarray:
        """The slot containing each position."""
        bs, s_star = self._bs, self._short_slot
        boundary = s_star * bs + self._tail  # first position after the short slot
        return np.where(pos < boundary, pos // bs, s_star + 1 + (pos - boundary) // bs)

    def _window_bounds(self, win: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = win * self._window
        end_slot = np.minimum(first + self._window, self._nblocks)
        end = np.where(end_slot == self._nblocks, self.n, self._slot_start(end_slot))
        return self._slot_start(first), end

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        pos = _check(positions, self.n)
        win = self._slot_of(pos) // self._window
        w_start, w_end = self._window_bounds(win)
        size = w_end - w_start
        # per-window round keys, vectorised: one Feistel network per window, all at once
        wkey = win.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        q = np.empty_like(pos)
        for m in np.unique(size).tolist():  # at most three window sizes exist
            sel = np.flatnonzero(size == m)
            keys = [_fmix(wkey[sel] ^ base) for base in self._window_keys]
            local = (pos[sel] - w_start[sel]).astype(np.uint64)
            q[sel] = _cycle_walk(local, m, keys, _half_bits(m)).astype(np.int64) + w_start[sel]
        slot = self._slot_of(q)  # shuffled position inside the window -> (slot, offset)
        out: np.ndarray = self._order(slot) * self._bs + (q - self._slot_start(slot))
        return out
