"""The page-locked ring behind the GPU feed, and the walker over nested batch structures.

A :class:`Ring` holds ``n`` slots allocated once. Batch number ``seq`` of an epoch always uses
slot ``seq % n``, so slot reuse follows the batch order and can never deadlock: a filler of batch
``seq`` only waits for batch ``seq - n`` (earlier work) to be submitted and for the copy out of the
slot to complete. A slot is one flat byte buffer per tensor leaf of the batch; a batch leaf is a
typed view of the first ``nbytes`` of its buffer. See :mod:`feedpipe.gpu` for the safety argument.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

__all__: list[str] = []  # private module; feedpipe.gpu is the public face

log = logging.getLogger("feedpipe.gpu")

_Rebuild = Callable[[list[Any]], Any]


# --------------------------------------------------------------------------- structure walker
def flatten(obj: Any) -> tuple[list[torch.Tensor], _Rebuild]:
    """Split ``obj`` into its tensor leaves (depth first, dict order) and a function that rebuilds
    the same structure from replacement leaves. Dicts (any ``Mapping``), lists, tuples and
    namedtuples are walked; every other object is kept as is (by reference). The rebuild function
    holds no reference to the leaves (and no reference cycle), so batches are freed promptly."""
    leaves: list[torch.Tensor] = []
    return leaves, _build(obj, leaves)


def _build(o: Any, leaves: list[torch.Tensor]) -> _Rebuild:
    if isinstance(o, torch.Tensor):
        i = len(leaves)
        leaves.append(o)
        return lambda ls: ls[i]
    if isinstance(o, Mapping):
        items = [(k, _build(v, leaves)) for k, v in o.items()]
        kind = type(o)

        def rebuild_map(ls: list[Any]) -> Any:
            d = {k: f(ls) for k, f in items}
            if kind is dict:
                return d
            try:
                return kind(d)  # type: ignore[call-arg]
            except TypeError:  # a Mapping type that cannot be built from a dict
                return d

        return rebuild_map
    if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple
        parts = [_build(v, leaves) for v in o]
        ntype = type(o)
        return lambda ls: ntype(*(f(ls) for f in parts))
    if isinstance(o, (list, tuple)):
        parts = [_build(v, leaves) for v in o]
        seq_type = type(o) if type(o) in (list, tuple) else list
        return lambda ls: seq_type(f(ls) for f in parts)
    return lambda ls: o


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested dict/list/tuple structure; leave the rest alone."""
    leaves, rebuild = flatten(obj)
    return rebuild([fn(t) for t in leaves])


_MAX_VIEWS = 16  # shapes whose views a slot keeps


def _typed(buffer: torch.Tensor, dtype: torch.dtype, shape: Any) -> torch.Tensor:
    """The first bytes of ``buffer`` as a ``dtype`` tensor of ``shape``."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buffer[:n].view(dtype).view(shape)


_Marks = list[tuple[Any, Any, int]]  # (shape, strides, data pointer) of each view as made


def _out_views(
    buffers: list[torch.Tensor], layout: _Layout, rows: int
) -> tuple[list[Any], _Marks] | None:
    """Views of ``buffers`` shaped for a ``rows``-long batch of ``layout`` and their marks, or
    None where one does not fit."""
    shapes = [(rows, *s[1:]) for s in layout.shapes]
    sizes = [
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
        for s, d in zip(shapes, layout.dtypes, strict=True)
    ]
    if any(n > _nbytes(b) for n, b in zip(sizes, buffers, strict=True)):
        return None
    views = [_typed(b, d, s) for b, d, s in zip(buffers, layout.dtypes, shapes, strict=True)]
    return views, [(v.shape, v.stride(), v.data_ptr()) for v in views]


def _intact(views: list[Any], marks: _Marks) -> bool:
    """Whether no filler changed a view's shape, strides or memory in place (``unsqueeze_``,
    ``resize_``, an ``out=`` that resized it); these reads keep the GIL, unlike a new view."""
    return all(
        v.shape == s and v.stride() == st and v.data_ptr() == p
        for v, (s, st, p) in zip(views, marks, strict=True)
    )


def _query(event: Any) -> bool:
    return bool(event.query())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- ring of slots
class Event(Protocol):
    def query(self) -> bool: ...


@dataclass(frozen=True)
class _Layout:
    """Leaf dtypes/shapes of the first batch; ``rows`` is the common first dimension of every
    leaf (the batch length) or ``None`` when the batch is not batch-major."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    rows: int | None
    rebuild: _Rebuild | None  # None when some leaves bypass the ring (already on a device)


class Slot:
    __slots__ = ("_buffers", "event", "index", "lent", "seq", "views")

    def __init__(self, index: int) -> None:
        self.index = index
        self._buffers: list[torch.Tensor] = []
        # typed views of the buffers, made once per shape: making one is a torch call, and each
        # torch call lets the GIL go (a hand-off, with worker threads busy); dropped on realloc
        self.views: dict[Any, Any] = {}
        self.seq = -1  # last batch submitted out of this slot
        self.event: Event | None = None  # completes when the copy out of the slot is done
        self.lent = False  # views handed to a filler whose batch is not submitted yet

    @property
    def buffers(self) -> list[torch.Tensor]:
        """One flat byte buffer per leaf."""
        return self._buffers

    @buffers.setter
    def buffers(self, buffers: list[torch.Tensor]) -> None:
        self._buffers, self.views = buffers, {}

    def view(self, key: Any, make: Callable[[], Any]) -> Any:
        """The view cached under ``key``, made by ``make()`` the first time (at most
        ``_MAX_VIEWS`` shapes' worth kept, one view per leaf each: ragged batches reshape every
        time)."""
        views = self.views
        v = views.get(key)
        if v is None:
            if len(views) >= _MAX_VIEWS * (len(self._buffers) + 1):
                views.clear()
            v = views[key] = make()
        return v


class RingClosedError(RuntimeError):
    """The ring was closed (iteration ended or abandoned) while a filler waited for a slot."""


class Ring:
    """``n`` reusable host slots (page-locked when ``pin``), indexed by ``seq % n``."""

    def __init__(
        self,
        n: int,
        *,
        pin: bool,
        batch_size: int | None,
        timeout: float,
        query: Callable[[Any], bool] | None = None,
    ) -> None:
        if n < 2:
            raise ValueError(f"a ring needs at least 2 slots, got {n}")
        self.n = n
        self.pin = pin
        self.batch_size = batch_size
        self.timeout = timeout
        self.query = query or _query  # whether a slot's copy event has completed
        self.slots = [Slot(i) for i in range(n)]
        self.layout: _Layout | None = None
        self.next_seq = 0  # the next batch to be submitted
        self.grown = 0  # slot buffers reallocated because a batch was bigger than its slot
        self.gen = 0  # epoch generation: fillers of an earlier epoch are turned away
        # one condition per slot over one lock: a submit wakes only the filler of its slot
        self._lock = threading.Lock()
        self._conds = [threading.Condition(self._lock) for _ in range(n)]
        self._closed = False

    # -- sizes
    @property
    def slot_bytes(self) -> int:
        return max((sum(_nbytes(b) for b in s.buffers) for s in self.slots), default=0)

    @property
    def ring_bytes(self) -> int:
        return sum(_nbytes(b) for s in self.slots for b in s.buffers)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def allocate(self, leaves: list[torch.Tensor], rebuild: _Rebuild | None) -> None:
        """Allocate every slot from the first batch (scaled to ``batch_size`` rows if it is
        batch-major and shorter, e.g. a resumed epoch's tail)."""
        shapes = tuple(tuple(t.shape) for t in leaves)
        firsts = {s[0] for s in shapes if len(s) > 0}
        rows = firsts.pop() if len(firsts) == 1 and all(len(s) > 0 for s in shapes) else None
        scale = 1.0
        if rows and self.batch_size and self.batch_size > rows:
            scale = self.batch_size / rows
        sizes = [int(_nbytes(t) * scale) for t in leaves]
        t0 = time.perf_counter()
        for slot in self.slots:
            slot.buffers = [self._alloc(n) for n in sizes]
        # published last: fillers (thread workers) read the layout without the lock
        self.layout = _Layout(tuple(t.dtype for t in leaves), shapes, rows, rebuild)
        log.info(
            "feedpipe GPU feed: ring of %d %s slots x %.2f MiB = %.1f MiB (%d leaves), %.3f s",
            self.n,
            "pinned" if self.pin else "host",
            sum(sizes) / 2**20,
            self.n * sum(sizes) / 2**20,
            len(sizes),
            time.perf_counter() - t0,
        )

    # -- waiting
    def close(self) -> None:
        """Turn away fillers (waiting ones wake up) until the next :meth:`reset`."""
        with self._lock:
            self._closed = True
            for cond in self._conds:
                cond.notify_all()

    def retire(self) -> int:
        """End the epoch for good: fillers bound to it are turned away from now on, atomically
        with lending. Returns how many slots are still lent (then the ring must not be reused)."""
        self.close()
        with self._lock:
            self.gen += 1
            return self.lent

    @property
    def lent(self) -> int:
        """Slots handed to fillers whose batches never arrived (an abandoned epoch)."""
        return sum(s.lent for s in self.slots)

    def reset(self) -> int:
        """Start a new epoch: wait for every copy out of the slots, then number batches from 0.
        Returns the generation fillers of this epoch pass to :meth:`out_for`."""
        for slot in self.slots:
            self.wait_copied(slot)
            slot.seq, slot.event = -1, None
        with self._lock:
            self.next_seq = 0
            self._closed = False
            return self.gen

    def wait_copied(self, slot: Slot) -> None:
        """Poll until the copy out of ``slot`` has completed (interruptible; times out)."""
        event, query = slot.event, self.query
        if event is None or query(event):
            return
        deadline = time.monotonic() + self.timeout
        pause = 50e-6
        while not query(event):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"feedpipe GPU feed: the copy of batch {slot.seq} out of ring slot "
                    f"{slot.index} did not complete within {self.timeout:.0f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 500e-6)

    def _wait_turn(self, seq: int, gen: int) -> Slot:
        """Block until batch ``seq - n`` (the slot's previous user) is submitted; interruptible."""
        slot = self.slots[seq % self.n]
        cond = self._conds[seq % self.n]
        with cond:
            while self.next_seq <= seq - self.n or self._closed or gen != self.gen:
                if self._closed or gen != self.gen:
                    raise RingClosedError(f"ring closed while batch {seq} waited for a slot")
                cond.wait(0.1)
        return slot

    # -- filling
    def fits(self, slot: Slot, leaves: list[torch.Tensor]) -> bool:
        return len(leaves) == len(slot.buffers) and all(
            _nbytes(t) <= _nbytes(b) for t, b in zip(leaves, slot.buffers, strict=True)
        )

    def out_for(self, seq: int, rows: int, gen: int) -> Any | None:
        """A structure of slot views shaped for a ``rows``-long batch, for a filler (thread worker)
        to gather into; ``None`` when the layout is unknown yet, not batch-major, or too small.
        Raises :class:`RingClosedError` once generation ``gen`` (the filler's epoch) is over."""
        layout = self.layout
        if layout is None or layout.rows is None or layout.rebuild is None:
            return None
        slot = self._wait_turn(seq, gen)
        key = ("out", rows)
        made = slot.view(key, lambda: _out_views(slot.buffers, layout, rows))
        if made is not None and not _intact(*made):  # the slot's last filler reshaped one
            slot.views.pop(key, None)
            made = slot.view(key, lambda: _out_views(slot.buffers, layout, rows))
        if made is None:
            return None
        views = made[0]
        self.wait_copied(slot)
        with self._lock:  # atomic with retire(): either lent and counted, or turned away
            if self._closed or gen != self.gen:
                raise RingClosedError(f"ring closed while batch {seq} waited for a slot")
            slot.lent = True
        return layout.rebuild(views)

    def fill(self, seq: int, leaves: list[torch.Tensor]) -> tuple[Slot, list[torch.Tensor], int]:
        """Return slot ``seq % n`` holding ``leaves`` (as views) and the bytes copied into it.
        Leaves that already are views of the slot (gathered in place) are not copied."""
        if seq != self.next_seq:
            raise RuntimeError(
                f"batches must be submitted in order: got {seq}, expected {self.next_seq}"
            )
        slot = self.slots[seq % self.n]
        slot.lent = False  # batch ``seq`` arrived: its filler is done with the slot
        self.wait_copied(slot)
        if not self.fits(slot, leaves):
            self._grow(slot, leaves)
        views: list[torch.Tensor] = []
        copied = 0
        for i, (t, b) in enumerate(zip(leaves, slot.buffers, strict=True)):
            if t.device.type == "cpu" and t.numel() and t.data_ptr() == b.data_ptr():
                views.append(t)  # gathered straight into the slot
                continue
            v = slot.view((i, t.dtype, t.shape), partial(_typed, b, t.dtype, t.shape))
            v.copy_(t)
            copied += _nbytes(t)
            views.append(v)
        return slot, views, copied

    def _grow(self, slot: Slot, leaves: list[torch.Tensor]) -> None:
        if self.layout is not None and len(leaves) != len(slot.buffers):
            raise ValueError(
                f"feedpipe GPU feed: batch has {len(leaves)} tensors, but the ring was laid out "
                f"for {len(slot.buffers)} from the first batch; every batch must have the same "
                "structure"
            )
        old, before = sum(_nbytes(b) for b in slot.buffers), self.slot_bytes
        slot.buffers = [
            b if _nbytes(t) <= _nbytes(b) else self._alloc(_nbytes(t))
            for t, b in zip(leaves, slot.buffers, strict=True)
        ]
        self.grown += 1
        new = sum(_nbytes(b) for b in slot.buffers)
        # one warning per new maximum; the other slots catch up as they are refilled
        log.log(
            logging.WARNING if new > before else logging.DEBUG,
            "feedpipe GPU feed: batch of %.2f MiB is bigger than ring slot %d; slot reallocated "
            "from %.2f to %.2f MiB (ring now %.1f MiB)",
            sum(_nbytes(t) for t in leaves) / 2**20,
            slot.index,
            old / 2**20,
            new / 2**20,
            self.ring_bytes / 2**20,
        )

    def skip(self) -> None:
        """Batch ``next_seq`` will never be submitted (it failed): let later batches go on."""
        with self._lock:
            self.slots[self.next_seq % self.n].lent = False
            self._conds[self.next_seq % self.n].notify_all()
            self.next_seq += 1

    def submitted(self, slot: Slot, seq: int, event: Event | None) -> None:
        """Record that batch ``seq``'s copy out of ``slot`` was issued; ``event`` marks its end."""
        slot.seq, slot.event = seq, event
        with self._lock:
            self.next_seq = seq + 1
            self._conds[seq % self.n].notify_all()
