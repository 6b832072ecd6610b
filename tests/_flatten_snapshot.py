"""A flatten's whole result as comparable values (tree JSON; each leaf's facts and bytes), for
the tests that prove ckpt's flatten cache and its structure fast path against a plain
``ckpt.saving.flatten.flatten``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from ckpt.saving.flatten import Leaf, flatten
from ckpt.saving.flatten_cache import FlattenCache

__all__ = ["leaf_bytes", "same", "snap"]


def leaf_bytes(leaf: Leaf) -> bytes:
    """The bytes a leaf's value holds, in row-major order."""
    v = leaf.value
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v).tobytes()
    flat = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return flat.clone().numpy().tobytes()  # a copy: numpy on its storage pins its size


def snap(state: Any, cache: FlattenCache | None = None) -> tuple[str, list[Any]]:
    """``state`` flattened (through ``cache`` if given): its tree and each leaf's facts."""
    leaves: list[Leaf] = []
    tree = cache.flatten(state, leaves) if cache is not None else flatten(state, leaves)
    records = [
        (x.kind, x.dtype, x.shape, x.nbytes, x.path, x.device, tuple(x.stride), leaf_bytes(x))
        for x in leaves
    ]
    return json.dumps(tree, sort_keys=True), records


def same(state: Any, cache: FlattenCache) -> None:
    """Assert that ``cache`` flattens ``state`` exactly as an uncached flatten does."""
    assert snap(state, cache) == snap(state)
