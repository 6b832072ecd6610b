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
    return x ^ (x >> np.uint64(33))


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
        bits = max(2, (n - 1).bit_length()) if n > 1 else 2
        self._half = (bits + 1) // 2
        self._mask = np.uint64((1 << self._half) - 1)
        self._keys = [np.uint64(derive_key(key, r)) for r in range(rounds)]

    def _f(self, r: int, x: np.ndarray) -> np.ndarray:
        return _fmix(x ^ self._keys[r]) & self._mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        left, right = x >> h, x & self._mask
        for r in range(len(self._keys)):
            left, right = right, left ^ self._f(r, right)
        return (left << h) | right

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        left, right = x >> h, x & self._mask
        for r in reversed(range(len(self._keys))):
            left, right = right ^ self._f(r, left), left
        return (left << h) | right

    def _walk(self, positions: np.ndarray, step: object) -> np.ndarray:
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions out of range [0, {self.n})")
        y = step(x.astype(np.uint64))  # type: ignore[operator]
        n = np.uint64(self.n)
        out = y >= n
        while out.any():
            y[out] = step(y[out])  # type: ignore[operator]
            out = y >= n
        return y.astype(np.int64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self._walk(positions, self._encrypt)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The position at which each value appears."""
        return self._walk(values, self._decrypt)


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
        self._key = key
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

    def _slot_start(self, slot: np.ndarray) -> np.ndarray:
        """First position of each slot (slots after the short block start earlier)."""
        start = slot * self._bs
        return np.where(slot > self._short_slot, start - (self._bs - self._tail), start)

    def _slot_of(self, pos: np.ndarray) -> np.ndarray:
        """The slot containing each position."""
        bs, s_star = self._bs, self._short_slot
        boundary = s_star * bs + self._tail  # first position after the short slot
        return np.where(pos < boundary, pos // bs, s_star + 1 + (pos - boundary) // bs)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions out of range [0, {self.n})")
        win = self._slot_of(pos) // self._window
        out = np.empty_like(pos)
        for w in np.unique(win).tolist():
            sel = win == w
            first = w * self._window
            end_slot = min(first + self._window, self._nblocks)
            w_start = int(self._slot_start(np.array([first]))[0])
            w_end = (
                self.n
                if end_slot == self._nblocks
                else int(self._slot_start(np.array([end_slot]))[0])
            )
            inner = FeistelPermutation(w_end - w_start, derive_key(self._key, 2, w))
            q = inner(pos[sel] - w_start) + w_start  # shuffled position inside the window
            slot = self._slot_of(q)
            offset = q - self._slot_start(slot)
            out[sel] = self._order(slot) * self._bs + offset
        return out
