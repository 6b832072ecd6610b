"""``TokenWindows``: fixed-size windows over the concatenation of variable-length documents.

A tokenized corpus is a :class:`~feedpipe.MemmapDataset` with a ragged token column (a field
``tokens: (int32, (None,))``, or the records themselves with ``shape=(None,)``). Its data
files already hold every document's tokens back to back, shard after shard: that *is* the
concatenation, so nothing is materialised. Window ``i`` is the tokens
``[i * block_size, (i + 1) * block_size)`` of it.

The index is the number of tokens of each shard: the last offset of a shard's offsets file,
which is also its data file's size as ``index.json`` lists it. So building it reads no offsets
file and costs O(shards), never O(tokens). A window is one contiguous ``os.preadv`` of its
shard's data file, or one per shard where it crosses shards.

Windows are the samples of a map-style dataset: any sampler shuffles them
(``feedpipe.DistributedSampler``, ``RandomSampler``), and exact and elastic resume come from
the sampler's and loader's state, as for every feedpipe dataset; ``TokenWindows`` itself has no
state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._gather import indices_array
from feedpipe.datasets.memmap import MemmapDataset
from feedpipe.errors import DatasetError
from feedpipe.io.remote import redact

__all__ = ["TokenWindows"]


class TokenWindows(torch.utils.data.Dataset[torch.Tensor]):
    """Windows of ``block_size`` tokens over the documents of ``dataset``'s ``field``.

    ``dataset`` is a :class:`~feedpipe.MemmapDataset` or a path/URL to open as one (with
    ``dataset_options`` as its keywords). ``field`` names a ragged 1-D column (``"data"`` for
    the records of a ragged layout). ``ds[i]`` is a 1-D tensor of ``block_size`` tokens;
    ``read_batch`` returns ``(n, block_size)``. With ``drop_last=False`` the last, partial
    window is filled up with ``pad_value``. For next-token training ask for
    ``block_size = context + 1`` and split each window into inputs and targets.
    """

    #: ``read_batch`` takes numpy index arrays (:class:`feedpipe.protocols.IndexArrayDataset`).
    takes_index_arrays = True

    def __init__(
        self,
        dataset: MemmapDataset | str | os.PathLike[str],
        block_size: int = 2048,
        field: str = "tokens",
        drop_last: bool = True,
        *,
        pad_value: int = 0,
        dataset_options: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        block_size = int(block_size)
        if block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(dataset, MemmapDataset):
            dataset = MemmapDataset(dataset, **(dataset_options or {}))
        self.dataset = dataset
        shown = redact(dataset.path, dataset.storage_options)
        self.block_size = block_size
        self.field = field
        self.drop_last = drop_last
        self.pad_value = pad_value
        if field == "data":
            kind, dtype, shape = dataset.kind, str(dataset.dtype), tuple(dataset.shape)
        elif field in dataset.fields:
            spec = dataset.fields[field]
            kind, dtype, shape = spec.kind, spec.dtype, tuple(spec.shape)
        else:
            raise DatasetError(
                f"{shown}: no field {field!r} (fields: {sorted(dataset.fields)}; "
                "field='data' reads the records of a ragged layout)"
            )
        if kind != "ragged" or shape != ():
            raise DatasetError(
                f"{shown}: column {field!r} is {kind} {shape}; TokenWindows needs a ragged "
                "1-D column, e.g. fields={'tokens': ('int32', (None,))}"
            )
        self.dtype = np.dtype(dtype)
        if np.array(pad_value).astype(self.dtype) != pad_value:
            raise ValueError(f"pad_value {pad_value!r} does not fit {self.dtype}")
        role = "data" if field == "data" else f"field.{field}"
        itemsize = self.dtype.itemsize
        counts = [s.files[role].bytes // itemsize for s in dataset.index.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])
        full, rest = divmod(self.num_tokens, block_size)
        self._len = full if drop_last or rest == 0 else full + 1

    def __len__(self) -> int:
        return self._len

    def _normalize(self, indices: Any) -> np.ndarray:
        n = self._len
        return indices_array(indices, n, lambda i: f"window {i} is out of range ({n} windows)")

    def __getitem__(self, index: int) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and index.ndim == 0:
            index = int(index)
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        window: torch.Tensor = self.read_batch([int(index)])[0]
        return window

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return list(self.read_batch(indices))

    def read_batch(
        self, indices: Sequence[int] | np.ndarray | torch.Tensor, out: Any = None
    ) -> Any:
        """Windows ``indices`` as one ``(n, block_size)`` tensor (into ``out`` when given):
        one contiguous read per window, two where it crosses a shard boundary."""
        idx = self._normalize(indices)
        n, block = len(idx), self.block_size
        if out is None:
            dest = np.empty((n, block), self.dtype)
            result = torch.from_numpy(dest)
        else:
            want = torch.from_numpy(np.empty(0, self.dtype)).dtype
            if (
                not isinstance(out, torch.Tensor)
                or out.device.type != "cpu"
                or out.dtype != want
                or tuple(out.shape[1:]) != (block,)
                or out.shape[0] < n
                or not out[:n].is_contiguous()
            ):
                raise ValueError(f"out must be a contiguous CPU {want} tensor of ({n}, {block})")
            result = out[:n]
            dest = result.numpy()
        starts = self._starts
        itemsize = self.dtype.itemsize
        for j in np.argsort(idx, kind="stable").tolist():  # file order: kinder to readahead
            g = int(idx[j]) * block
            end = min(g + block, self.num_tokens)
            row = dest[j]
            pos = 0
            s = int(np.searchsorted(starts, g, side="right")) - 1
            while g < end:
                stop = min(end, int(starts[s + 1]))
                if stop > g:
                    take = stop - g
                    self.dataset.read_span(
                        self.field, s, (g - int(starts[s])) * itemsize, row[pos : pos + take]
                    )
                    pos += take
                    g = stop
                s += 1
            if pos < block:
                row[pos:] = self.pad_value
        return result

    def close(self) -> None:
        """Close the dataset's open files."""
        self.dataset.close()

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self.dataset!r}, {self._len} windows of {self.block_size} "
            f"{self.dtype} tokens from {self.field!r}, {self.num_tokens} tokens)"
        )
