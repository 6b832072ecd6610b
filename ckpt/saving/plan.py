"""The blocking phase of a save: copy every array leaf into the staging buffer, planned once.

A state of thousands of small tensors would cost several Python-level tensor operations per
tensor and per save. ``Stager.plan`` therefore turns the leaves into a ``Plan`` once and reuses
it for every later save whose leaves have the same *signature*: per leaf its kind, dtype,
device, byte count, shape and strides (``signature``, one C-level attribute fetch per leaf,
compared as one list). The plan is a pure function of the signature:

- the layout (``layout``): CUDA leaves first, grouped by device, then the host leaves, each at
  a 64-byte aligned offset; the manifest entries come from it;
- per CUDA device, *runs*: consecutive leaves of at most ``SMALL_BYTES`` (contiguous or not),
  at most ``RUN_BYTES`` per run. A run owns a device storage and, built once, one view of it
  per leaf (the leaf's dtype and shape, its strides where it is contiguous), grouped by dtype.
  A save grows the storage (``UntypedStorage.resize_``: the views follow it), gathers each
  group with one batched copy (``foreach_copy``; device to device, far faster than the link
  to the host), moves the run to the host in one copy and shrinks the storage back to nothing, so
  no device memory is held between saves;
- larger CUDA leaves are copied directly, each in one copy;
- host tensors are copied by one batched copy (``foreach_copy``) into views of the buffer, made once
  per staging buffer (and dropped with it); numpy arrays are copied one by one.

Soundness: a plan holds no reference to the caller's tensors. Each save reads every source
afresh from its leaf, so a tensor replaced, re-created or resized between saves is copied from
where it is now; what the plan fixes (where its bytes go, as what dtype, shape and strides, by
which kind of copy) depends only on the signature, and a different signature makes a new plan.

A buffer that the first save allocates is made while the save copies into it
(``ckpt.saving.pool.Pinning``): each copy waits for the piece of the buffer it writes and stays
inside it, and the host copies wait for the whole buffer.

Ordering: per device, all copies run on one side stream that first waits for the current
stream (so they see every write the training loop queued); the save then waits for that stream
only, not for the whole device (or, with ``stage(sync=False)``, not at all: it returns an event
per device, ``ckpt.saving.overlap``). ``Plan.stage`` returns once every byte is in the buffer (also
when it raises, so a buffer is never released with copies into it in flight). The bytes in the
buffer are the leaves' bytes exactly (dtype-agnostic), padding zeroed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from operator import attrgetter, itemgetter
from typing import Any

import torch

from ckpt import _layout
from ckpt._torch_compat import foreach_copy
from ckpt.format.entries import entry, pack
from ckpt.saving.flatten import Leaf
from ckpt.saving.pool import Buffer

__all__ = [
    "BATCHED_DTYPES",
    "BIT_EXACT",
    "RUN_BYTES",
    "SMALL_BYTES",
    "Plan",
    "SavePlan",
    "Stager",
    "foreach_copy_exact",
    "layout",
    "leaf_order",
    "pack",
    "signature",
]

SMALL_BYTES = 4 << 20
"""CUDA leaves up to this size are gathered into runs (larger ones copy directly)."""
RUN_BYTES = 64 << 20
"""The largest run: the device memory a gathered copy borrows from the caching allocator."""

_SIGNATURE = attrgetter("kind", "dtype", "device", "nbytes", "shape", "stride")
_VALUE = attrgetter("value")

_streams: dict[torch.device, torch.cuda.Stream] = {}

BATCHED_DTYPES = frozenset(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
     torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
     torch.int64)
)  # fmt: skip
"""The dtypes gathered by one ``foreach_copy`` (its device kernel's dtypes); leaves of other
dtypes (float8, float4, complex32, wide unsigned) are copied one by one within their run."""


BIT_EXACT = {torch.float16: torch.int16, torch.bfloat16: torch.int16}
"""Dtypes that ``foreach_copy``'s device kernel computes in float32 and converts back, which
turns every NaN into one canonical NaN (its payload and sign lost): batched copies move them
as same-sized integers, so the bytes arrive exactly."""


def foreach_copy_exact(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``foreach_copy(dsts, srcs)`` bit for bit (pairs of one dtype, any strides)."""
    if any(d.dtype in BIT_EXACT for d in dsts):
        dsts = [d.view(BIT_EXACT.get(d.dtype, d.dtype)) for d in dsts]
        srcs = [s.view(BIT_EXACT.get(s.dtype, s.dtype)) for s in srcs]
    foreach_copy(dsts, srcs)


def signature(leaves: Sequence[Leaf]) -> list[tuple[Any, ...]]:
    """What a plan depends on, per leaf: kind, dtype, device, bytes, shape, strides."""
    return list(map(_SIGNATURE, leaves))


def leaf_order(leaves: Sequence[Leaf]) -> list[int]:
    """The order of the leaves in the file: CUDA leaves first, grouped by device in order of
    appearance, then the others, in leaf order within each group."""
    rank: dict[str, int] = {}
    for leaf in leaves:
        if leaf.device.startswith("cuda") and leaf.device not in rank:
            rank[leaf.device] = len(rank)
    last = len(rank)
    return sorted(range(len(leaves)), key=lambda i: rank.get(leaves[i].device, last))


def layout(
    leaves: Sequence[Leaf], file: str = _layout.DATA_FILE
) -> tuple[list[dict[str, Any]], int]:
    """The manifest entries (in leaf order) and the file size, in ``leaf_order``."""
    order = leaf_order(leaves)
    offsets, nbytes = pack(leaves[i].nbytes for i in order)
    entries: list[dict[str, Any]] = [{}] * len(leaves)
    for i, offset in zip(order, offsets, strict=True):
        entries[i] = entry(leaves[i], offset, file)
    return entries, nbytes


def _gaps(entries: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """The padding between ``entries`` (sorted by offset), as ``(start, end)`` byte ranges."""
    gaps, end = [], 0
    for e in entries:
        if e["offset"] > end:
            gaps.append((end, e["offset"]))
        end = max(end, e["offset"] + e["nbytes"])
    return gaps


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def _flat(src: torch.Tensor) -> torch.Tensor:
    """The bytes of ``src`` as a flat uint8 tensor (a view if contiguous, else a copy made on
    the current stream). ``as_strided`` also covers contiguous tensors whose size-1 dims have
    other strides, which ``view(-1)`` keeps."""
    if not src.is_contiguous():
        src = src.contiguous()
    return torch.as_strided(src, (src.numel(),), (1,)).view(torch.uint8)


def _to_host(buf: Buffer, off: int, flat: torch.Tensor) -> None:
    """Copy device bytes ``flat`` to ``buf`` at ``off`` (asynchronous): once the bytes may be
    written (``Buffer.wait``), one copy per piece of a buffer registered in pieces."""
    end, piece = off + flat.numel(), buf.pieces
    if piece is None:
        buf.tensor[off:end].copy_(flat, non_blocking=True)
        return
    pos = off
    while pos < end:
        stop = min(end, (pos // piece + 1) * piece)
        buf.wait(pos, stop)
        buf.tensor[pos:stop].copy_(flat[pos - off : stop - off], non_blocking=True)
        pos = stop


def _picker(indices: list[int]) -> Callable[[Sequence[Any]], Any]:
    """``values -> [values[i] for i in indices]``, in C."""
    if len(indices) == 1:
        i = indices[0]
        return lambda values: (values[i],)
    return itemgetter(*indices)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return strides[::-1]


def _typed_views(
    flat: torch.Tensor, places: Sequence[tuple[dict[str, Any], Any]]
) -> list[torch.Tensor]:
    """Per ``(entry, tensor)``: a contiguous view of ``flat`` (uint8) at the entry's offset with
    the tensor's dtype and shape. One ``as_strided`` of a whole-buffer view per dtype (made
    once): a third of the cost of slicing and viewing each leaf (a first save of thousands of
    small host tensors makes all of them)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    strides: dict[Any, list[int]] = {}
    views = []
    for e, src in places:
        dtype, size = src.dtype, src.element_size()
        whole = typed.get(dtype)
        if whole is None:  # entries are 64-byte aligned: every offset is a multiple of size
            whole = typed[dtype] = flat[: flat.numel() // size * size].view(dtype)
        shape = src.shape
        stride = strides.get(shape)
        if stride is None:
            stride = strides[shape] = _contiguous_strides(shape)
        views.append(whole.as_strided(shape, stride, e["offset"] // size))
    return views


_Group = tuple[Callable[[Sequence[Any]], Any], list[torch.Tensor], bool, "torch.dtype | None"]


class _Run:
    """Consecutive small leaves of one device, gathered into one storage and copied at once."""

    def __init__(self, device: torch.device, start: int) -> None:
        self.device, self.start, self.end = device, start, start
        self.members: list[tuple[int, int]] = []  # (leaf index, offset)
        # (pick, views, batched, bits): ``bits`` reinterprets the sources (see ``BIT_EXACT``)
        self.groups: list[_Group] = []
        self.storage: Any = None
        self.bounce: torch.Tensor | None = None

    def takes(self, device: torch.device, offset: int, nbytes: int) -> bool:
        """Whether the next leaf (gathered, at ``offset``) may join this run."""
        return (
            nbytes <= SMALL_BYTES
            and device == self.device
            and offset + nbytes - self.start <= RUN_BYTES
        )

    def add(self, index: int, offset: int, nbytes: int) -> None:
        self.members.append((index, offset))
        self.end = offset + nbytes

    def build(self, values: Sequence[Any]) -> None:
        """Make the storage (empty between saves) and one view of it per member."""
        span = self.end - self.start
        try:
            base = torch.empty(span, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:  # no room now: this run copies each leaf directly
            return
        self.storage = base.untyped_storage()
        self.bounce = base
        grouped: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        for index, offset in self.members:
            src = values[index]
            assert isinstance(src, torch.Tensor)
            stride = src.stride() if src.is_contiguous() else _contiguous_strides(src.shape)
            view = torch.empty(0, dtype=BIT_EXACT.get(src.dtype, src.dtype), device=self.device)
            view.set_(self.storage, (offset - self.start) // src.element_size(), src.shape, stride)
            indices, views = grouped.setdefault(src.dtype, ([], []))
            indices.append(index)
            views.append(view)
        self.groups = [
            (_picker(indices), views, dtype in BATCHED_DTYPES, BIT_EXACT.get(dtype))
            for dtype, (indices, views) in grouped.items()
        ]
        self.storage.resize_(0)

    def issue(self, values: Sequence[Any], buf: Buffer) -> None:
        """Gather the run on the current stream and copy it to ``buf`` in one transfer."""
        try:
            if self.storage is None or self.bounce is None:
                raise torch.cuda.OutOfMemoryError("no storage")
            self.storage.resize_(self.end - self.start)
        except (torch.cuda.OutOfMemoryError, RuntimeError):  # no room: copy each leaf directly
            for index, offset in self.members:
                _to_host(buf, offset, _flat(values[index]))
            return
        try:
            self.bounce.zero_()  # the padding: never stale device memory in the file
            for pick, views, batched, bits in self.groups:
                srcs = pick(values)
                if bits is not None:
                    srcs = [src.view(bits) for src in srcs]
                if batched:
                    foreach_copy(views, srcs)
                else:
                    for view, src in zip(views, srcs, strict=True):
                        view.copy_(src)
            _to_host(buf, self.start, self.bounce)
        finally:
            # freed to the caching allocator on this stream: reused only in stream order
            self.storage.resize_(0)


class SavePlan:
    """How to stage leaves of one signature (see the module docstring): the one owner of a
    save's leaf order, layout (manifest entries, size) and copies (runs by device and dtype)."""

    def __init__(self, leaves: Sequence[Leaf], gather_host: bool = False) -> None:
        """``gather_host``: gather host tensors in runs too (the CUDA path's logic, on the CPU;
        for tests)."""
        self.key = signature(leaves)
        self.entries, self.nbytes = layout(leaves)
        self.gather_host = gather_host
        self.built = False  # the copies are planned by the first ``stage`` (see ``_build``)
        self.device_steps: list[tuple[torch.device, _Run | int]] = []  # in file order
        self.host: list[int] = []
        self.arrays: list[int] = []
        self.gaps: list[tuple[int, int]] = []  # padding between entries, zeroed once per buffer
        self._pick_host: Callable[[Sequence[Any]], Any] | None = None
        self._host_views: weakref.WeakKeyDictionary[Buffer, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def _build(self, values: Sequence[Any]) -> None:
        """Plan the copies: runs, direct copies, host copies. Done by the first ``stage``, after
        the save asked for its buffer, so that it overlaps a buffer made in the background."""
        self.device_steps, self.arrays, host = [], [], []
        run: _Run | None = None
        order = sorted(range(len(values)), key=lambda i: self.entries[i]["offset"])
        self.gaps = _gaps([self.entries[i] for i in order])
        for i in order:
            off, n, src = self.entries[i]["offset"], self.entries[i]["nbytes"], values[i]
            if n == 0:
                continue
            if not isinstance(src, torch.Tensor):
                self.arrays.append(i)
                continue
            gathered = src.is_cuda or self.gather_host
            if run is not None and not (gathered and run.takes(src.device, off, n)):
                run.build(values)  # a run holds only consecutive leaves: anything else ends it
                run = None
            if not gathered:
                host.append(i)
            elif n > SMALL_BYTES:
                self.device_steps.append((src.device, i))
            else:
                if run is None:
                    run = _Run(src.device, off)
                    self.device_steps.append((src.device, run))
                run.add(i, off, n)
        if run is not None:
            run.build(values)
        self.host = host
        self._pick_host = _picker(host) if host else None
        self.built = True

    def matches(self, leaves: Sequence[Leaf]) -> bool:
        """Whether this plan stages ``leaves`` (their signature is this plan's)."""
        return signature(leaves) == self.key

    def _views(self, buf: Buffer, values: Sequence[Any]) -> list[torch.Tensor]:
        """The host leaves' destinations in ``buf`` (made on its first use, dropped with it).
        Also zeroes the padding when another plan staged into ``buf`` since this one last did
        (``Buffer.zeroed_for``; two saves at once hold two plans): no save of this plan writes
        there, so it stays zero until then."""
        zeroed = buf.zeroed_for
        if zeroed is None or zeroed() is not self:
            for a, b in self.gaps:
                buf.array[a:b] = 0
            buf.zeroed_for = weakref.ref(self)
        views = self._host_views.get(buf)
        if views is None:
            places = [(self.entries[i], values[i]) for i in self.host]
            views = _typed_views(buf.tensor, places)
            self._host_views[buf] = views
        return views

    def stage(
        self, leaves: Sequence[Leaf], buf: Buffer, sync: bool = True
    ) -> dict[torch.device, Any]:
        """Copy every leaf (of this plan's signature) into ``buf``; returns once every byte is
        there. ``sync=False`` (``ckpt.saving.overlap``): returns once the host copies are done
        and the device copies are queued, with a ``torch.cuda.Event`` per device recorded after
        them (device -> event; the bytes are in ``buf`` once each has completed); on an error
        it still waits for every copy."""
        return self.stage_values(list(map(_VALUE, leaves)), buf, sync)

    def stage_values(
        self, values: Sequence[Any], buf: Buffer, sync: bool = True
    ) -> dict[torch.device, Any]:
        """``stage`` of the leaves' values alone (in leaf order; what a flatten cache hit
        gives without making the ``Leaf`` records)."""
        with self._lock:  # the runs' storages are the plan's: one save at a time
            if not self.built:
                self._build(values)
            return self._stage(values, buf, sync)

    def _stage(self, values: Sequence[Any], buf: Buffer, sync: bool) -> dict[torch.device, Any]:
        streams: dict[torch.device, Any] = {}
        done = False
        try:
            with torch.no_grad():
                for device, step in self.device_steps:
                    stream = streams.get(device)
                    if stream is None and device.type == "cuda":
                        stream = streams[device] = _side_stream(device)
                        stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream) if stream is not None else nullcontext():
                        if isinstance(step, _Run):
                            step.issue(values, buf)
                        else:
                            _to_host(buf, self.entries[step]["offset"], _flat(values[step]))
                buf.wait_all()  # host writes below: the whole buffer must be faulted in
                views = self._views(buf, values)
                if self._pick_host is not None:  # host copies overlap the device's
                    # host tensors: the CPU kernel copies each pair as is (exact for every dtype)
                    foreach_copy(views, self._pick_host(values))
                for i in self.arrays:
                    e, src = self.entries[i], values[i]
                    off, n = e["offset"], e["nbytes"]
                    buf.array[off : off + n].view(src.dtype).reshape(src.shape)[...] = src
            done = True
        finally:
            if sync or not done:
                for stream in streams.values():
                    stream.synchronize()
        return {} if sync else {d: s.record_event() for d, s in streams.items()}


class Stager:
    """Keeps the plan of the last save; ``plan(leaves)`` reuses it when the signature matches."""

    def __init__(self, gather_host: bool = False) -> None:
        self.gather_host = gather_host  # see ``Plan``
        self._plan: SavePlan | None = None
        self._token: Any = None  # the token of the leaves the plan was last checked against
        self.planned = 0
        self.reused = 0

    def current(self, token: Any) -> SavePlan | None:
        """The last plan if ``token`` (not ``None``) is the one it was last checked against
        (``plan``), without the leaves; else ``None``."""
        plan = self._plan
        if plan is None or token is None or token != self._token:
            return None
        self.reused += 1
        return plan

    def plan(self, leaves: Sequence[Leaf], token: Any = None) -> SavePlan:
        """The plan for ``leaves``: the last one if their signature matches, else a new one.
        ``token`` (not ``None``): leaves passed with an equal token have one signature (a
        ``FlattenCache`` generation), so the plan checked against it once is not checked again."""
        plan = self._plan
        if plan is not None and token is not None and token == self._token:
            self.reused += 1
            return plan
        self._token = None
        if plan is None or not plan.matches(leaves):
            self._plan = None  # drop the old plan (and its device storages' views) first
            plan = self._plan = SavePlan(leaves, self.gather_host)
            self.planned += 1
        else:
            self.reused += 1
        self._token = token
        return plan


Plan = SavePlan
"""The earlier name of ``SavePlan``."""
