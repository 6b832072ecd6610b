"""WebDataset ``.tar`` shards as a ``feedpipe convert`` source (read through ``TarDataset``).

Members are grouped into samples by key, as WebDataset does (``feedpipe.datasets.tar``). The
records field (``data_key``; else the first image field of the first sample, ``jpg``, ``png``...;
else its first field) is stored in the bytes layout, as each member's bytes. Every other field
becomes a typed side field, its type decided by its extension (the field name's last part), as
WebDataset's decoders do: ``txt``/``text`` a ``"str"`` column (UTF-8), ``json``/``jsn`` a
``"json"`` column, ``cls``/``cls2``/``index``/``label``/``idx``/``id`` an ``int64`` field (ASCII
integers), any other extension a bytes column (``("uint8", (None,))``). A member that does not
decode (invalid UTF-8 or JSON, a non-integer ``cls``) is a ``DatasetError`` naming the shard and
the member. Every sample must hold the same fields.

Each sample's WebDataset key is kept as the ``"str"`` column ``__key__`` (:data:`KEY_FIELD`),
so ``ds[i]["__key__"]`` is the key WebDataset gives that sample and a batch holds the list of
its keys. (The shard a sample came from is in the index's ``extra.source``.)
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from feedpipe.datasets.columns import encode, loads_json
from feedpipe.datasets.record_source import Source
from feedpipe.datasets.tar import TarDataset, expand_shards
from feedpipe.errors import DatasetError
from feedpipe.io.remote import is_url

__all__ = ["KEY_FIELD", "SampleFields", "TarSource", "is_tar_source", "tar_shards"]

#: The side field that keeps each sample's WebDataset ``__key__`` (a ``"str"`` column).
KEY_FIELD = "__key__"

_IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")
_TEXT = ("txt", "text")
_JSON = ("json", "jsn")
_INTEGER = ("cls", "cls2", "index", "label", "idx", "id")


def is_tar_source(path: str) -> bool:
    """Whether ``path`` names ``.tar`` shards (a shard, a brace pattern, or a folder of them)."""
    if path.endswith(".tar"):
        return True
    return os.path.isdir(path) and bool(glob.glob(os.path.join(path, "*.tar")))


def tar_shards(paths: Sequence[str]) -> list[str]:
    """The shards of paths, brace patterns and folders (their ``*.tar``, sorted)."""
    shards: list[str] = []
    for p in paths:
        if not is_url(p) and os.path.isdir(p):
            shards += sorted(glob.glob(os.path.join(p, "*.tar")))
        else:
            shards += expand_shards(p)
    return shards


def _spec(field: str) -> Any:
    """The side-field spec for a field, by its extension (see the module docstring)."""
    ext = field.rsplit(".", 1)[-1].lower()
    if ext in _TEXT:
        return "str"
    if ext in _JSON:
        return "json"
    if ext in _INTEGER:
        return "int64"
    return ("uint8", (None,))


def _decode(spec: Any, raw: bytes, field: str, sample: Mapping[str, Any]) -> Any:
    """One member's value for its column; ``DatasetError`` naming the shard and the member."""
    where = f"{sample.get('__url__', '?')}: member {sample['__key__'] + '.' + field!r}"
    try:
        if spec == "str":
            return raw.decode("utf-8")
        if spec == "json":
            value = loads_json(raw.decode("utf-8"))
            encode("json", "uint8", (), value, where)  # what would not read back equal
            return value
        if spec == "int64":
            value = int(raw.decode("ascii").strip())
            if not -(2**63) <= value < 2**63:
                raise ValueError("out of the int64 range")
            return value
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"{where} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    except ValueError as exc:
        what = "JSON" if spec == "json" else "an integer"
        raise DatasetError(f"{where} is not {what} ({raw[:32]!r}): {exc}") from None
    return raw


def _check_side_name(first: Mapping[str, Any], name: str) -> None:
    if not name.isidentifier() or name in ("data", "offsets"):
        raise DatasetError(
            f"{first['__url__']}: member {first['__key__'] + '.' + name!r}: field "
            f"{name!r} cannot name a side field (a Python identifier other than "
            "'data' and 'offsets'): choose it as the records field with data_key"
        )


class SampleFields:
    """The fields every sample holds, decided by the first: the records field (``key``) and
    the typed side fields (``side``, their specs in ``specs`` with :data:`KEY_FIELD`)."""

    def __init__(self, first: Mapping[str, Any], data_key: str | None) -> None:
        names = [k for k in first if not k.startswith("__")]
        images = [n for n in names if n in _IMAGE_FIELDS]
        key = data_key or (images[0] if images else names[0])
        if key not in names:
            raise DatasetError(f"sample {first['__key__']!r} has no field {key!r} ({names})")
        self.key, self.side = key, [n for n in names if n != key]
        for name in self.side:
            _check_side_name(first, name)
        self.specs: dict[str, Any] = {KEY_FIELD: "str", **{n: _spec(n) for n in self.side}}
        for name in self.side:
            _decode(self.specs[name], first[name], name, first)

    def check(self, sample: Mapping[str, Any]) -> None:
        """Refuse a sample whose fields are not the first sample's."""
        have = sorted(k for k in sample if not k.startswith("__"))
        if have != sorted([self.key, *self.side]):
            raise DatasetError(
                f"sample {sample['__key__']!r} in {sample['__url__']}: fields {have}, expected "
                f"{sorted([self.key, *self.side])} like the first sample"
            )


class TarSource(Source):
    """The ``convert`` source protocol over ``TarDataset`` (see the module docstring)."""

    kind = "tar"
    records = True  # the data field's bytes are the records
    shape = None  # the bytes layout
    dtype = "uint8"

    def __init__(
        self, shards: list[str], data_key: str | None, storage_options: Mapping[str, Any]
    ) -> None:
        self.dataset = TarDataset(shards, storage_options=storage_options)
        self.length = len(self.dataset)
        if self.length == 0:
            raise DatasetError(f"{shards[0]}: no samples in the shards")
        first = self.dataset[0]
        self.layout = SampleFields(first, data_key)
        self.key, self.side, self.fields = self.layout.key, self.layout.side, self.layout.specs
        per_sample = sum(len(first[n]) for n in [self.key, *self.side]) + len(first["__key__"])
        self.est_bytes = max(1, per_sample * self.length)
        self.extra = {"source": {"kind": "tar", "paths": shards}}

    def fingerprint(self) -> Any:
        return ["tar", self.dataset.shards, self.length, self.key, sorted(self.fields)]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, Any]]:
        records: list[bytes] = []
        cols: dict[str, list[Any]] = {n: [] for n in self.side}
        keys: list[str] = []
        for sample in self.dataset.__getitems__(range(a, b)):
            keys.append(sample["__key__"])
            self.layout.check(sample)
            records.append(sample[self.key])
            for name, col in cols.items():
                col.append(_decode(self.fields[name], sample[name], name, sample))
        return records, {
            KEY_FIELD: keys,
            **{
                n: np.asarray(v, dtype=np.int64) if self.fields[n] == "int64" else v
                for n, v in cols.items()
            },
        }
