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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckpt import _layout, _owner
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.restoring.dcp_items import (
    decode_metadata,
    dtype_name,
    encode_metadata,
    load_bytes_item,
    safe_bytes,
)
from ckpt.saving import commit
from ckpt.saving.flatten import torch_dtype
from ckpt.saving.plan import pack
from ckpt.saving.pool import Buffer, PinnedPool, PoolOptions
from feedpipe.io import crc32c, readinto_exactly, to_hex

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


def _split_id(checkpoint_id: str | os.PathLike[str] | None) -> tuple[Path, int] | None:
    if checkpoint_id is None:
        return None
    path = Path(checkpoint_id)
    step = _layout.step_id(path.name)
    if step is None:
        raise CheckpointError(f"checkpoint_id {checkpoint_id!r} must name a DIR/step-N directory")
    return path.parent, step


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
            self.directory, self.step = _split_id(directory)  # type: ignore[misc]
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
        split = _split_id(checkpoint_id)
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
            self.directory, self.step = _split_id(directory)  # type: ignore[misc]
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
        split = _split_id(checkpoint_id)
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
