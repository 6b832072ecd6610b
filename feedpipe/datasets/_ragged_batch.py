"""Batches with ragged columns: collate samples, and widen padded batches, one way everywhere.

A ragged column's batch is the same whichever path builds it:

- ``"pad"``: ``NAME`` is ``(n, width, *shape)``, every record padded to the longest of the
  batch with the dataset's ``pad_value``, plus an int64 ``NAME_lengths`` of rows per record;
- ``"nested"``: ``NAME`` is a jagged ``torch.nested`` tensor (``layout=torch.jagged``).

:func:`collate_ragged` builds that batch from samples (``MemmapDataset(transform=)``: the
transformed samples are collated here, so a ragged column is batched as without a transform,
where ``default_collate`` would refuse records of different lengths). :func:`widen` pads a
padded batch to a larger width and :func:`nest` builds a jagged tensor from rows: the merge of
:class:`~feedpipe.MixedDataset` uses them when its members' batches have different widths.
Everything else in a sample goes through ``default_collate`` unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

__all__ = ["collate_ragged", "lengths_key", "nest", "widen"]


def lengths_key(name: str) -> str:
    """The side key holding ``name``'s rows per record in ``"pad"`` mode."""
    return f"{name}_lengths"


def collate_ragged(
    samples: list[Any],
    ragged: Collection[str],
    mode: str,
    pad_value: Any,
    listed: Collection[str] = (),
    *,
    example: Any = None,
) -> Any:
    """``default_collate(samples)``, except that each ragged column (a name in ``ragged``;
    ``"data"`` for a sample that is itself a tensor) whose values are all tensors of at least
    one dimension is padded (``mode="pad"``, adding ``NAME_lengths``) or nested
    (``"nested"``), and each name in ``listed`` (``str`` and ``json`` columns) stays the list of
    its samples' values (unless a transform made them tensors), as the dataset's own batches
    are. With no samples: the batch of none shaped like ``example``'s (0-row tensors, padded
    columns of width 0, empty lists)."""
    collate = _Collator(ragged, listed, mode, pad_value)
    if samples:
        return collate(samples)
    if example is None:
        return default_collate(samples)
    return _no_rows(collate([example]))


@dataclass(frozen=True)
class _Collator:
    """One way to collate samples with ragged and listed columns (see :func:`collate_ragged`):
    a sample that is a tensor (the records), a mapping of columns, or anything else."""

    ragged: Collection[str]
    listed: Collection[str]
    mode: str
    pad_value: Any

    def __call__(self, samples: list[Any]) -> Any:
        first = samples[0]
        if isinstance(first, torch.Tensor):
            return self._records(samples)
        if isinstance(first, Mapping) and all(isinstance(s, Mapping) for s in samples):
            return self._columns(samples)
        return default_collate(samples)

    def _records(self, samples: list[Any]) -> Any:
        """Samples that are the records themselves: a ragged ``data`` column, or plain."""
        if "data" not in self.ragged or not _all_rows(samples):
            return default_collate(samples)
        got = _column("data", samples, self.mode, self.pad_value)
        return got["data"] if self.mode == "nested" else got

    def _columns(self, samples: list[Mapping[Any, Any]]) -> Any:
        """Samples that are mappings: ragged columns batched, listed ones kept as lists, the
        rest through ``default_collate``; the keys in the first sample's order."""
        first = samples[0]
        kinds = {k: self._kind(samples, k) for k in first}
        special = {k for k, kind in kinds.items() if kind != "rest"}
        if not special:
            return default_collate(samples)
        rest = default_collate([{k: v for k, v in s.items() if k not in special} for s in samples])
        out: dict[Any, Any] = {}
        for k, kind in kinds.items():
            if kind == "ragged":
                out.update(_column(k, [s[k] for s in samples], self.mode, self.pad_value))
            elif kind == "listed":
                out[k] = [s[k] for s in samples]
            elif k in rest:
                out[k] = rest[k]
        return out if type(first) is dict else type(first)(out)  # type: ignore[call-arg]

    def _kind(self, samples: list[Mapping[Any, Any]], key: Any) -> str:
        """How column ``key`` is batched: ``ragged`` (padded or nested), ``listed`` (a list of
        the samples' values) or ``rest`` (``default_collate``)."""
        if key in self.ragged and _all_rows([s.get(key) for s in samples]):
            return "ragged"
        if key in self.listed and _still_values(samples, key):
            return "listed"
        return "rest"


def _still_values(samples: list[Mapping[Any, Any]], key: Any) -> bool:
    """Every sample has ``key``, and not every value is a tensor (still a str/JSON value)."""
    if not all(key in s for s in samples):
        return False
    return not all(isinstance(s[key], torch.Tensor) for s in samples)


def _no_rows(batch: Any) -> Any:
    """``batch`` cut to no samples: tensors to 0 rows (a padded column also to width 0),
    nested tensors to 0 records, lists emptied, containers kept."""
    if isinstance(batch, torch.Tensor):
        if batch.is_nested:
            values = batch.values()[:0]
            return torch.nested.nested_tensor_from_jagged(values, torch.zeros(1, dtype=torch.int64))
        return batch[:0]
    if isinstance(batch, Mapping):
        out = {k: _no_rows(v) for k, v in batch.items()}
        for k, v in out.items():
            if isinstance(k, str) and lengths_key(k) in out and isinstance(v, torch.Tensor):
                out[k] = v[:, :0]
        return out if type(batch) is dict else type(batch)(out)  # type: ignore[call-arg]
    if isinstance(batch, tuple):
        items = [_no_rows(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    return []


def _all_rows(values: Sequence[Any]) -> bool:
    return all(isinstance(v, torch.Tensor) and v.ndim >= 1 and not v.is_nested for v in values)


def _column(name: str, rows: list[torch.Tensor], mode: str, pad_value: Any) -> dict[str, Any]:
    """One ragged column from its per-sample tensors (same dtype and trailing shape)."""
    ref = rows[0]
    for j, r in enumerate(rows):
        if r.dtype != ref.dtype or r.shape[1:] != ref.shape[1:]:
            raise ValueError(
                f"ragged column {name!r}: sample {j} is {r.dtype} with rows of "
                f"{tuple(r.shape[1:])}, sample 0 {ref.dtype} with rows of {tuple(ref.shape[1:])}"
            )
    if mode == "nested":
        return {name: nest(rows)}
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    width = int(lengths.max()) if len(rows) else 0
    padded = torch.full((len(rows), width, *ref.shape[1:]), pad_value, dtype=ref.dtype)
    for j, r in enumerate(rows):
        padded[j, : r.shape[0]] = r
    return {name: padded, lengths_key(name): lengths}


def nest(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor of ``rows`` (as ``MemmapDataset(ragged="nested")`` gives)."""
    sizes = torch.tensor([0, *(r.shape[0] for r in rows)], dtype=torch.int64)
    values = torch.cat([r.reshape(r.shape[0], *rows[0].shape[1:]) for r in rows])
    return torch.nested.nested_tensor_from_jagged(values, torch.cumsum(sizes, 0))


def widen(batch: torch.Tensor, width: int, pad_value: Any) -> torch.Tensor:
    """A padded ``(n, w, *shape)`` batch padded on to ``(n, width, *shape)``."""
    have = int(batch.shape[1])
    if have == width:
        return batch
    if have > width:
        raise ValueError(f"cannot narrow a padded batch from {have} to {width}")
    out = torch.full((batch.shape[0], width, *batch.shape[2:]), pad_value, dtype=batch.dtype)
    out[:, :have] = batch
    return out
