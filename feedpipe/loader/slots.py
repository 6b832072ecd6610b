"""Process workers that collate straight into reused shared-memory slots.

torch's process workers collate each batch into a fresh shared-memory segment, pass its file
descriptor to the main process, which maps it and (for a GPU) copies it once more into
page-locked memory. Here each worker owns ``k`` slots in one shared buffer, allocated on its
first batch and reused. A later batch larger than a slot (a custom ``batch_sampler`` whose first
batch was small) goes torch's way, and the worker replaces its buffer by one with slots at least
twice as large at the first batch for which no slot of the old one is taken (the safe point:
nothing of the old buffer is in flight or viewed, so the main process drops it when the new one
arrives), at most ``MAX_GROWTHS`` times per worker:

1. **Worker** (:func:`collate_into`): with torch's ``default_collate``, the samples are stacked
   straight into a free slot, and the worker ships a small :class:`SlotRef` (slot number and
   layout) instead of tensors. The buffer itself travels (by file descriptor, once) only until
   the main process has marked it seen. No free slot, or a batch that does not fit or that
   ``default_collate`` would treat differently: the worker falls back to torch's path for that
   batch, so nothing ever waits for a slot.
2. **Main** (:meth:`Slots.resolve`): the batch is rebuilt as views of the slot, and the slot
   stays taken for as long as any of those views (or a tensor or array sharing their memory)
   lives, and for as long as their storage lives when ``share_memory_()`` or a queue moved it to
   new memory (:mod:`feedpipe.loader.slot_lease`). With a CUDA device feed the buffer is
   page-locked once (``cudaHostRegister``), so the copy to the device is one DMA from the slot;
   the feed drops its views when that copy is done.
3. **Ownership of a slot byte**: the worker alone sets a slot's flag (free -> taken) before it
   writes; the main process alone clears it, after the last view is gone. A ref dropped without
   being resolved (a pass ended early, torch drained it) clears its flag when it is collected.

4. **Room** (:func:`allocate`): a buffer is sized for the rows a batch can actually have
   (:func:`slot_rows`: ``min(batch_size, samples per pass)``, so a validation loader with
   ``batch_size=512`` over 40 samples lays out 40 rows) and is made only when ``/dev/shm`` keeps
   at least as much free as every worker's buffers of this size take (what is left serves
   torch's own batches). torch creates the segment with ``posix_fallocate``, so a tmpfs that
   fills up between the check and the allocation is a ``RuntimeError`` (ENOSPC) here, never a
   SIGBUS on a later write. A worker whose buffer cannot be made, first or grown, keeps what it
   has (nothing, or its old buffer) and sends what does not fit torch's way: with too little
   shared memory the loader runs exactly as torch's does, for every start method.

The layout of what :func:`collate_into` builds (:mod:`feedpipe.loader.slot_layout`) is
``default_collate``'s for the types it handles (tensors, numeric numpy arrays and scalars,
Python ``int``/``float``/``bool``, ``dict``, ``list``, ``tuple`` and namedtuples); anything
else goes through ``default_collate`` itself.
tests/test_worker_slots.py checks the equality bit for bit.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from feedpipe.device import hostreg
from feedpipe.io.env import env_flag
from feedpipe.io.forks import ForkStamp
from feedpipe.io.reaper import pid_alive
from feedpipe.loader.slot_layout import ALIGN, SlotLayout, UnsupportedLayoutError, align, rebuild
from feedpipe.loader.slot_lease import Lease, leased_tensors

__all__ = [
    "ENV",
    "SHM_DIR",
    "SlotLayout",
    "SlotRef",
    "Slots",
    "allocate",
    "collate_into",
    "enabled",
    "shm_free",
    "slot_rows",
    "worker_slots",
]

_HEADER = 4096  # flags (one byte per slot), then the "seen" byte; slots start page-aligned


def _header(k: int) -> int:
    """Bytes before the first slot: ``k`` flags and the seen byte, in whole pages (a large
    ``prefetch_factor`` makes ``k`` > 4095: the flags must never share bytes with slot 0)."""
    return (k + 1 + _HEADER - 1) // _HEADER * _HEADER


ENV = "FEEDPIPE_WORKER_SLOTS"  # the switch: on unless set to an "off" word


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FEEDPIPE_WORKER_SLOTS`` lets slots on (unset: on). ``0``/``false``/``no``/``off``
    turn them off and ``1``/``true``/``yes``/``on`` on (any case, surrounding spaces ignored);
    any other value is a ``ValueError`` naming the variable and the value."""
    return bool(env_flag(ENV, True, strict=True, meaning=("slots off", "on"), environ=environ))


# ------------------------------------------------------------------------------- the room
SHM_DIR = "/dev/shm"  # where torch's shared segments live (shm_open), for either strategy


def slot_rows(batch_size: int | None, sampler: Any) -> int | None:
    """The most rows one batch can have: ``batch_size``, capped by the samples one pass draws
    (``len(sampler)``, when it has one). ``None``: unknown (a custom ``batch_sampler``); the
    slots are then sized by the first batch and grow when a later one is larger."""
    if batch_size is None:
        return None
    try:
        return max(1, min(batch_size, len(sampler)))
    except (TypeError, NotImplementedError):  # a sampler without __len__
        return batch_size


def shm_free(path: str = SHM_DIR) -> int | None:
    """Bytes an unprivileged process may still allocate under ``path`` (None: no such file
    system, e.g. off Linux)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def allocate(nbytes: int, workers: int) -> torch.Tensor | None:
    """A shared-memory buffer of ``nbytes``, or None when it should not or cannot be made.

    Refused before any allocation when ``/dev/shm`` has less free than ``2 * workers *
    nbytes`` (each of ``workers`` buffers, and as much again left for torch's batches); an
    allocation that fails anyway (ENOSPC from torch's ``posix_fallocate``, ENOMEM) is None too.
    """
    free = shm_free()
    if free is not None and 2 * max(1, workers) * nbytes > free:
        return None
    try:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffer.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
    except (RuntimeError, MemoryError, OSError):
        return None
    return buffer


def _workers() -> int:
    """How many worker processes share this loader's ``/dev/shm`` (1 outside a worker)."""
    info = tud.get_worker_info()
    return 1 if info is None else int(info.num_workers)


# ------------------------------------------------------------------------------- worker side
class SlotRef:
    """What a worker ships instead of a batch: where in its buffer the batch lies.

    ``buffer`` is set (and travels by file descriptor) until the main process has seen the
    buffer once. Dropped in the main process without being resolved, it frees its slot.
    """

    __slots__ = (
        "__weakref__",
        "born",
        "buffer",
        "k",
        "layout",
        "received",
        "slot",
        "spec",
        "token",
    )

    @property
    def nbytes(self) -> int:
        """The batch's bytes (what the stall counters count)."""
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.layout)

    def __init__(
        self, token: str, k: int, slot: int, spec: Any, layout: list[Any], *, buffer: Any
    ) -> None:
        self.token, self.k, self.slot, self.spec, self.layout = token, k, slot, spec, layout
        self.buffer = buffer
        self.received = False

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.token, self.k, self.slot, self.spec, self.layout, self.buffer)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.token, self.k, self.slot, self.spec, self.layout, self.buffer = state
        self.received = True  # only the receiving (main) process may free the slot
        self.born = ForkStamp()  # and not a child forked since (it has a copy of this ref)

    def __del__(self) -> None:
        born = getattr(self, "born", None)
        if getattr(self, "received", False) and (born is None or born.here()):
            _unclaimed(self)


class _WorkerSlots:
    """One worker's ``k`` slots in one shared buffer: flags, a seen byte, then the slots.

    ``grown`` counts the buffers this worker had before this one; ``wanted`` is the largest
    batch (bytes) that did not fit, so far. Made by :meth:`create`, which may refuse."""

    def __init__(self, k: int, slot_bytes: int, buffer: torch.Tensor, grown: int = 0) -> None:
        self.k, self.slot_bytes, self.grown = k, slot_bytes, grown
        self.wanted = 0
        self.header = _header(k)
        self.buffer = buffer
        self.array = self.buffer.numpy()
        self.array[: self.header] = 0  # every slot free, buffer not yet seen
        self.flags = self.array[:k]
        self.token = f"{os.getpid()}-{os.urandom(6).hex()}"

    @classmethod
    def create(cls, k: int, slot_bytes: int, grown: int = 0) -> _WorkerSlots | None:
        """``k`` slots of ``slot_bytes``, or None when :func:`allocate` refuses the buffer."""
        buffer = allocate(_header(k) + k * slot_bytes, _workers())
        return None if buffer is None else cls(k, slot_bytes, buffer, grown)

    def claim(self) -> int | None:
        free = np.flatnonzero(self.flags == 0)
        if not free.size:
            return None
        slot = int(free[0])
        self.flags[slot] = 1
        return slot

    @property
    def seen(self) -> bool:
        return bool(self.array[self.k])

    def idle(self) -> bool:
        """No slot is taken: the main process holds no view of this buffer and no ref to it is
        in flight (a worker sets a flag before it ships a ref; only the main process clears
        it). The safe point to replace the buffer."""
        return not self.flags.any()

    def grow(self, need: int) -> _WorkerSlots:
        """This worker's slots for a batch of ``need`` bytes that did not fit: a new buffer of
        at least twice the slot size once this one is idle and fewer than ``MAX_GROWTHS``
        buffers were replaced, else this one (the batch then goes torch's way). A larger
        buffer that cannot be made ends the growing: this one stays."""
        self.wanted = max(self.wanted, need)
        if self.wanted <= self.slot_bytes or self.grown >= MAX_GROWTHS or not self.idle():
            return self
        size = align(max(self.wanted, 2 * self.slot_bytes))
        bigger = _WorkerSlots.create(self.k, size, self.grown + 1)
        if bigger is None:
            self.grown = MAX_GROWTHS
            return self
        return bigger


_WORKER: dict[str, Any] = {}  # this worker process's slots (one set per process)
MAX_GROWTHS = 8  # buffers a worker may replace by larger ones (each at least twice the size)


def worker_slots() -> Any:
    """This worker process's slots, or None before its first batch (for tests)."""
    return _WORKER.get("slots")


def collate_into(samples: Any, k: int, rows: int | None) -> SlotRef | None:
    """``default_collate(samples)`` written into a free slot of this worker, or ``None``.

    ``k``: slots per worker; ``rows``: the most rows a batch can have (:func:`slot_rows`; the
    first batch sizes the slots for that many). ``None`` means: collate the usual way
    (unsupported types, no free slot, a batch bigger than a slot: the slots then grow, see
    :meth:`_WorkerSlots.grow`; no room for a buffer: this worker goes torch's way for good).
    """
    if not isinstance(samples, list) or not samples:
        return None
    try:
        layout = SlotLayout(samples)
    except UnsupportedLayoutError:
        return None
    if not layout.leaves:  # empty containers only ([], {}, ()): nothing to hold
        return None
    n = len(samples)
    sizes = layout.sizes(n)
    first = align(int(sum(sizes) * (max(n, rows or n) / n)) + ALIGN * len(sizes))
    ws = _slots_for(k, sum(sizes), first)
    slot = ws.claim() if ws is not None else None
    if ws is None or slot is None:
        return None
    try:
        placed = layout.write(ws.buffer, ws.header + slot * ws.slot_bytes, n)
    except Exception:  # e.g. an int beyond int64: default_collate raises torch's own error
        ws.flags[slot] = 0
        return None
    return SlotRef(ws.token, ws.k, slot, layout.spec, placed, buffer=None if ws.seen else ws.buffer)


def _slots_for(k: int, need: int, first: int) -> _WorkerSlots | None:
    """This worker's slots if a batch of ``need`` bytes fits one: made with slots of ``first``
    bytes on the first batch (never again once refused), grown at the next safe point once a
    batch did not fit."""
    ws: _WorkerSlots | None = _WORKER.get("slots")
    if ws is None:
        if _WORKER.get("refused"):
            return None
        ws = _WorkerSlots.create(k, first)
        if ws is None:
            _WORKER["refused"] = True
            return None
        _WORKER["slots"] = ws
    if need > ws.slot_bytes or ws.wanted > ws.slot_bytes:  # grow at the next safe point
        ws = _WORKER["slots"] = ws.grow(need)
        if need > ws.slot_bytes:
            return None
    return ws


# --------------------------------------------------------------------------------- main side
class _Buffer:
    """A worker's buffer as the main process holds it (page-locked once when asked)."""

    def __init__(self, buffer: torch.Tensor, k: int, pin: bool) -> None:
        self.tensor = buffer
        self.array = buffer.numpy()
        self.flags = self.array[:k]
        self.registered = False
        if pin and torch.cuda.is_available():
            try:  # unregistered (no sync: no view, so no copy, is left) when this is collected
                reg = hostreg.register(buffer.data_ptr(), buffer.numel(), 0, _WHAT, buffer)
            except hostreg.HostRegisterError:  # copies are then staged by CUDA: slower, correct
                pass
            else:
                hostreg.release_when_collected(self, reg, sync=False)
                self.registered = True
        self.array[k] = 1  # seen: the worker stops sending the buffer


_WHAT = "a worker slot buffer"


_LOCK = threading.Lock()


class Slots:
    """The main process's view of every worker's slots, for one DataLoader."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[str, _Buffer] = {}
        self.resolved = 0  # batches delivered from slots (``DataLoader.worker_slots``)
        self.fallback = 0  # batches that went torch's way

    def resolve(self, ref: SlotRef) -> tuple[Any, bool]:
        """The batch as views of its slot, and whether they are page-locked."""
        with _LOCK:
            buf = self.buffers.get(ref.token)
            if buf is None:
                if ref.buffer is None:
                    raise RuntimeError(
                        f"feedpipe: worker slot buffer {ref.token} was never received"
                    )
                # a worker replaces its buffer only when no slot of it is taken: none of its
                # refs is in flight and no view of it lives, so the older one can go
                pid = ref.token.split("-", 1)[0]
                for old in [t for t in self.buffers if t.split("-", 1)[0] == pid]:
                    _REGISTRY.pop(old, None)
                    del self.buffers[old]
                buf = self.buffers[ref.token] = _Buffer(ref.buffer, ref.k, self.pin)
            _REGISTRY[ref.token] = buf
        tensors = leased_tensors(buf.array, ref.layout, Lease(buf, buf.flags, ref.slot))
        ref.received = False  # the lease frees the slot now
        self.resolved += 1
        return rebuild(ref.spec, tensors), buf.registered

    def forget(self) -> None:
        """A new pass: drop the buffers of workers that are gone (live views keep theirs
        mapped). A worker still running (an older iterator of this loader, still in use)
        keeps its buffer: its later refs no longer carry it."""
        with _LOCK:
            for token in [t for t in self.buffers if not _alive(t)]:
                _REGISTRY.pop(token, None)
                del self.buffers[token]


def _alive(token: str) -> bool:
    """Whether the worker process that made ``token`` (``"<pid>-<random>"``) still runs."""
    return pid_alive(int(token.split("-", 1)[0]), same_user=True)


_REGISTRY: dict[str, _Buffer] = {}  # token -> buffer, for refs dropped unresolved


def _unclaimed(ref: SlotRef) -> None:
    """Free the slot of a ref that was received but never resolved."""
    try:
        buf = _REGISTRY.get(ref.token)
        if buf is not None:
            buf.flags[ref.slot] = 0
        elif ref.buffer is not None:
            ref.buffer.numpy()[ref.slot] = 0
    except Exception:  # interpreter shutdown
        pass
