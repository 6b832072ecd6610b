"""The DCP reader of a ckpt step: ``CkptStorageReader`` (public as ``ckpt.dcp.CkptStorageReader``)
and ``check_bytes_items``, the restore room's check of a DCP step's byte items.

It lives in the restore room so that the reader (``ckpt.restoring.reader``) can verify a step
written through DCP without importing ``ckpt.dcp``, whose writer commits through the save room.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt import _layout
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.restoring.dcp_items import (
    decode_metadata,
    load_bytes_item,
    safe_bytes,
)
from ckpt.saving import commit
from ckpt.saving.flatten import torch_dtype
from feedpipe.io import crc32c, readinto_exactly, to_hex

__all__ = ["CkptStorageReader", "check_bytes_items", "split_id"]


def split_id(checkpoint_id: str | os.PathLike[str] | None) -> tuple[Path, int] | None:
    """``DIR/step-N`` as ``(DIR, N)``; None stays None."""
    if checkpoint_id is None:
        return None
    path = Path(checkpoint_id)
    step = _layout.step_id(path.name)
    if step is None:
        raise CheckpointError(f"checkpoint_id {checkpoint_id!r} must name a DIR/step-N directory")
    return path.parent, step


class CkptStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a ckpt step directory written by :class:`CkptStorageWriter`.

    ``CkptStorageReader(DIR, step)``, ``CkptStorageReader("DIR/step-N")`` (a step directory) or
    ``CkptStorageReader(DIR)`` (its newest step) all work; so does ``checkpoint_id="DIR/step-N"``.

    Every chunk a rank reads is checked against the manifest's CRC32C (``verify=False`` skips
    that; sizes are still checked).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        step: int | None = None,
        *,
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.directory = Path(directory) if directory is not None else None
        self.step = step
        if step is None and directory is not None and (Path(directory) / fmt.MANIFEST).exists():
            self.directory, self.step = split_id(directory)  # type: ignore[misc]
        self.verify = verify
        self.storage_data: dict[MetadataIndex, dict[str, Any]] = {}
        self.files: dict[str, dict[str, Any]] = {}
        """The data files' records of the manifest, by name (set by ``read_metadata``)."""

    @property
    def path(self) -> Path:
        """The step directory being read."""
        if self.directory is None:
            raise CheckpointError("CkptStorageReader needs a directory (and a step)")
        latest = commit.steps(self.directory)  # also recovers a re-save a crash cut in two
        if self.step is None:
            if not latest:
                raise CheckpointError(f"{self.directory}: no committed checkpoints")
            self.step = latest[-1]
        return _layout.step_dir(self.directory, self.step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; ``checkpoint_id`` may name ``DIR/step-N``."""
        split = split_id(checkpoint_id)
        if split is not None:
            self.directory, self.step = split

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a committed ckpt step directory."""
        return (Path(checkpoint_id) / fmt.MANIFEST).is_file()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read and verify the manifest; return DCP's metadata stored in it."""
        path = self.path
        body = fmt.read_manifest(path)
        doc = body.get("metadata", {}).get("dcp")
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{path}: not a DCP checkpoint (no DCP metadata)")
        self.files = {rec["name"]: rec for rec in body["files"]}
        return decode_metadata(doc, str(path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **kw: Any) -> None:
        """Keep the item locations."""
        self.storage_data = dict(metadata.storage_data or {})
        if not self.files:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the chunks this rank needs once, verify them, hand each item to the planner."""
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            loc = self.storage_data[req.storage_index]
            per_file.setdefault(fmt.safe_relpath(loc["file"]), []).append(req)
        for name, reqs in per_file.items():
            rec = self.files.get(name)
            if rec is None:
                raise CorruptCheckpointError(f"{self.path}: {name} is not in the manifest")
            locs = [self.storage_data[r.storage_index] for r in reqs]
            lo = min(loc["offset"] for loc in locs)
            hi = max(loc["offset"] + loc["nbytes"] for loc in locs)
            base, data = self.read_chunks(rec, lo, hi)
            for req, loc in zip(reqs, locs, strict=True):
                raw = data[loc["offset"] - base : loc["offset"] - base + loc["nbytes"]]
                if req.type == LoadItemType.BYTE_IO:
                    where = f"{self.path}/{name}: item {req.storage_index.fqn!r}"
                    planner.load_bytes(req, safe_bytes(load_bytes_item(raw.numpy().data, where)))
                    continue
                shape = [int(d) for d in loc["shape"]]
                src = raw.view(torch_dtype(loc["dtype"])).view(shape) if raw.numel() else (
                    torch.empty(shape, dtype=torch_dtype(loc["dtype"]))
                )  # fmt: skip
                src = _narrow(src, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(
                        f"{self.path}/{name}: item {req.storage_index.fqn} has size "
                        f"{tuple(src.size())}, the plan expects {tuple(target.size())}"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def read_chunks(self, rec: dict[str, Any], lo: int, hi: int) -> tuple[int, torch.Tensor]:
        """Bytes ``[lo, hi)`` of a data file, widened to whole chunks, each verified."""
        path = fmt.inside(self.path, rec["name"])
        chunk = rec["chunk_bytes"]
        first, last = lo // chunk, max(lo, hi - 1) // chunk
        start, end = first * chunk, min((last + 1) * chunk, rec["size"])
        fd = fmt.open_data(path)  # never a symlink, FIFO or device
        try:
            if os.fstat(fd).st_size != rec["size"]:
                raise CorruptCheckpointError(
                    f"{path}: size {os.fstat(fd).st_size} != {rec['size']} bytes (truncated?)"
                )
            out = torch.empty(end - start, dtype=torch.uint8)
            view = out.numpy().data.cast("B")
            if readinto_exactly(fd, [view], start, len(view)) < len(view):
                raise CorruptCheckpointError(f"{path}: unexpected end of file")
        finally:
            os.close(fd)
        if self.verify:
            for i in range(first, last + 1):
                piece = view[i * chunk - start : min((i + 1) * chunk, rec["size"]) - start]
                actual = to_hex(crc32c(piece))
                if actual != rec["crc32c"][i]:
                    raise CorruptCheckpointError(
                        f"{path}: checksum mismatch in chunk {i}: {actual} != {rec['crc32c'][i]}"
                    )
        return start, out


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or n != t.size(dim):
            t = t.narrow(dim, off, n)
    return t


def check_bytes_items(path: str | os.PathLike[str]) -> int:
    """Load every byte item of the DCP step ``path`` the way a load would (``weights_only=True``,
    chunks verified); returns how many there are. Raises ``CorruptCheckpointError`` naming the
    item that would not load safely."""
    reader = CkptStorageReader(path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    count = 0
    for index, loc in reader.storage_data.items():
        if loc.get("kind") != "bytes":
            continue
        name = fmt.safe_relpath(loc["file"])
        rec = reader.files.get(name)
        if rec is None:
            raise CorruptCheckpointError(f"{reader.path}: {name} is not in the manifest")
        off, n = int(loc["offset"]), int(loc["nbytes"])
        base, data = reader.read_chunks(rec, off, off + n)
        load_bytes_item(
            data[off - base : off - base + n].numpy().data,
            f"{reader.path}/{name}: item {index.fqn!r}",
        )
        count += 1
    return count
