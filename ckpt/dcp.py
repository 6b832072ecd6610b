"""``torch.distributed.checkpoint`` (DCP) storage backed by ckpt: its format, checksums, commit.

``dcp.save/async_save(state, storage_writer=CkptStorageWriter(DIR, step))`` and
``dcp.load(state, storage_reader=CkptStorageReader(DIR, step))``: DCP's planners decide what each
rank writes and reads (so resharding to another world size comes for free); ckpt decides where
and how:

- every rank writes only its own items into one data file ``rank-<r>.bin`` inside a shared
  ``DIR/step-N.tmp-dcp-*`` directory (CRC32C per chunk, fsynced), with ``write_data`` returning
  each item's location;
- after every rank has written (DCP gathers the results to the coordinator), the coordinator
  writes one ``manifest.json`` listing every rank's file and DCP's metadata as JSON (no pickle),
  renames the directory to ``DIR/step-N`` and updates ``latest``: one global commit;
- with ``manager=`` (the coordinator's ``CheckpointManager`` on ``DIR``), the committed step goes
  through the manager's post-commit path: remote upload, tier-aware retention;
- the writer is DCP's ``AsyncStager``: ``dcp.async_save`` stages the state into ckpt's reusable
  (pinned when CUDA is present) pool instead of fresh allocations.

Run DCP's collectives on a group of their own (``checkpoint_group()``: gloo), so that a background
``async_save`` cannot deadlock with training collectives.

Byte items (non-tensor leaves) are serialized by DCP's planner with ``torch.save``. No stored byte
ever reaches an unpickler that can run code: the writer refuses an item that
``torch.load(weights_only=True)`` cannot read back (so a save that could not be loaded safely
fails at once, naming the item), and the reader loads each item itself with
``weights_only=True`` (an allow-list of plain types and tensors) and hands the planner a fresh
serialization of that safe object, never the stored bytes (DCP's ``load_bytes`` calls
``torch.load(weights_only=False)``). A hostile item is a ``CorruptCheckpointError``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckpt import _layout, _owner
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.format.entries import pack
from ckpt.restoring.dcp_items import (
    decode_metadata,
    dtype_name,
    encode_metadata,
    load_bytes_item,
)
from ckpt.restoring.dcp_reader import CkptStorageReader, check_bytes_items, split_id
from ckpt.saving import commit
from ckpt.saving.pool import Buffer, PinnedPool, PoolOptions

__all__ = [
    "CkptStorageReader",
    "CkptStorageWriter",
    "CommitOwner",
    "check_bytes_items",
    "checkpoint_group",
    "decode_metadata",
    "encode_metadata",
    "load_bytes_item",
]


class CommitOwner(Protocol):
    """What ``CkptStorageWriter(manager=)`` needs of its manager (a ``CheckpointManager``):
    take the directory's writer lock before any rank writes, and run the post-commit path
    (upload, retention) for a step committed by the coordinator."""

    def ensure_writer(self) -> None: ...

    def adopt(self, step: int) -> None: ...


_group: Any = None
_group_lock = threading.Lock()


def checkpoint_group() -> Any:
    """A gloo process group for checkpoint collectives only (created once, on every rank)."""
    global _group
    with _group_lock:
        if _group is None:
            _group = dist.new_group(backend="gloo")
        return _group


# ---- writing -------------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().data


class CkptStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) writing ckpt step directories (module doc).

    ``directory``/``step``: where (``CkptStorageWriter("DIR/step-N")`` and
    ``checkpoint_id="DIR/step-N"`` work too). ``manager``: the
    coordinator's ``CheckpointManager`` on ``directory`` (upload, retention); ``pool``: sizing of
    the staging pool used by ``async_save``; ``chunk_bytes``: checksum chunk size.
    """

    _synchronize_after_execute = True  # AsyncStager: stage() returns a finished copy

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        step: int | None = None,
        *,
        manager: CommitOwner | None = None,
        pool: PoolOptions | None = None,
        chunk_bytes: int = fmt.CHUNK_BYTES,
    ) -> None:
        super().__init__()
        self.directory = Path(directory) if directory is not None else None
        self.step = step
        if (
            step is None
            and directory is not None
            and _layout.step_id(Path(directory).name) is not None
        ):
            self.directory, self.step = split_id(directory)  # type: ignore[misc]
        self.manager = manager
        self.chunk_bytes = chunk_bytes
        self.pool = PinnedPool(pool)
        self.is_coordinator = False
        self.rank = 0
        self.committed: Path | None = None
        self._staged: deque[Buffer] = deque()
        self._tmp = ""

    # StorageWriter ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new checkpoint; ``checkpoint_id`` may name ``DIR/step-N``."""
        split = split_id(checkpoint_id)
        if split is not None:
            self.directory, self.step = split
        self.committed = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a ``DIR/step-N`` directory."""
        return _layout.step_id(Path(checkpoint_id).name) is not None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record the role; the coordinator takes the directory's writer lock (via ``manager``)."""
        if self.directory is None or self.step is None:
            raise CheckpointError("CkptStorageWriter needs a directory and a step")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0))
        self.directory.mkdir(parents=True, exist_ok=True)
        if is_coordinator and self.manager is not None:
            self.manager.ensure_writer()  # leftovers are cleaned before any rank writes
        elif is_coordinator:  # refuse another tool's directory before any rank writes into it
            _owner.claim_root(self.directory)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Unchanged: DCP's planner decides what this rank writes."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give every rank the shared temporary directory and its file name."""
        assert self.step is not None  # set_up_storage_writer refuses a writer without one
        tmp = _layout.tmp_name(_layout.step_name(self.step), "dcp")
        self._tmp = tmp
        return [
            dataclasses.replace(p, storage_data={"tmp": tmp, "file": _layout.rank_file(i)})
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into one checksummed, fsynced data file."""
        assert self.directory is not None
        try:
            results = self._write(plan, planner)
        finally:
            if self._staged:
                self.pool.release(self._staged.popleft())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        assert self.directory is not None and self.step is not None
        info = plan.storage_data
        tmp = self.directory / info["tmp"]
        tmp.mkdir(exist_ok=True)
        results: list[WriteResult] = []
        if not plan.items:
            return results
        out = fmt.ChunkedWriter(tmp / info["file"], self.chunk_bytes)
        try:
            for item in plan.items:
                out.pad(fmt.ALIGN)
                offset = out.size
                data = planner.resolve_data(item)
                loc: dict[str, Any] = {"file": info["file"], "offset": offset}
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    raw = data.getvalue()
                    where = (
                        f"{_layout.step_dir(self.directory, self.step)}: item {item.index.fqn!r}"
                    )
                    try:  # refuse now what a load could not read back without pickle
                        load_bytes_item(raw, where)
                    except CorruptCheckpointError as exc:
                        raise CheckpointError(
                            f"{exc}; it cannot be stored without pickle"
                        ) from None
                    out.write(memoryview(raw))
                    loc["kind"] = "bytes"
                else:
                    assert isinstance(data, torch.Tensor)
                    out.write(_raw(data))
                    loc.update(kind="tensor", dtype=dtype_name(data.dtype), shape=list(data.shape))
                loc["nbytes"] = out.size - offset
                results.append(WriteResult(item.index, loc["nbytes"], loc))
        finally:
            rec = out.close()
        results[0].storage_data["file_record"] = rec  # the coordinator builds the manifest
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The global commit: manifest (every rank's file), rename to ``step-N``, ``latest``."""
        assert self.directory is not None and self.step is not None
        files = []
        for rank_results in results:
            for wr in rank_results:
                rec = wr.storage_data.pop("file_record", None)
                if rec is not None:
                    files.append(rec)
        metadata.storage_data = {wr.index: wr.storage_data for rr in results for wr in rr}
        tmp = self.directory / self._tmp
        tmp.mkdir(exist_ok=True)
        body = fmt.new_manifest(
            step=self.step,
            created=time.time(),
            nbytes=sum(r["size"] for r in files),
            tree={"t": "dict", "items": []},
            entries=[],
            files=sorted(files, key=lambda r: r["name"]),
            metadata={"dcp": encode_metadata(metadata)},
        )
        fmt.write_manifest(tmp, body)
        self.committed = commit.publish(tmp, self.directory, self.step)
        commit.write_latest(self.directory, self.step)
        if self.manager is not None:
            self.manager.adopt(self.step)

    # AsyncStager ------------------------------------------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        """``stage`` finishes its copy before returning: nothing to synchronize."""
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy every tensor (DTensor local shards included) into one reused pool buffer and
        return the same structure over that copy (training may mutate the original at once)."""
        tensors: list[torch.Tensor] = []
        _collect(state_dict, tensors)
        offsets, total = pack(t.numel() * t.element_size() for t in tensors)
        buf, _ = self.pool.acquire(total)
        self._staged.append(buf)
        staged = []
        for t, off in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            dst = buf.tensor[off : off + n].view(t.dtype).view(t.shape)
            dst.copy_(t.detach(), non_blocking=t.is_cuda)
            staged.append(dst)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        return _rebuild(state_dict, iter(staged))  # type: ignore[no-any-return]

    def synchronize_staging(self) -> None:
        """Nothing to wait for (``stage`` is synchronous)."""

    def close(self) -> None:
        """Nothing to release beyond the pool (freed with the writer)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(_local(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, staged: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced by ``staged`` (in ``_collect``'s traversal order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return DTensor.from_local(
            next(staged), obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
            stride=obj.stride(),
        )  # fmt: skip
    if isinstance(obj, torch.Tensor):
        return next(staged)
    if isinstance(obj, dict):
        return {k: _rebuild(v, staged) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, staged) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, staged) for v in obj)
    return obj


# ---- reading ---------------------------------------------------------------------------------
