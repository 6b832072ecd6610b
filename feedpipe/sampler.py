"""``DistributedSampler``: torch's sampler plus exact/elastic resume, no padding, block shuffles.

An epoch is a permutation of ``[0, n)`` (seeded by ``seed`` and ``epoch``) read as one global
stream; rank ``r`` of ``W`` takes stream positions ``r, r + W, r + 2W, ...``. Because every
rank follows the same arithmetic, the samples consumed by all ranks after ``c`` lockstep steps are
exactly the first ``c * W`` stream positions, so one rank's ``(seed, epoch, consumed)`` is enough
to resume every rank at any world size. See ``docs/samplers.md``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data

from feedpipe._permutation import (
    BlockPermutation,
    FeistelPermutation,
    IdentityPermutation,
    Permutation,
    TorchPermutation,
    derive_key,
)

__all__ = ["DistributedSampler"]

_STATE_VERSION = 1
_CHUNK = 8192  # positions evaluated per step of the permutation
# keys that must match between a saved state and the sampler that loads it
_IDENTITY_KEYS = ("dataset_length", "seed", "permutation", "block_size", "block_window")


@dataclass(frozen=True)
class _Plan:
    """How an epoch (or what remains of it) is dealt to ``world`` ranks.

    The plan covers permutation positions ``[start, n)``; stream position ``j`` holds permutation
    position ``start + j % (n - start)`` (the modulo only matters for padding); rank ``r`` takes
    stream positions ``r + k * world``. ``base`` is the per-rank ``consumed`` count at which the
    plan began (non-zero only after an elastic resume), so ``consumed`` keeps counting the epoch.
    """

    start: int
    world: int
    base: int
    pad: bool
    drop_last: bool
    equal_batches: bool
    batch: int

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Plan:
        """The plan a sampler state was saved under."""
        return cls(
            start=int(state["segment_start"]),
            world=int(state["num_replicas"]),
            base=int(state["consumed_base"]),
            pad=bool(state["pad"]),
            drop_last=bool(state["drop_last"]),
            equal_batches=bool(state["equal_batches"]),
            batch=int(state["batch_size"]),
        )

    def remaining(self, n: int) -> int:
        return n - self.start

    def length(self, n: int) -> int:
        """Stream length: the remaining positions, padded or truncated to the plan's rules."""
        rem, w = self.remaining(n), self.world
        if self.drop_last:
            return (rem // w) * w  # == torch's ceil((n - w) / w) * w when w does not divide n
        if self.pad:
            return -(-rem // w) * w
        q, extra = divmod(rem, w)
        if self.equal_batches and extra and q % self.batch == 0:
            return q * w  # the long ranks would need one more batch: drop their extra sample
        return rem

    def count(self, n: int, rank: int) -> int:
        """How many samples ``rank`` gets from this plan."""
        return max(0, -(-(self.length(n) - rank) // self.world))

    def consumed_positions(self, n: int, local: int) -> int:
        """Stream positions consumed by all ranks once each rank has taken ``local`` samples.

        In lockstep every rank ran ``ceil(local / batch)`` batches, so the first
        ``batches * batch * world`` stream positions (capped at the stream length) are consumed.
        """
        steps = -(-local // self.batch) * self.batch
        return min(steps * self.world, self.length(n))


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """The world size and rank, from the initialised ``torch.distributed`` group where not given."""
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("Requires distributed package to be available")
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
    return num_replicas, rank


def _check_args(
    num_replicas: int,
    rank: int,
    *,
    seed: int,
    shuffle_mode: str,
    permutation: str,
    block: tuple[int, int],
    batch_size: int | None,
) -> None:
    """Raise ``ValueError`` for arguments the sampler refuses (torch's messages first)."""
    if num_replicas < 1:
        raise ValueError(f"Invalid num_replicas {num_replicas}, it should be >= 1")
    if rank >= num_replicas or rank < 0:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    if seed < 0:
        raise ValueError(f"Invalid seed {seed}, it should be >= 0")
    if shuffle_mode not in ("global", "block"):
        raise ValueError(f"shuffle_mode must be 'global' or 'block', got {shuffle_mode!r}")
    if permutation not in ("auto", "torch", "feistel"):
        raise ValueError(f"permutation must be 'auto', 'torch' or 'feistel', got {permutation!r}")
    if shuffle_mode == "block" and permutation == "torch":
        raise ValueError("shuffle_mode='block' is not available with permutation='torch'")
    if block[0] < 1 or block[1] < 1:
        raise ValueError(f"block_size and block_window must be >= 1, got {block[0]}, {block[1]}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def _permutation_kind(shuffle: bool, shuffle_mode: str, permutation: str, pad: bool) -> str:
    """The permutation an epoch uses: ``"none"``, ``"block"``, ``"torch"`` or ``"feistel"``."""
    if not shuffle:
        return "none"
    if shuffle_mode == "block":
        return "block"
    if permutation == "auto":
        return "torch" if pad else "feistel"
    return permutation


class DistributedSampler(torch.utils.data.DistributedSampler[int]):
    """Deals a dataset's indices to the ranks of a job; torch-compatible, resumable and elastic.

    With torch's arguments (and the defaults ``pad=True``, ``shuffle_mode="global"``) it yields
    exactly the indices of :class:`torch.utils.data.DistributedSampler`, and it is an instance of
    it (frameworks that check for a distributed sampler leave it alone).

    Args:
        dataset: anything with ``len()``.
        num_replicas, rank: default to the initialised ``torch.distributed`` process group.
        shuffle, seed, drop_last: as in torch (``seed`` must be >= 0).
        pad: ``True`` (torch) repeats samples so every rank gets the same count; ``False`` gives
            every sample exactly once per epoch and ranks differ by at most one sample.
        equal_batches: with ``pad=False``, make every rank run the same number of batches of
            ``batch_size`` by dropping the single extra sample of the long ranks when (and only
            when) it would cost them one more batch; at most ``num_replicas - 1`` samples per
            epoch, different ones each epoch when shuffling.
        shuffle_mode: ``"global"`` (any sample anywhere) or ``"block"`` (blocks of
            ``block_size`` consecutive indices are shuffled, and samples are mixed within windows
            of ``block_window`` blocks; set ``block_size`` to the samples per shard).
        permutation: ``"auto"`` uses ``torch.randperm`` (materialised, as torch does) for the
            torch-compatible case ``pad=True, shuffle_mode="global"``, and the O(1)-memory
            Feistel bijection otherwise; ``"feistel"`` or ``"torch"`` force one.
        batch_size: the loader's batch size; used by ``equal_batches`` and to read a state saved
            at the end of an epoch unambiguously. ``None`` means 1.
    """

    def __init__(  # noqa: PLR0917 - torch's positional signature
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
        equal_batches: bool = False,
        shuffle_mode: str = "global",
        block_size: int = 4096,
        block_window: int = 4,
        permutation: str = "auto",
        batch_size: int | None = None,
    ) -> None:
        num_replicas, rank = _world(num_replicas, rank)
        _check_args(
            num_replicas,
            rank,
            seed=seed,
            shuffle_mode=shuffle_mode,
            permutation=permutation,
            block=(block_size, block_window),
            batch_size=batch_size,
        )
        self.dataset = dataset  # type: ignore[assignment]  # torch annotates Dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.equal_batches = equal_batches
        self.shuffle_mode = shuffle_mode
        self.block_size = block_size
        self.block_window = block_window
        self.batch_size = batch_size
        self.epoch = 0
        self.permutation = _permutation_kind(shuffle, shuffle_mode, permutation, pad)
        self._plan = self._fresh_plan()
        # torch's attributes: samples per rank, and stream length, in a full epoch
        self.num_samples = self._plan.count(self._n, rank)
        self.total_size = self._plan.length(self._n)
        self._local = 0  # samples this rank has taken from self._plan
        self._pending: tuple[_Plan, int] | None = None  # (plan, local start) after a load
        self._perm_cache: tuple[int, Permutation] | None = None

    # ----------------------------------------------------------------- torch-compatible API
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a state loaded for another epoch is discarded."""
        if epoch != self.epoch:
            self._pending = None
            self._plan = self._fresh_plan()
            self._local = 0
        self.epoch = epoch

    def __len__(self) -> int:
        """Indices the next ``__iter__`` yields on this rank (fewer after a load)."""
        if self._pending is not None:
            plan, local = self._pending
            return plan.count(self._n, self.rank) - local
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self._pending is not None:
            self._plan, self._local = self._pending
            self._pending = None
        else:
            self._plan, self._local = self._fresh_plan(), 0
        return self._generate(self._plan, self._local)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-able state; ``consumed`` counts samples this rank took this epoch."""
        plan, local = self._pending if self._pending is not None else (self._plan, self._local)
        return {
            "version": _STATE_VERSION,
            "dataset_length": self._n,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": plan.base + local,
            "num_replicas": plan.world,
            "rank": self.rank,
            "permutation": self.permutation,
            "block_size": self.block_size if self.permutation == "block" else None,
            "block_window": self.block_window if self.permutation == "block" else None,
            "pad": plan.pad,
            "drop_last": plan.drop_last,
            "equal_batches": plan.equal_batches,
            "batch_size": plan.batch,
            "segment_start": plan.start,
            "consumed_base": plan.base,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the saved epoch after the consumed samples, at this sampler's world size.

        At the saved world size (and options) the continuation is identical to the
        uninterrupted run; at another world size the samples not yet consumed by any rank are
        dealt afresh, each exactly once (``pad=True`` may repeat a few of them, never a consumed
        one). The epoch after the resumed one starts fresh.
        """
        self._check_state(state)
        saved = _Plan.from_state(state)
        n, consumed = self._n, int(state["consumed"])
        local = consumed - saved.base
        if saved.world < 1 or not 0 <= saved.start <= n:
            raise ValueError(f"corrupt sampler state: {state!r}")
        if local < 0 or local > saved.count(n, 0):
            raise ValueError(
                f"sampler state has consumed={consumed}, outside [{saved.base}, "
                f"{saved.base + saved.count(n, 0)}] for its epoch (the loader must count the "
                "samples of the whole epoch, including those before an earlier resume)"
            )
        self.epoch = int(state["epoch"])
        self._pending = self._resume_plan(
            saved, local, consumed, own=state.get("rank") == self.rank
        )

    # ------------------------------------------------------------------ the index stream's view
    def chunks(self) -> Iterator[np.ndarray]:
        """This rank's indices of the pass ``iter()`` started, from its position on, as int64
        arrays (``_CHUNK`` positions at a time); report what is handed out with :meth:`advance`.

        The vectorised path of ``feedpipe.loader.index_stream`` reads the sampler this way."""
        return self._chunks(self._plan, self._local)

    def advance(self, samples: int) -> None:
        """Count ``samples`` more taken from the current pass (the position a state saves)."""
        self._local += samples

    # ---------------------------------------------------------------------------- internals
    @property
    def _n(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _fresh_plan(self) -> _Plan:
        return _Plan(
            start=0,
            world=self.num_replicas,
            base=0,
            pad=self.pad,
            drop_last=self.drop_last,
            equal_batches=self.equal_batches,
            batch=self.batch_size or 1,
        )

    def _check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state with missing keys, another version, or another dataset/seed/shuffle."""
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing keys {missing}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"unsupported sampler state version {state['version']!r}")
        ours = self.state_dict()
        for key in _IDENTITY_KEYS:
            if state.get(key) != ours[key]:
                raise ValueError(
                    f"sampler state does not match this sampler: {key} is {state.get(key)!r} in "
                    f"the state but {ours[key]!r} here (a state only resumes the same dataset "
                    "with the same seed and shuffle)"
                )

    def _resume_plan(self, saved: _Plan, local: int, consumed: int, own: bool) -> tuple[_Plan, int]:
        """``(plan, local start)`` continuing ``saved`` after ``local`` samples of its rank:
        exact at the saved world size and rules (``own``: the state is this rank's), else the
        positions no rank consumed, dealt afresh to this world."""
        n, mine = self._n, self._fresh_plan()
        same_rules = (saved.pad, saved.drop_last, saved.equal_batches, saved.batch) == (
            mine.pad,
            mine.drop_last,
            mine.equal_batches,
            mine.batch,
        )
        if saved.world == self.num_replicas and same_rules:
            count = saved.count(n, self.rank)
            if own:
                return saved, min(local, count)  # our own state: exact
            done = saved.consumed_positions(n, local)
            return saved, min(max(0, -(-(done - self.rank) // saved.world)), count)
        done = min(saved.consumed_positions(n, local), saved.remaining(n))
        plan = _Plan(
            start=saved.start + done,
            world=self.num_replicas,
            base=consumed,
            pad=mine.pad,
            drop_last=mine.drop_last,
            equal_batches=mine.equal_batches,
            batch=mine.batch,
        )
        return plan, 0

    def _permutation(self) -> Permutation:
        if self._perm_cache is not None and self._perm_cache[0] == self.epoch:
            return self._perm_cache[1]
        n = self._n
        perm: Permutation
        if self.permutation == "none":
            perm = IdentityPermutation(n)
        elif self.permutation == "torch":
            perm = TorchPermutation(n, self.seed + self.epoch)
        elif self.permutation == "feistel":
            perm = FeistelPermutation(n, derive_key(self.seed, self.epoch))
        else:
            key = derive_key(self.seed, self.epoch)
            perm = BlockPermutation(n, key, self.block_size, self.block_window)
        self._perm_cache = (self.epoch, perm)
        return perm

    def _generate(self, plan: _Plan, local: int) -> Iterator[int]:
        for chunk in self._chunks(plan, local):
            for index in chunk.tolist():
                self._local += 1
                yield index

    def _chunks(self, plan: _Plan, local: int) -> Iterator[np.ndarray]:
        """This rank's indices from position ``local`` on, ``_CHUNK`` positions at a time (the
        permutation is evaluated per chunk; ``_local`` is the caller's to advance)."""
        n = self._n
        count = plan.count(n, self.rank)
        if local >= count:
            return
        perm = self._permutation()
        remaining = plan.remaining(n)
        for lo in range(local, count, _CHUNK):
            k = np.arange(lo, min(lo + _CHUNK, count), dtype=np.int64)
            yield perm(plan.start + (self.rank + k * plan.world) % remaining)

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(n={self._n}, rank={self.rank}/{self.num_replicas}, "
            f"epoch={self.epoch}, permutation={self.permutation!r}, pad={self.pad})"
        )
