"""WebDataset ``.tar`` shards as a ``feedpipe convert`` source (read through ``TarDataset``).

Members are grouped into samples by key, as WebDataset does (``feedpipe.datasets.tar``). The
records field (``data_key``; else the first image field of the first sample, ``jpg``, ``png``...;
else its first field) is stored in the bytes layout, as each member's bytes. Every other field
must hold ASCII integers (WebDataset's ``cls``, ``label``, ``idx``) and becomes an ``int64`` side
field; any other field (``txt``, ``json``) is refused up front, naming the field: the typed
string columns are not available to this conversion yet. Every sample must hold the same fields.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from feedpipe.datasets.tar import TarDataset, expand_shards
from feedpipe.errors import DatasetError

__all__ = ["TarSource", "is_tar_source", "tar_shards"]

_IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")


def is_tar_source(path: str) -> bool:
    """Whether ``path`` names ``.tar`` shards (a shard, a brace pattern, or a folder of them)."""
    if path.endswith(".tar"):
        return True
    return os.path.isdir(path) and bool(glob.glob(os.path.join(path, "*.tar")))


def tar_shards(paths: Sequence[str]) -> list[str]:
    """The shards of paths, brace patterns and folders (their ``*.tar``, sorted)."""
    shards: list[str] = []
    for p in paths:
        if "://" not in p and os.path.isdir(p):
            shards += sorted(glob.glob(os.path.join(p, "*.tar")))
        else:
            shards += expand_shards(p)
    return shards


def _integer(text: bytes, field: str, key: str) -> int:
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise DatasetError(
            f"sample {key!r}: field {field!r} is not an integer ({text[:32]!r}); only integer "
            "fields (like .cls) can be side fields: choose the records field with data_key"
        ) from None


class TarSource:
    """The ``convert`` source protocol over ``TarDataset`` (see the module docstring)."""

    kind = "tar"
    records = True  # the data field's bytes are the records
    shape: tuple[int, ...] | None = None  # the bytes layout
    dtype = "uint8"

    def __init__(
        self, shards: list[str], data_key: str | None, storage_options: Mapping[str, Any]
    ) -> None:
        self.dataset = TarDataset(shards, storage_options=storage_options)
        self.length = len(self.dataset)
        if self.length == 0:
            raise DatasetError(f"{shards[0]}: no samples in the shards")
        first = self.dataset[0]
        names = [k for k in first if not k.startswith("__")]
        images = [n for n in names if n in _IMAGE_FIELDS]
        key = data_key or (images[0] if images else names[0])
        if key not in names:
            raise DatasetError(f"sample {first['__key__']!r} has no field {key!r} ({names})")
        self.key, self.side = key, [n for n in names if n != key]
        for name in self.side:
            _integer(first[name], name, first["__key__"])
        self.fields: dict[str, Any] = {n: ("int64", ()) for n in self.side}
        self.est_bytes = max(1, len(first[key]) * self.length)
        self.extra = {"source": {"kind": "tar", "paths": shards}}

    def fingerprint(self) -> Any:
        return ["tar", self.dataset.shards, self.length, self.key]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        records: list[bytes] = []
        cols: dict[str, list[int]] = {n: [] for n in self.side}
        for sample in self.dataset.__getitems__(range(a, b)):
            key = sample["__key__"]
            have = sorted(k for k in sample if not k.startswith("__"))
            if have != sorted([self.key, *self.side]):
                raise DatasetError(
                    f"sample {key!r} in {sample['__url__']}: fields {have}, expected "
                    f"{sorted([self.key, *self.side])} like the first sample"
                )
            records.append(sample[self.key])
            for name, col in cols.items():
                col.append(_integer(sample[name], name, key))
        return records, {n: np.asarray(v, dtype=np.int64) for n, v in cols.items()}
