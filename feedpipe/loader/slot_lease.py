"""A worker slot's lease: the slot stays taken while any memory of it may still be read.

The main process hands a batch out as tensors over a slot of a worker's shared buffer
(:mod:`feedpipe.loader.slots`). Each leaf's tensor gets a storage of its own, made by
``torch.from_numpy`` over the leaf's bytes, so that the batch's life can be told apart from the
buffer's (which lives as long as the worker). Two things keep the slot's :class:`Lease`:

1. **The storage's memory** (``torch.from_numpy`` keeps the numpy region, which keeps the lease):
   the slot is free once the last tensor, view or ``.numpy()`` array over it is gone.
2. **The storage itself**, through an attribute on its Python object (torch keeps that object, and
   so its attributes, for as long as the storage lives, even with no Python reference to it).

Why both: ``share_memory_()``, and the pickling of a ``torch.multiprocessing`` queue, *move* a
storage that is not already in shared memory. torch copies the bytes into a new segment and
swaps the storage's memory in place (``storage.set_data_ptr``); the old memory (here: the slot)
is released at once, while a ``.numpy()`` array taken before the move still points into it (the
array keeps the tensor, and the tensor now has the new memory). With only (1), the slot went back
to its worker and the array read the next batch. With (2), the slot stays taken until the
storage dies, and every array, view or ``torch.from_numpy`` over it keeps the storage alive.

The slot storages are deliberately *not* in shared memory as torch sees them: if they were,
``share_memory_()`` would do nothing and a queue would send the slot itself to another process,
which may still read it after this process has dropped it; no lease can follow a mapping into
another process. A batch that is shared therefore costs what torch's own ``share_memory_()``
costs for any tensor not yet shared (one copy, on that path only); every other path pays only
for setting the attribute (``benchmarks/worker_slots.py --lease`` measures it).

Not covered, as for any torch tensor: a tensor the user makes with ``torch.from_numpy`` over a
batch's array and then shares itself; its earlier ``.numpy()`` arrays hold only that tensor, so
the slot (like the segment of a batch of torch's own loader, which is then unmapped) goes once
the batch and every alias of it that torch still tracks are gone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.io.forks import ForkStamp

__all__ = ["ATTR", "Lease", "leased_tensors"]

ATTR = "feedpipe_slot_lease"  # the attribute of a leaf storage's Python object holding its lease


class Lease:
    """Holds slot ``slot`` (its byte in ``flags`` set) until collected, then frees it.

    ``owner`` is kept alive with the lease: the worker's buffer as the main process holds it (its
    mapping and its registration with CUDA outlive every view of it). Only the process that made
    the lease frees the slot: a child forked meanwhile has a copy of the batch and of the shared
    flags, and its copy going away must not free the slot the parent's batch still reads."""

    __slots__ = ("born", "flags", "owner", "slot")

    def __init__(self, owner: object, flags: np.ndarray, slot: int) -> None:
        self.owner, self.flags, self.slot = owner, flags, slot
        self.born = ForkStamp()

    def __del__(self) -> None:
        if self.born.here():
            self.flags[self.slot] = 0


class _Region(np.ndarray):  # type: ignore[type-arg]
    """A slot's bytes as numpy, carrying the lease (its slices keep it alive)."""

    lease: Lease | None = None


def leased_tensors(
    array: np.ndarray, layout: Sequence[tuple[int, Any, Any]], lease: Lease
) -> list[torch.Tensor]:
    """One tensor per ``(offset, dtype, shape)`` of ``layout`` over ``array`` (the buffer's
    bytes), each on a storage of its own that keeps ``lease`` for as long as it lives, whatever
    memory it is moved to (see the module's docstring)."""
    lo = layout[0][0]
    region = array[lo:].view(_Region)  # each leaf's slice below bounds what it reads
    region.lease = lease
    tensors = []
    for off, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        raw = torch.from_numpy(region[off - lo : off - lo + nbytes])
        setattr(raw.untyped_storage(), ATTR, lease)
        tensors.append(raw.view(dtype).view(shape))
    return tensors
