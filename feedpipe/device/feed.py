"""GPU feed: batches land on the device before the training step asks for them.

``GPUFeed`` sits at the end of the loader. Batch ``s`` of an epoch goes through ring slot
``s % n`` (``n`` page-locked host slots, allocated once from the first batch and reused), is
copied to the device with ``non_blocking=True`` on a dedicated copy stream, and is handed to the
consumer ``prefetch`` batches later. (The loader's direct path for big fixed-size memmap records
skips the ring and DMAs them from the page cache on the copy stream: :mod:`feedpipe.device.direct`.)
Thread workers gather straight into their slot
(:meth:`GPUFeed.out_for`); anything else (process workers' shared-memory batches) is copied into
the slot first, timed as the ``"pin"`` stage. The copy is timed with CUDA events as ``"h2d"``
(harvested when they have completed, never by syncing the hot path).

Why this is safe (``C`` is the copy stream, ``E_s`` the event recorded on ``C`` after batch
``s``'s copies, ``U`` the consumer's current stream when ``next()`` returns batch ``s``):

1. Host writes before the copy: slot ``s % n`` is filled on the host (by the worker's gather, which
   returned, or by the synchronous pin copy) before the copies of batch ``s`` are enqueued on ``C``.
2. Slot reuse after the copy: the slot is written again only for batch ``s + n``, and only once
   ``E_s.query()`` reports that the copy out of it has completed (:meth:`Ring.wait_copied`, used by
   both the worker path and the pin path). So no DMA read of a slot overlaps a host write to it.
3. Consumer after the copy: before batch ``s`` is returned, ``U.wait_event(E_s)``; every kernel the
   consumer enqueues on ``U`` afterwards runs after the copy has finished.
4. Device memory lifetime: the device tensors are allocated on ``C`` and ``record_stream(U)`` is
   called on each, so the caching allocator does not give their memory to a later copy on ``C``
   until the consumer's work enqueued on ``U`` before they were freed has completed.

5. Epochs: a filler is bound to its epoch's generation and is turned away (gets ``None``) once
   that epoch ends, atomically with lending; a ring whose slots are still lent to an abandoned
   epoch's workers is never reused (a fresh one replaces it), so a late gather cannot land in a
   slot that a new epoch is using.

If the consumer moves a batch to another stream, it orders that stream itself (as with torch).

Memory is bounded: ``n = prefetch + 2 + fillers`` slots (``fillers`` = how many batches thread
workers may gather at once), each the size of the first batch (scaled to ``batch_size`` rows when
it is batch-major and shorter). The slot count never grows; a batch bigger than its slot
reallocates that slot once, with a logged warning per new maximum. ``info`` reports the budget.

A feed made for the CPU (``device="cpu"``, or no usable CUDA device) runs the same code with
unpinned slots and a host copy out of the slot (so consumers never see a reused buffer), after
exactly one :class:`GPUFeedWarning`. A ``DataLoader`` makes none there (:func:`stays_on_host`):
its batches are what they are without ``device``, at the same speed; ``FEEDPIPE_HOST_RING=1``
(:func:`host_ring`) makes it run the ring in host memory, to test the device path's host side
on a machine without a GPU.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from feedpipe.device.callsite import user_stacklevel
from feedpipe.device.copy_times import CopyTimes
from feedpipe.device.cudacalls import cuda_calls
from feedpipe.device.event_pool import EventPool
from feedpipe.device.ring import Event, Ring, RingClosedError, Slot, flatten, log, map_tensors
from feedpipe.io import trace
from feedpipe.io.env import env_flag

__all__ = [
    "GPUFeed",
    "GPUFeedWarning",
    "PinnedBatch",
    "Prefetcher",
    "host_ring",
    "map_tensors",
    "resolve_device",
    "stays_on_host",
    "warn_no_cuda",
]


class GPUFeedWarning(UserWarning):
    """The GPU feed fell back to host memory (``device="cpu"`` or no usable CUDA device)."""


def resolve_device(device: str | int | torch.device) -> torch.device:
    """Return the device a feed targets: ``cuda:N`` when usable, else ``cpu`` with one warning.

    A CUDA index that does not exist on a machine with CUDA is an error, not a fallback.
    """
    dev = _as_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            warn_no_cuda(device)
            return torch.device("cpu")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(
                f"feedpipe: device={str(device)!r} does not exist; this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    if dev.type == "cpu":
        warnings.warn(
            "feedpipe: device='cpu' given; the GPU feed is off and batches stay in host memory",
            GPUFeedWarning,
            stacklevel=user_stacklevel(),
        )
        return dev
    raise ValueError(f"feedpipe: device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")


def _as_device(device: str | int | torch.device) -> torch.device:
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:  # torch's "Invalid device string": name the argument
        raise ValueError(
            f"feedpipe: device must be 'cuda', 'cuda:N' or 'cpu' (N >= 0), got {device!r}: {exc}"
        ) from exc


def stays_on_host(device: str | int | torch.device) -> bool:
    """Whether a loader's batches for ``device`` stay in host memory: ``"cpu"``, or a CUDA
    device where CUDA is not available (:func:`warn_no_cuda` says so)."""
    dev = _as_device(device)
    return dev.type == "cpu" or (dev.type == "cuda" and not torch.cuda.is_available())


def warn_no_cuda(device: str | int | torch.device) -> None:
    """The one :class:`GPUFeedWarning` for a CUDA ``device`` asked for where there is none
    (nothing for any other device), pointing at the user's line."""
    if _as_device(device).type != "cuda" or torch.cuda.is_available():
        return
    warnings.warn(
        f"feedpipe: device={str(device)!r} requested but CUDA is not available; "
        "batches stay in host memory",
        GPUFeedWarning,
        stacklevel=user_stacklevel(),
    )


def host_ring() -> bool:
    """``FEEDPIPE_HOST_RING=1``: a loader whose batches stay in host memory still runs the
    feed's ring there (unpinned slots, a host copy out of each), so that tests on a machine
    without a GPU cover the device path's host side; off by default (the ring only costs
    there: two more copies of every batch)."""
    return bool(
        env_flag(
            "FEEDPIPE_HOST_RING",
            False,
            strict=True,
            meaning=("host batches, no ring", "the ring in host memory"),
        )
    )


class PinnedBatch:
    """A host batch whose tensors are already page-locked and stay valid while referenced
    (a process worker's shared slot, :mod:`feedpipe.loader.slots`): the feed copies straight
    from it, without the ring, and drops it once that copy has completed."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch


@dataclass
class _InFlight:
    """A submitted batch: its device (or host-copy) leaves, how to rebuild it, its done event."""

    seq: int
    leaves: list[Any]
    rebuild: Any
    event: Any | None
    nbytes: int
    ticket: int = 0  # its copy's number in CopyTimes (0: no timed copy)


class _Range:
    """An NVTX range of ``rec`` around a ``with`` block (nothing while ranges are off)."""

    __slots__ = ("name", "rec")

    def __init__(self, rec: trace.Recorder | None, name: str) -> None:
        self.rec, self.name = rec, name

    def __enter__(self) -> None:
        if self.rec is not None:
            self.rec.push(self.name)

    def __exit__(self, *exc: object) -> None:
        if self.rec is not None:
            self.rec.pop()


class _CudaCopier:
    """Issues slot -> device copies on a dedicated stream and hands them to the consumer.

    Its timing events are reused (``events``) and its CUDA event and stream calls go through
    :mod:`feedpipe.device.cudacalls` (GIL held with ``FEEDPIPE_CUDA_KEEP_GIL=1``): with thread
    workers busy, each call that lets the GIL go costs the consuming thread a hand-off."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self.calls = cuda_calls()
        self.events = EventPool()

    def copy(self, views: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any, Any]:
        start, end = self.events.take(), self.events.take()
        calls, stream, device = self.calls, self.stream, self.device
        with torch.cuda.stream(stream):  # device tensors are allocated on the copy stream
            calls.record(start, stream)
            outs = [v.to(device, non_blocking=True) for v in views]
            calls.record(end, stream)
        return outs, start, end

    def hand_over(self, outs: list[torch.Tensor], event: Any) -> None:
        consumer = torch.cuda.current_stream(self.device)
        self.calls.wait(consumer, event)
        for t in outs:
            t.record_stream(consumer)


class _HostCopier:
    """CPU fallback: a synchronous copy out of the slot, so the consumer never sees a slot."""

    stream = None

    def __init__(self) -> None:
        self.seconds = 0.0

    def copy(self, views: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any, Any]:
        t0 = time.perf_counter()
        outs = [v.clone() for v in views]
        self.seconds = time.perf_counter() - t0
        return outs, None, None

    def hand_over(self, outs: list[torch.Tensor], event: Any) -> None:
        return None


def _bound_out_for(ring: Ring, gen: int) -> Callable[[int, int], Any | None]:
    def out_for(seq: int, rows: int) -> Any | None:
        try:
            return ring.out_for(seq, rows, gen)
        except RingClosedError:
            return None

    return out_for


class GPUFeed:
    """Moves CPU batches to ``device`` through a ring of page-locked slots, ``prefetch`` ahead.

    Either iterate ``feed.iterate(cpu_batches)``, or drive it step by step (what the loader does,
    so that it counts a batch only when it is handed over): ``start()``, then ``submit(batch)``
    (or ``skip()`` for a batch that failed) up to ``prefetch`` batches ahead, ``hand_over(flight)``
    in order, ``finish()``. Thread workers gather batch ``seq`` (its delivery-order number) into
    ``out_for(seq, rows)`` when that is not ``None``. ``meter`` (a :class:`feedpipe.StallMeter`)
    receives the ``"pin"`` and ``"h2d"`` stages (on the CPU fallback, "h2d" is the host copy).
    """

    def __init__(
        self,
        device: str | int | torch.device,
        *,
        prefetch: int = 2,
        fillers: int = 0,
        batch_size: int | None = None,
        meter: Any | None = None,
        timeout: float = 300.0,
    ) -> None:
        if prefetch < 0 or fillers < 0:
            raise ValueError(f"prefetch and fillers must be >= 0, got {prefetch} and {fillers}")
        self.device = resolve_device(device)
        self.on_gpu = self.device.type == "cuda"
        self.prefetch = prefetch
        self.meter = meter
        self._copier: _CudaCopier | _HostCopier = (
            _CudaCopier(self.device) if self.on_gpu else _HostCopier()
        )
        self._times: CopyTimes | None = None
        query = None  # the ring's default: torch's Event.query
        if isinstance(self._copier, _CudaCopier):
            self._times = CopyTimes(self._copier.calls, self._copier.events)
            query = self._copier.calls.query
        self._tickets = 0  # batches submitted over the feed's life (CopyTimes.handed)
        self._ring = Ring(
            prefetch + 2 + fillers,
            pin=self.on_gpu,
            batch_size=batch_size,
            timeout=timeout,
            query=query,
        )
        self._held: deque[tuple[Any, list[Any]]] = deque()  # (copy done event, pinned sources)
        self._seq = 0
        self.batches = 0
        self._trace = trace.recorder()  # NVTX: "feedpipe/pin", "feedpipe/h2d" (read per epoch)

    # ------------------------------------------------------------------ reporting
    @property
    def copy_stream(self) -> Any:
        """The dedicated CUDA copy stream (``None`` on the CPU fallback)."""
        return self._copier.stream

    @property
    def events(self) -> EventPool | None:
        """The pool of timing events that :meth:`note_copy` gives back to (``None`` on the CPU
        fallback): a copy issued elsewhere takes its events from it."""
        return self._copier.events if isinstance(self._copier, _CudaCopier) else None

    @property
    def info(self) -> dict[str, Any]:
        """The memory budget: slot count and bytes (0 until the first batch lays the ring out)."""
        ring = self._ring
        return {
            "device": str(self.device),
            "pinned": ring.pin,
            "prefetch": self.prefetch,
            "slots": ring.n,
            "slot_bytes": ring.slot_bytes,
            "ring_bytes": ring.ring_bytes,
            "reallocations": ring.grown,
            "batches": self.batches,
        }

    # ------------------------------------------------------------------ the three steps
    def out_for(self, seq: int, rows: int) -> Any | None:
        """Slot views for batch ``seq`` of ``rows`` samples, for a worker to gather into.

        Blocks until batch ``seq - slots`` has been submitted and its copy completed. Returns
        ``None`` (gather into fresh memory instead) before the first batch has laid out the ring,
        for batches that are not batch-major or do not fit, and once the iteration has ended.
        """
        return _bound_out_for(self._ring, self._ring.gen)(seq, rows)

    def start(self) -> Callable[[int, int], Any | None]:
        """Begin an epoch (batches numbered from 0); returns this epoch's :meth:`out_for`.

        Waits for the copies out of every slot. If the previous epoch was abandoned while
        fillers held slots (their gathers may still be running), the ring is not reused: a new
        one replaces it (the old one is freed into torch's pinned-memory cache once released).
        Fillers must use the returned function, bound to this epoch's ring.
        """
        old = self._ring
        lent = old.retire()
        if lent:
            log.info(
                "feedpipe GPU feed: the previous epoch was abandoned with %d slots lent to "
                "workers; using a fresh ring",
                lent,
            )
            self._ring = Ring(
                old.n, pin=old.pin, batch_size=old.batch_size, timeout=old.timeout, query=old.query
            )
        gen = self._ring.reset()
        self._seq = 0
        self._trace = trace.recorder()
        return _bound_out_for(self._ring, gen)

    def submit(self, batch: Any) -> _InFlight:
        """Put the next batch (in delivery order) into its slot and start its copy to the device.

        In-place gathers (:meth:`out_for`) must use the same numbering: batch ``seq`` is the
        ``seq``-th call to :meth:`submit` or :meth:`skip` since :meth:`start`.
        """
        if type(batch) is PinnedBatch and self.on_gpu:
            return self._submit_pinned(batch)
        if type(batch) is PinnedBatch:
            batch = batch.batch
        seq = self._seq
        leaves, rebuild = flatten(batch)
        host = [i for i, t in enumerate(leaves) if t.device.type == "cpu"]
        host_leaves = [leaves[i] for i in host]
        ring = self._ring
        if ring.layout is None:
            ring.allocate(host_leaves, rebuild if len(host) == len(leaves) else None)
        t0 = time.perf_counter()
        # NVTX ranges in the thread that fills the slot and issues the copy
        with _Range(self._trace, "feedpipe/pin"):
            slot, views, copied = ring.fill(seq, host_leaves)
        if copied and self.meter is not None:
            self.meter.add_stage("pin", time.perf_counter() - t0, copied)
        with _Range(self._trace, "feedpipe/h2d"):
            outs, start, end = self._copier.copy(views)
        nbytes = sum(v.numel() * v.element_size() for v in views)
        ticket = self._note_copy(slot, seq, start, end, nbytes)
        self._seq += 1
        on_device = self._on_device(leaves, dict(zip(host, outs, strict=True)))
        return _InFlight(seq, on_device, rebuild, end, nbytes, ticket)

    def _on_device(self, leaves: list[torch.Tensor], copies: dict[int, torch.Tensor]) -> list[Any]:
        """The batch's leaves on the device: host leaves replaced by their ``copies`` (by leaf
        number), leaves already on a device moved only if elsewhere."""
        result: list[Any] = list(leaves)
        for i, t in enumerate(leaves):
            if i in copies:
                result[i] = copies[i]
            elif t.device.type != "cpu" and t.device != self.device:
                result[i] = t.to(self.device)
        return result

    def _submit_pinned(self, pinned: PinnedBatch) -> _InFlight:
        """Copy a page-locked batch straight to the device; keep its sources until the copy is
        done (then its slot may be reused). Its ring slot number is skipped."""
        self._release(block=False)
        seq = self._seq
        leaves, rebuild = flatten(pinned.batch)
        host = [i for i, t in enumerate(leaves) if t.device.type == "cpu"]
        outs, start, end = self._copier.copy([leaves[i] for i in host])
        nbytes = sum(leaves[i].numel() * leaves[i].element_size() for i in host)
        ticket = self._time_copy(start, end, nbytes)
        self._held.append((end, leaves))
        self._ring.skip()
        result: list[Any] = list(leaves)
        for i, out in zip(host, outs, strict=True):
            result[i] = out
        for i, t in enumerate(leaves):
            if t.device.type != "cpu" and t.device != self.device:
                result[i] = t.to(self.device)
        self._seq += 1
        return _InFlight(seq, result, rebuild, end, nbytes, ticket)

    def _release(self, block: bool) -> None:
        """Drop the sources of pinned batches whose copies have completed, oldest first."""
        held = self._held
        while held:
            event, _ = held[0]
            if not block and not self._ring.query(event):
                return
            event.synchronize()
            held.popleft()

    def skip(self) -> None:
        """The next batch will never arrive (its worker failed): keep the numbering aligned."""
        self._ring.skip()
        self._seq += 1

    def _time_copy(self, start: Any, end: Any, nbytes: int) -> int:
        """Time a copy of the next batch; returns its ticket (see :class:`CopyTimes`)."""
        assert self._times is not None
        self._tickets += 1
        self._times.add(start, end, nbytes, self._tickets)
        return self._tickets

    def _note_copy(self, slot: Slot, seq: int, start: Any, end: Any, nbytes: int) -> int:
        ticket = 0
        if self._times is not None:
            ticket = self._time_copy(start, end, nbytes)
        elif self.meter is not None:
            assert isinstance(self._copier, _HostCopier)
            self.meter.add_stage("h2d", self._copier.seconds, nbytes)
        event: Event | None = end
        self._ring.submitted(slot, seq, event)
        return ticket

    def note_copy(self, start: Any, end: Any, nbytes: int) -> None:
        """Report a copy issued elsewhere on :attr:`copy_stream` (the direct DMA path) as
        ``"h2d"`` once its CUDA events have completed; any thread may call it."""
        if self._times is not None:
            self._times.add(start, end, nbytes)

    def hand_over(self, flight: _InFlight) -> Any:
        """Order the consumer's current stream after the copy and return the device batch."""
        if flight.event is not None:
            outs = [t for t in flight.leaves if isinstance(t, torch.Tensor) and t.is_cuda]
            self._copier.hand_over(outs, flight.event)
        if self._times is not None:  # its copy's events may be read (and reused) from now on
            self._times.handed = flight.ticket or self._times.handed
        self._harvest(block=False)
        if self._held:
            self._release(block=False)
        self.batches += 1
        return flight.rebuild(flight.leaves)

    def _harvest(self, block: bool) -> None:
        """Report completed copy times (CUDA events) to the meter, oldest first."""
        if self._times is not None:
            self._times.harvest(self.meter, block)

    # ------------------------------------------------------------------ iteration
    def iterate(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield ``batches`` on the device, keeping ``prefetch`` copies in flight ahead.

        Batch numbers (for :meth:`out_for`) restart at 0 on each call. When the iteration ends or
        is abandoned, fillers waiting for a slot get ``None`` and completed timings are reported.
        """
        self.start()
        epoch = self.epoch
        source = iter(batches)
        pending: deque[_InFlight] = deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) <= self.prefetch:
                    try:
                        batch = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    pending.append(self.submit(batch))
                if not pending:
                    return
                if self.meter is not None:
                    self.meter.set_depth("gpu_prefetch", len(pending) - 1)
                yield self.hand_over(pending.popleft())
        finally:
            self.finish(epoch)

    def finish(self, epoch: tuple[Ring, int] | None = None) -> None:
        """End an epoch: wake fillers waiting for a slot (they get ``None``), report timings.
        With ``epoch`` (``self.epoch`` taken after :meth:`start`), only if it is still current."""
        if epoch is not None and epoch != self.epoch:
            return
        self._ring.close()
        self._harvest(block=True)
        self._release(block=True)

    @property
    def epoch(self) -> tuple[Ring, int]:
        """Identifies the current epoch (its ring and generation)."""
        return self._ring, self._ring.gen

    def close(self) -> None:
        """Wake any filler waiting for a slot (it gets ``None``); the ring memory stays reusable."""
        self._ring.close()

    def prefetcher(self, pull: Callable[[], tuple[Any, Any, bool]] | None = None) -> Prefetcher:
        """Start an epoch driven by ``pull`` (see :class:`Prefetcher`)."""
        return Prefetcher(self, pull)


class Prefetcher:
    """One epoch of a :class:`GPUFeed` for a loader: ``next()`` returns ``(batch, info)`` in order.

    ``pull()`` (settable later, as ``.pull``: the loader's workers need :attr:`out_for` before
    the loader's iterator exists) returns the next ``(cpu_batch, info, ok)`` or raises
    ``StopIteration``;
    ``ok=False`` marks a batch whose worker failed (its ``info`` comes back with ``batch=None``
    at its turn, so the loader raises it in order). ``prefetch`` batches stay submitted ahead.
    ``out_for`` is this epoch's in-place gather function for thread workers.
    """

    def __init__(
        self, feed: GPUFeed, pull: Callable[[], tuple[Any, Any, bool]] | None = None
    ) -> None:
        self._feed = feed
        self.pull = pull
        self._ahead: deque[tuple[_InFlight | None, Any]] = deque()
        self._exhausted = False
        self.out_for = feed.start()
        self._epoch = feed.epoch

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Any, Any]:
        feed, ahead = self._feed, self._ahead
        while not self._exhausted and len(ahead) <= feed.prefetch:
            if self.pull is None:
                raise RuntimeError("Prefetcher.pull was never set")
            try:
                batch, info, ok = self.pull()
            except StopIteration:
                self._exhausted = True
                break
            except BaseException:
                self.close()
                raise
            if ok:
                ahead.append((feed.submit(batch), info))
            else:
                feed.skip()
                ahead.append((None, info))
        if not ahead:
            self.close()
            raise StopIteration
        if feed.meter is not None:
            feed.meter.set_depth("gpu_prefetch", len(ahead) - 1)
        flight, info = ahead.popleft()
        return (None if flight is None else feed.hand_over(flight)), info

    def close(self) -> None:
        """End the epoch early or late: fillers waiting for a slot are turned away."""
        self._exhausted = True
        self._ahead.clear()
        self._feed.finish(self._epoch)  # a no-op once a later epoch has started
