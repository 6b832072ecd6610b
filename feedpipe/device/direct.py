"""The device feed's direct path: records go by DMA from the page cache to the GPU.

With ``device="cuda"``, a dataset that can fill a CUDA ``out`` by DMA (``MemmapDataset`` with
fixed-size records on local shards: :meth:`~feedpipe.MemmapDataset.dma_blocker`) skips the host
gather and the pinned ring: the loader's workers see a :class:`DirectReader`, whose
``read_batch`` allocates the batch on the device and issues the copies on the feed's copy stream
(:mod:`feedpipe.device.dma`). Side fields (labels) still go through the ring.

Why this is safe, in the terms of :mod:`feedpipe.gpu` (``C`` the copy stream):

1. The batch's device memory is allocated on ``C`` and its copies are enqueued on ``C`` before
   ``read_batch`` returns, so before the loader submits the batch; the event ``E_s`` that the
   feed records on ``C`` at submit therefore follows them, and the consumer waits for ``E_s`` and
   ``record_stream``\\ s the tensors (rules 3 and 4 unchanged).
2. There is no host slot to reuse. The source is the shard's map, registered with CUDA while the
   shard is open; closing a shard synchronizes the device before unregistering and unmapping it.

Registration locks the shard's pages in memory until it is closed, so the automatic choice
(``direct=None``) takes this path only when the whole dataset fits in half the memory available,
and for records of at least 2 KiB: below that the pinned ring measured faster, above it the
direct path did, at every record size measured (docs/benchmarks.md, "GPU feed" and "Direct
DMA path: copy methods"). ``num_workers=0`` issues from the training thread (the copy engines'
call blocks for about the transfer); with workers, one thread issues, since more only compete
for the GIL.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from feedpipe.device import dma as _memmap_dma
from feedpipe.device.cudacalls import cuda_calls
from feedpipe.device.event_pool import EventPool
from feedpipe.io import trace
from feedpipe.protocols import DMADataset

__all__: list[str] = []  # private module; DataLoader(direct=...) is the public face

log = logging.getLogger("feedpipe.gpu")

_AUTO_MIN = 2048  # smaller records: the ring measured faster (module doc)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def blocker(dataset: Any, device: torch.device, *, auto: bool) -> str | None:
    """Why the direct path cannot serve ``dataset`` on ``device`` (None: it can). ``auto``
    adds the checks that only the automatic choice makes (memory, record size)."""
    if device.type != "cuda":
        return "the feed is not on a CUDA device"
    reason = dataset_blocker(dataset)
    if reason is not None:
        return reason
    if not _memmap_dma.read_only_supported(device.index or 0):
        return f"{device} cannot DMA from read-only registered memory"
    if not auto:
        return None
    record = int(dataset.record_bytes)
    if record < _AUTO_MIN:
        return f"records of {record} B (below {_AUTO_MIN} B the pinned ring is the default)"
    total = record * len(dataset)
    avail = _available_bytes()
    if avail is not None and total > avail // 2:
        return (
            f"the data ({total / 2**30:.1f} GiB) is more than half the available memory "
            f"({avail / 2**30:.1f} GiB); its pages would be locked while read"
        )
    return None


def dataset_blocker(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be read by DMA on any device (None: it can): what
    ``direct=True`` is checked against where there is no GPU, as where there is one."""
    if not isinstance(dataset, DMADataset):
        return f"{type(dataset).__name__} has no DMA read (dma_blocker/device_out)"
    reason: str | None = dataset.dma_blocker()
    return reason


class DirectReader:
    """What the loader's workers read from on the direct path: ``read_batch`` puts the records
    on the device (copy stream ``stream``) and reports the copy time through ``note``."""

    def __init__(
        self, dataset: Any, device: torch.device, stream: Any, note: Any, events: Any = None
    ) -> None:
        self.dataset = dataset
        self.device = device
        self.stream = stream
        self.note = note  # note(start_event, end_event, nbytes) or None (counters off)
        # the feed's: note() gives them back there (an empty pool is falsy: test for None)
        self.events = events if events is not None else EventPool()
        self.calls = cuda_calls()

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"DirectReader({self.dataset!r}, {self.device})"

    def __getattr__(self, name: str) -> Any:  # the dataset's other attributes, for user hooks
        return getattr(self.__dict__["dataset"], name)

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        """The batch of ``indices`` with its records on the device (copies in flight on the
        copy stream; the feed orders the consumer after them)."""
        ds, note, stream = self.dataset, self.note, self.stream
        with trace.span("feedpipe/h2d"), torch.cuda.stream(stream):
            dest = ds.device_out(len(indices), self.device)
            if note is None:
                return ds.read_batch(indices, out=dest)
            start, end = self.events.take(), self.events.take()
            self.calls.record(start, stream)
            batch = ds.read_batch(indices, out=dest)
            self.calls.record(end, stream)
        data = dest["data"] if isinstance(dest, dict) else dest
        note(start, end, data.numel() * data.element_size())
        return batch


def describe(dataset: Any, device: torch.device, reason: str | None) -> None:
    """Log the choice once per loader."""
    if reason is None:
        log.info(
            "feedpipe GPU feed: direct path: %s is read by DMA from the page cache to %s (pid %d)",
            getattr(dataset, "path", type(dataset).__name__),
            device,
            os.getpid(),
        )
    else:
        log.info("feedpipe GPU feed: pinned ring path (direct DMA off: %s)", reason)
