"""DCP's stored pieces, read without pickle: its metadata as JSON and its byte items.

DCP pickles its ``.metadata``; ckpt stores it as JSON (``encode_metadata``/``decode_metadata``)
and never unpickles. A byte item (a non-tensor leaf, ``torch.save``-d by DCP's planner) is
loaded only by ``load_bytes_item`` (``torch.load(weights_only=True)``, after bounding its
archive); the planner then gets a fresh serialization of the safe object (``safe_bytes``).
Used by ``ckpt.dcp`` (its writer refuses what could not be read back) and its reader.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.saving.flatten import torch_dtype

__all__ = ["decode_metadata", "dtype_name", "encode_metadata", "load_bytes_item", "safe_bytes"]


def load_bytes_item(raw: bytes | memoryview, where: str) -> Any:
    """Load one stored byte item with ``torch.load(weights_only=True)`` (never runs code);
    anything outside the allow-list is a ``CorruptCheckpointError`` naming ``where``. Only the
    zip archive ``torch.save`` writes, with stored (uncompressed) entries, is accepted: a loaded
    item never takes more memory than its stored bytes (no zip bomb, no legacy-format sizes)."""
    _check_archive(raw, where)
    try:
        return torch.load(io.BytesIO(bytes(raw)), weights_only=True, map_location="cpu")
    except Exception as exc:
        lines = str(exc).splitlines() or [repr(exc)]
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0]).strip()
        raise CorruptCheckpointError(
            f"{where}: byte item cannot be loaded safely (torch.load(weights_only=True) refused "
            f"it; ckpt never unpickles arbitrary objects): {why}"
        ) from None


def _check_archive(raw: bytes | memoryview, where: str) -> None:
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CorruptCheckpointError(
            f"{where}: byte item is not a torch.save zip archive ({exc})"
        ) from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(raw):
            raise CorruptCheckpointError(
                f"{where}: byte item entry {info.filename!r} is compressed or larger than the "
                "item (torch.save stores entries uncompressed; refused to bound memory)"
            )


def safe_bytes(obj: Any) -> io.BytesIO:
    """A fresh ``torch.save`` of an object that ``load_bytes_item`` produced, for the planner."""
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _keys(value: Any, what: str) -> list[Any]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(k, (str, int)) for k in value):
        raise CheckpointError(f"DCP planner data {what} is not a tuple of str/int keys")
    return list(value)


def encode_metadata(md: Metadata) -> dict[str, Any]:
    """DCP ``Metadata`` as a JSON-able dict (tensor/bytes entries, planner mappings, locations)."""
    entries: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
        else:
            entries[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(item.properties.dtype),
                "requires_grad": bool(item.properties.requires_grad),
                "size": list(item.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks],
            }
    planner = md.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise CheckpointError("DCP planner data must be a dict of fqn -> key path to store it")
    storage = [
        [i.fqn, None if i.offset is None else list(i.offset), i.index, loc]
        for i, loc in (md.storage_data or {}).items()
    ]
    return {
        "entries": entries,
        "planner_data": {k: _keys(v, k) for k, v in (planner or {}).items()},
        "storage_data": storage,
        "version": getattr(md, "version", None),
    }


def decode_metadata(doc: dict[str, Any], where: str = "") -> Metadata:
    """The inverse of :func:`encode_metadata`; a ``CorruptCheckpointError`` names ``where``."""
    try:
        sd: dict[str, Any] = {}
        for fqn, e in doc["entries"].items():
            if e["type"] == "bytes":
                sd[fqn] = BytesStorageMetadata()
                continue
            sd[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=torch_dtype(e["dtype"]), requires_grad=bool(e["requires_grad"])
                ),
                size=torch.Size(int(d) for d in e["size"]),
                chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in e["chunks"]],
            )
        storage = {
            MetadataIndex(fqn, None if off is None else torch.Size(off), idx): dict(loc)
            for fqn, off, idx, loc in doc["storage_data"]
        }
        planner = {k: tuple(v) for k, v in doc["planner_data"].items()}
        md = Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage)
        if doc.get("version") is not None:
            md.version = doc["version"]
        return md
    except (KeyError, TypeError, ValueError, CheckpointError) as exc:
        raise CorruptCheckpointError(f"{where}: DCP metadata is malformed: {exc!r}") from None
