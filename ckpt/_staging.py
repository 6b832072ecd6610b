"""The blocking phase of a save: copy every array leaf into the staging buffer, in few large copies.

``stage`` copies each leaf to its planned offset of a ``Buffer``. A CUDA state of many small
tensors would cost one device-to-host copy (and several Python-level tensor operations) per
tensor, so CUDA leaves are batched:

1. Per device, all copies run on one side stream that first waits for the current stream (so
   they see every write the training loop queued); the save then waits for that stream only,
   not for the whole device (a data loader's or NCCL's streams are not waited for).
2. Consecutive small contiguous leaves of one device (the plan lays them out in order) form a
   *run* of at most ``RUN_BYTES``: one ``torch._foreach_copy_`` gathers them, as bytes, into a
   device buffer laid out like the staging buffer (padding zeroed), and one device-to-host copy
   moves the run. The gather is a device-to-device copy, far faster than the link to the host.
3. Large or non-contiguous leaves are copied directly, each as it is reached, so the link is busy
   while Python prepares the next ones.

CPU tensors and numpy arrays are copied on the host as before. The bytes in the buffer are the
leaves' bytes exactly (dtype-agnostic: bool, bf16, float8 and complex are copied as raw bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ckpt._flatten import Leaf
from ckpt._pool import Buffer

__all__ = ["RUN_BYTES", "SMALL_BYTES", "stage"]

SMALL_BYTES = 4 << 20
"""Contiguous CUDA leaves up to this size are gathered into runs (larger ones copy directly)."""
RUN_BYTES = 64 << 20
"""The largest run: the device memory a batched copy borrows from the caching allocator."""

_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    return stream


def _flat(src: torch.Tensor) -> torch.Tensor:
    """The bytes of ``src`` as a flat uint8 tensor (a view if contiguous, else a copy made on
    the current stream). ``as_strided`` also covers contiguous tensors whose size-1 dims have
    other strides, which ``view(-1)`` keeps."""
    if not src.is_contiguous():
        src = src.contiguous()
    return torch.as_strided(src, (src.numel(),), (1,)).view(torch.uint8)


def _to_host(buf: Buffer, off: int, flat: torch.Tensor) -> None:
    """Copy device bytes ``flat`` to ``buf`` at ``off`` (asynchronous)."""
    buf.tensor[off : off + flat.numel()].copy_(flat, non_blocking=True)


class _Run:
    """Consecutive small contiguous leaves of one CUDA device, gathered with one copy."""

    def __init__(self, device: torch.device, start: int) -> None:
        self.device, self.start, self.end = device, start, start
        self.offsets: list[int] = []
        self.sources: list[torch.Tensor] = []

    def add(self, offset: int, src: torch.Tensor, nbytes: int) -> None:
        self.offsets.append(offset - self.start)
        self.sources.append(_flat(src))
        self.end = offset + nbytes

    def issue(self, buf: Buffer) -> None:
        """Gather the run into a device buffer and copy it to the host in one transfer."""
        span = self.end - self.start
        try:
            bounce = torch.empty(span, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:  # no room for the gather: copy each leaf directly
            for off, src in zip(self.offsets, self.sources, strict=True):
                _to_host(buf, self.start + off, src)
            return
        sizes, k = [], 0
        for off, src in zip(self.offsets, self.sources, strict=True):
            sizes += [off - k, src.numel()]
            k = off + src.numel()
        sizes.append(span - k)
        bounce.zero_()  # the padding: never stale device memory in the file (one memset)
        torch._foreach_copy_(list(bounce.split(sizes)[1::2]), self.sources)
        _to_host(buf, self.start, bounce)


def stage(leaves: Sequence[Leaf], entries: Sequence[dict], buf: Buffer) -> None:
    """Copy every leaf into ``buf`` at its planned offset; returns once every byte is there."""
    streams: dict[torch.device, Any] = {}
    run: _Run | None = None
    with torch.no_grad():
        for leaf, entry in zip(leaves, entries, strict=True):
            off, n = entry["offset"], entry["nbytes"]
            if n == 0:
                continue
            src = leaf.value
            if not isinstance(src, torch.Tensor):
                buf.array[off : off + n].view(src.dtype).reshape(src.shape)[...] = src
                continue
            small = src.is_cuda and n <= SMALL_BYTES and src.is_contiguous()
            if run is not None and not (
                small and src.device == run.device and off + n - run.start <= RUN_BYTES
            ):  # a run holds only consecutive leaves: anything else ends it
                with torch.cuda.stream(streams[run.device]):
                    run.issue(buf)
                run = None
            if not src.is_cuda:
                buf.tensor[off : off + n].view(src.dtype).view(src.shape).copy_(src)
                continue
            device = src.device
            stream = streams.get(device)
            if stream is None:
                stream = streams[device] = _side_stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
            if small:
                if run is None:
                    run = _Run(device, off)
                run.add(off, src, n)
            else:
                with torch.cuda.stream(stream):
                    _to_host(buf, off, _flat(src))
        if run is not None:
            with torch.cuda.stream(streams[run.device]):
                run.issue(buf)
    for stream in streams.values():
        stream.synchronize()
