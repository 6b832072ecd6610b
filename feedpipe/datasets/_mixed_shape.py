"""What each list of a member's batch is, for :mod:`._mixed_merge`: a per-sample list (strings,
JSON values, records of varying size) or a list of collated fields (``default_collate`` of tuple
samples). The merge is told, never guesses from values: a list of JSON dicts whose lists have as
many items as the part has samples looks like collated fields, and is not.

A member's *shape* mirrors its batch: a ``dict`` for a mapping (its keys' shapes), a ``tuple``
for a list of collated fields (each field's shape), ``None`` where no list at or below is a
list of fields. It comes from two places:

- the member's declaration: ``per_sample_keys()`` (``MemmapDataset`` has it) names the keys of
  its batches that are per-sample lists (``str``, ``json``, bytes columns), whatever their
  values; None: not declared (a ``batch_transform`` decides);
- for the rest, the structure of one of its samples under ``default_collate``'s rules (what
  ``read_batch`` returns by the dataset contract): a sequence sample is collated into a list of
  fields, a mapping into a mapping; anything else (a tensor, a number, a string, None) is never
  a list of fields. A member's samples keep one structure (``default_collate`` needs it too):
  the sample is read once per member and ``transform``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MemberShapes", "sample_shape"]

Shape = Any  # dict[Any, Shape] | tuple[Shape, ...] | None


def sample_shape(sample: Any) -> Shape:
    """The shape of the batch ``default_collate`` makes of samples like ``sample``."""
    if isinstance(sample, Mapping):
        return {k: sample_shape(v) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return tuple(sample_shape(v) for v in sample)
    return None


def _declared(ds: Any) -> frozenset[Any] | None:
    """The keys ``ds`` declares per-sample lists in its batches (None: none declared)."""
    get = getattr(ds, "per_sample_keys", None)
    keys = get() if callable(get) else None
    return None if keys is None else frozenset(keys)


class MemberShapes:
    """The shapes of a mix's members (cached per member and ``transform``: see the module)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], tuple[Any, Shape]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_seen": {}}  # the transforms seen need not pickle: read again where unpickled

    def of(self, k: int, ds: Any, sample: int) -> Shape:
        """Member ``k`` (``ds``)'s batch shape; ``sample``: one of its samples to read if its
        shape is not known yet."""
        transform = getattr(ds, "transform", None)
        key = (k, id(transform))
        seen = self._seen.get(key)
        if seen is None or seen[0] is not transform:
            if len(self._seen) > 256:
                self._seen.clear()
            seen = self._seen[key] = (transform, sample_shape(ds[sample]))  # held: no id reuse
        shape = seen[1]
        listed = _declared(ds)
        if listed and isinstance(shape, dict):
            shape = {key: None if key in listed else s for key, s in shape.items()}
        return shape
