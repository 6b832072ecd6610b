"""Where each leaf's bytes sit in a data file: ``plan`` lays the leaves out (``ALIGN``-ed
offsets), ``stage`` copies them into a buffer at those offsets, ``load_arrays`` views them back
out of the loaded file."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ckpt._layout import DATA_FILE
from ckpt.format.dtypes import torch_dtype
from ckpt.format.limits import ALIGN

__all__ = ["ArrayLeaf", "StagingBuffer", "entry", "load_arrays", "pack", "plan", "stage"]


class ArrayLeaf(Protocol):
    """What the layout needs of one array leaf (``ckpt.saving.flatten.Leaf`` is one)."""

    @property
    def value(self) -> torch.Tensor | np.ndarray[Any, Any]: ...
    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str: ...


class StagingBuffer(Protocol):
    """A flat uint8 buffer seen as a tensor and an array (``ckpt.saving.pool.Buffer`` is one)."""

    @property
    def tensor(self) -> torch.Tensor: ...
    @property
    def array(self) -> np.ndarray[Any, Any]: ...


def pack(sizes: Iterable[int], start: int = 0) -> tuple[list[int], int]:
    """The layout of byte blocks in a data file (and in the staging pool that mirrors it): each
    block's offset, at the next multiple of ``ALIGN`` so any dtype can be viewed in place, and the
    end of the last one."""
    offsets, offset = [], start
    for nbytes in sizes:
        offset = -(-offset // ALIGN) * ALIGN
        offsets.append(offset)
        offset += nbytes
    return offsets, offset


def entry(leaf: ArrayLeaf, offset: int, file: str) -> dict[str, Any]:
    """The manifest entry of ``leaf`` stored at ``offset`` of ``file``."""
    return {
        "kind": leaf.kind,
        "dtype": leaf.dtype,
        "shape": leaf.shape,
        "file": file,
        "offset": offset,
        "nbytes": leaf.nbytes,
        "device": leaf.device,
    }


def plan(
    leaves: Sequence[ArrayLeaf], file: str = DATA_FILE, start: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """Lay ``leaves`` out in one data file, in their order; returns the manifest entries and the
    file size (``ckpt.saving.plan.SavePlan`` uses ``pack`` and ``entry`` in its own leaf order)."""
    offsets, size = pack((leaf.nbytes for leaf in leaves), start)
    return [entry(leaf, off, file) for leaf, off in zip(leaves, offsets, strict=True)], size


def stage(
    leaves: Sequence[ArrayLeaf], entries: Sequence[dict[str, Any]], buf: StagingBuffer
) -> None:
    """Copy every leaf into ``buf`` at its planned offset; CUDA copies are synchronized."""
    devices = set()
    for leaf, entry in zip(leaves, entries, strict=True):
        off, n = entry["offset"], entry["nbytes"]
        if n == 0:
            continue
        if isinstance(leaf.value, torch.Tensor):
            src = leaf.value
            dst = buf.tensor[off : off + n].view(src.dtype).view(src.shape)
            if src.is_cuda:
                devices.add(src.device)
                dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
        else:
            arr = leaf.value
            buf.array[off : off + n].view(arr.dtype).reshape(arr.shape)[...] = arr
    for device in devices:
        torch.cuda.synchronize(device)


def load_arrays(body: dict[str, Any], files: dict[str, torch.Tensor]) -> list[Any]:
    """Views of each entry into the loaded (or memory-mapped) data-file tensors."""
    out: list[Any] = []
    for e in body["entries"]:
        raw = files[e["file"]][e["offset"] : e["offset"] + e["nbytes"]]
        if e["kind"] == "tensor":
            dtype = torch_dtype(e["dtype"])
            if e["nbytes"] == 0:
                out.append(torch.empty(e["shape"], dtype=dtype))
            else:
                out.append(raw.view(dtype).view(e["shape"]))
        elif e["nbytes"] == 0:
            out.append(np.empty(e["shape"], dtype=np.dtype(e["dtype"])))
        else:
            out.append(raw.numpy().view(np.dtype(e["dtype"])).reshape(e["shape"]))
    return out
