"""Reading one checkpoint directory back: manifest, verified data files, the nested state."""

from __future__ import annotations

import errno
import logging
import os
import time
import warnings
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError, DcpCheckpointError
from ckpt.restoring.plan import IncompatibleKeys, RestorePlan
from ckpt.restoring.read_into import read_into, reader_threads, verify_threads
from ckpt.saving.flatten import torch_dtype, unflatten
from ckpt.saving.plan import BATCHED_DTYPES, foreach_copy_exact

__all__ = [
    "DEVICE_SCRATCH_SHARE",
    "MapLocation",
    "RestoreStats",
    "read_checkpoint",
    "verify_step",
]

log = logging.getLogger("ckpt")

MapLocation = Union[str, torch.device, None]  # noqa: UP007 (a runtime alias on 3.10)

DEVICE_SCRATCH_SHARE = 0.5
"""The largest share of a device's free memory that a restore into existing CUDA tensors
borrows, for the time of the restore, to read the checkpoint once (see ``read_checkpoint``)."""


@dataclass
class RestoreStats:
    """What a restore did: bytes, seconds reading and checksumming, steps skipped and why."""

    step: int | None = None
    path: str = ""
    nbytes: int = 0
    read_s: float = 0.0
    verify_s: float = 0.0
    verified: bool = False
    mmap: bool = False
    passes: int = 1  # how often the data files were read: 2 = verified first, then read again
    skipped: list[tuple[int, str]] = field(default_factory=list)
    incompatible_keys: IncompatibleKeys = field(default_factory=lambda: IncompatibleKeys([], []))
    """Keys a ``restore(into=, strict=False)`` skipped (``ckpt.restore_plan``)."""


def _device(
    entry: dict[str, Any], map_location: MapLocation, path: Path, moved: set[str]
) -> torch.device:
    """Where an entry goes: ``map_location`` if given; else where it was saved, or (when that
    device does not exist here) the current CUDA device or the CPU, noted in ``moved``."""
    if map_location is not None:
        try:
            device = torch.device(map_location)
        except (RuntimeError, TypeError) as exc:
            raise CheckpointError(f"{path}: map_location={map_location!r}: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CheckpointError(f"{path}: map_location={map_location!r}: CUDA is not available")
        return device
    saved = torch.device(entry.get("device", "cpu"))
    if saved.type == "cpu":
        return saved
    if saved.type == "cuda" and torch.cuda.is_available():
        if saved.index is None or saved.index < torch.cuda.device_count():
            return saved
        here = torch.device("cuda", torch.cuda.current_device())
    elif saved.type == "mps" and torch.backends.mps.is_available():
        return saved
    else:
        here = torch.device("cpu")
    moved.add(f"{saved} -> {here}")
    return here


def _place(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    return value if device.type == "cpu" else value.to(device)


def _place_all(
    arrays: list[Any], body: dict[str, Any], map_location: MapLocation, path: Path, moved: set[str]
) -> None:
    """Move the mapped tensors to their devices (``_device``)."""
    for i, entry in enumerate(body["entries"]):
        if entry["kind"] == "tensor":
            arrays[i] = _place(arrays[i], _device(entry, map_location, path, moved))


def _warn_moved(path: Path, moved: set[str]) -> None:
    if moved:
        msg = (
            f"{path}: tensors saved on devices that do not exist here were mapped "
            f"({', '.join(sorted(moved))}); pass map_location to choose"
        )
        warnings.warn(msg, UserWarning, stacklevel=3)
        log.warning("ckpt: %s", msg)


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    mmap: bool = False,
    verify: bool = True,
    executor: Executor | None = None,
    into: Any = None,
    strict: bool = True,
) -> tuple[Any, dict[str, Any], RestoreStats]:
    """Load the checkpoint in directory ``path``; returns (state, manifest body, stats).

    Memory: each tensor is allocated once, on its final device, and filled piece by piece by
    ``reader_threads()`` threads reading in parallel (``ckpt.restoring.read_into``); the extra
    host memory is one ``READ_BYTES`` buffer per thread, plus two pinned ``READ_BYTES`` slots per
    thread when tensors go to CUDA.

    With ``into``, a ``RestorePlan`` (``ckpt.restore_plan``) is built first and refuses a
    mismatch (keys per ``strict``, shapes, dtypes, writability) before anything is read; then
    the files are read (and checked) into new tensors, except the plan's direct targets; the
    plan checks and loads; the direct targets are filled (``_Step.fill``: a second pass that
    checks every chunk again, or a device copy of tensors read in the first pass when they fit
    in ``DEVICE_SCRATCH_SHARE`` of their devices' free memory); the plan finishes. Raises
    ``CorruptCheckpointError`` naming the file if the manifest or a data file is bad, and
    ``CheckpointError`` (before anything is written) if the state does not fit ``into``."""
    path = Path(path)
    t0 = time.perf_counter()
    body, fds = _open_step(path)  # every pass reads (and a mapping maps) the files opened here
    own = executor is None
    pool: Executor | None = None
    moved: set[str] = set()
    try:
        stats = RestoreStats(step=body.get("step"), path=str(path), verified=verify, mmap=mmap)
        stats.nbytes = sum(rec["size"] for rec in body["files"])
        pool = executor or ThreadPoolExecutor(reader_threads(), thread_name_prefix="ckpt-read")
        plan = RestorePlan.build(body, into, str(path), strict) if into is not None else None
        step: _Step | None = None
        if mmap:
            arrays = _read_mmap(path, body, verify, stats, fds=fds, executor=executor)
            _place_all(arrays, body, map_location, path, moved)
        else:
            step = _Step(path, body, fds, pool, executor, stats, verify)
            arrays = step.read(plan, map_location, moved)
        if plan is not None:  # the writes, once every file was read and checked
            plan.check(arrays)
            with plan.loading(arrays):  # undone if a later step fails
                if step is not None:
                    step.fill(arrays)  # the direct targets
                plan.finish(arrays)
    finally:
        if own and pool is not None:
            pool.shutdown()
        for fd in fds.values():
            os.close(fd)
    _warn_moved(path, moved)
    state = unflatten(body["tree"], arrays)
    if plan is not None:
        stats.incompatible_keys = plan.incompatible_keys
    stats.read_s = time.perf_counter() - t0
    return state, body, stats


@dataclass
class _Step:
    """One step directory being read: its manifest, open files, readers and stats."""

    path: Path
    body: dict[str, Any]
    fds: dict[str, int]
    pool: Executor
    executor: Executor | None
    stats: RestoreStats
    verify: bool
    found: dict[int, torch.Tensor] = field(default_factory=dict)  # the direct targets
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # read into first, on device
    later: dict[str, list[fmt.Target]] = field(default_factory=dict)  # the second pass

    def read(
        self, plan: RestorePlan | None, map_location: MapLocation, moved: set[str]
    ) -> list[Any]:
        """Read every entry, except the ``plan``'s direct targets (``plan.direct``): those are
        read by ``fill`` after the plan's checks and loads, from device scratch tensors read in
        this pass when they fit, else by a second pass over the files."""
        body, stats = self.body, self.stats
        self.found = plan.direct if plan is not None else {}
        self.scratch = _device_scratch(self.found) if self.verify else {}
        arrays, dests = _allocate(
            body, self.scratch, self.found, map_location, path=self.path, moved=moved
        )
        self.later = {} if self.scratch or plan is None else plan.direct_ranges(body)
        stats.passes = 2 if self.later else 1
        if self.later and self.verify and not any(dests.values()):  # the first pass only checks
            _verify_files(self.path, body, self.executor, stats, self.fds)
        else:
            self.files(dests)
        return arrays

    def fill(self, arrays: list[Any]) -> None:
        """Fill the direct targets (the caller's tensors: after every check and load)."""
        self.files(self.later)
        _copy_into(self.found if self.scratch else {}, self.scratch, arrays)
        for i, t in self.found.items():
            arrays[i] = t

    def files(self, dests: dict[str, list[fmt.Target]]) -> None:
        """Read the files into the byte ranges ``dests`` (checking every chunk if ``verify``)."""
        for rec in self.body["files"]:
            name = rec["name"]
            if name in dests:
                self.stats.verify_s += read_into(
                    self.path, rec, dests[name], self.verify, self.pool, fd=self.fds[name]
                )


STEP_REREADS = 5
"""How often ``read_checkpoint`` reads a step again whose directory was replaced (a re-save)
while its manifest was read and its data files opened."""


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _open_step(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The manifest of step directory ``path`` and its data files, opened (sizes checked before
    anything is allocated), all from one directory: a re-save swaps in a new directory, and a
    manifest read from the old one with data files opened in the new one would fail its
    checksums (a false corruption), so that is read again, up to ``STEP_REREADS`` times."""
    for attempt in range(STEP_REREADS + 1):
        before = _identity(path)
        fds: dict[str, int] = {}
        try:
            body = fmt.read_manifest(path)
            meta = body.get("metadata")
            if isinstance(meta, dict) and "dcp" in meta and not body["entries"]:
                raise DcpCheckpointError(
                    f"{path}: this step was written by DCP (ckpt.dcp.CkptStorageWriter); load "
                    f"it with dcp.load(state, storage_reader=CkptStorageReader({str(path)!r}))"
                )
            for rec in body["files"]:
                fmt.check_file(path, rec)  # real sizes first: nothing allocated for a short file
            for rec in body["files"]:
                fds[rec["name"]] = _open_data(path, rec["name"], len(body["files"]))
        except CheckpointError:
            _close(fds)
            if attempt < STEP_REREADS and _identity(path) != before:
                continue  # the directory was swapped while we read it
            raise
        except BaseException:
            _close(fds)
            raise
        if attempt == STEP_REREADS or _identity(path) == before:
            return body, fds
        _close(fds)
    raise AssertionError("unreachable")


def _open_data(path: Path, name: str, count: int) -> int:
    try:
        return fmt.open_data(fmt.inside(path, name))
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise CheckpointError(
            f"{path}: cannot hold its {count} data files open at once ({exc.strerror})"
        ) from None


def _close(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


def _verify_files(
    path: Path,
    body: dict[str, Any],
    executor: Executor | None,
    stats: RestoreStats,
    fds: dict[str, int] | None = None,
) -> None:
    """The first pass: read and checksum every data file (the open files ``fds``, which the
    next pass reads again; else opened by name), keeping nothing (``verify_threads()`` threads,
    each with one small buffer, unless the caller gave an executor)."""
    pool = executor or ThreadPoolExecutor(verify_threads(), thread_name_prefix="ckpt-verify")
    try:
        for rec in body["files"]:
            fd = None if fds is None else fds[rec["name"]]
            stats.verify_s += read_into(path, rec, [], True, pool, fd=fd)
    finally:
        if executor is None:
            pool.shutdown()


def _device_scratch(found: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """New tensors like those of ``found``, to read into first, when all of them are CUDA
    tensors that fit in ``DEVICE_SCRATCH_SHARE`` of each device's free memory (the driver's
    free memory plus what torch's allocator holds unused); else ``{}``."""
    if not found or not all(t.is_cuda for t in found.values()):
        return {}
    need: dict[torch.device, int] = {}
    for t in found.values():
        need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    for device, nbytes in need.items():
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if nbytes > DEVICE_SCRATCH_SHARE * (free + unused):
            return {}
    try:
        return {i: torch.empty_like(t.detach()) for i, t in found.items()}
    except torch.cuda.OutOfMemoryError:
        return {}


def _copy_into(
    found: dict[int, torch.Tensor], scratch: dict[int, torch.Tensor], arrays: list[Any]
) -> None:
    """Copy the verified ``scratch`` tensors into the caller's (one batched copy per device,
    on its current stream, complete on return) and return the caller's in the state."""
    devices: dict[torch.device, list[int]] = {}
    for i, t in found.items():
        devices.setdefault(t.device, []).append(i)
    with torch.no_grad():
        for device, ids in devices.items():
            batched = [i for i in ids if found[i].dtype in BATCHED_DTYPES]
            if batched:
                foreach_copy_exact([found[i] for i in batched], [scratch[i] for i in batched])
            for i in ids:
                if found[i].dtype not in BATCHED_DTYPES:
                    found[i].copy_(scratch[i])
            torch.cuda.current_stream(device).synchronize()
    for i, t in found.items():
        arrays[i] = t


def _read_mmap(
    path: Path,
    body: dict[str, Any],
    verify: bool,
    stats: RestoreStats,
    *,
    fds: dict[str, int],
    executor: Executor | None,
) -> list[Any]:
    """Map the open files ``fds`` after verifying them: the file mapped is the file verified
    (its name may have been replaced since)."""
    if verify:
        _verify_files(path, body, executor, stats, fds)
    files: dict[str, torch.Tensor] = {}
    for rec in body["files"]:
        name = rec["name"]
        files[name] = _mmap(fmt.inside(path, name), rec["size"], fds[name])
    return fmt.load_arrays(body, files)


def _allocate(
    body: dict[str, Any],
    scratch: dict[int, torch.Tensor],
    found: dict[int, torch.Tensor],
    map_location: MapLocation,
    *,
    path: Path,
    moved: set[str],
) -> tuple[list[Any], dict[str, list[fmt.Target]]]:
    """One destination per entry (a ``scratch`` tensor, or a new one on its final device; none
    yet for the direct targets ``found``, filled later) and, per data file, the byte ranges to
    fill."""
    arrays: list[Any] = []
    dests: dict[str, list[fmt.Target]] = {}
    for i, e in enumerate(body["entries"]):
        dests.setdefault(e["file"], [])
        if i in scratch:
            value: Any = scratch[i]
            raw = value.reshape(-1).view(torch.uint8)
        elif i in found:
            arrays.append(None)
            continue
        else:
            try:
                value, raw = _new(e, map_location, path, moved)
            except CheckpointError:
                raise
            except (RuntimeError, MemoryError) as exc:  # out of memory: no fallback, say so
                raise CheckpointError(
                    f"{path}: cannot allocate entries[{i}] ({e['nbytes']} bytes, "
                    f"{e['dtype']} {e['shape']}): {exc}"
                ) from None
        arrays.append(value)
        dests[e["file"]].append((e["offset"], raw))
    return arrays, dests


def _new(
    e: dict[str, Any], map_location: MapLocation, path: Path, moved: set[str]
) -> tuple[Any, torch.Tensor]:
    """A new array for entry ``e`` on its final device, and a uint8 tensor of its bytes."""
    if e["kind"] == "tensor":
        device = _device(e, map_location, path, moved)
        value = torch.empty(e["shape"], dtype=torch_dtype(e["dtype"]), device=device)
        return value, value.reshape(-1).view(torch.uint8)
    array = np.empty(e["shape"], dtype=fmt.numpy_dtype(e["dtype"]))
    flat = array.reshape(-1).view(np.uint8) if array.nbytes else np.empty(0, np.uint8)
    return array, torch.from_numpy(flat)


def _mmap(file: Path, size: int, fd: int) -> torch.Tensor:
    """Map the open data file ``fd`` (opened by ``fmt.open_data``: no symlink, FIFO or device;
    left open)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    import mmap

    if os.fstat(fd).st_size != size:
        raise CorruptCheckpointError(f"{file}: size {os.fstat(fd).st_size} != {size} bytes")
    # copy-on-write private mapping: pages are read lazily, writes never reach the file
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def verify_step(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that the checkpoint directory ``path`` is restorable, without reading tensors
    beyond their checksums: the manifest (its CRC32C and the whole body, tree and entries
    included, by the same ``validate_manifest`` a restore runs), each data file's size and every
    chunk's CRC32C. Returns the manifest body; raises ``CorruptCheckpointError`` naming the
    file and field at fault."""
    path = Path(path)
    body = fmt.read_manifest(path)
    for rec in body["files"]:
        fmt.verify_file(path, rec)
    meta = body.get("metadata")
    if isinstance(meta, dict) and "dcp" in meta and not body["entries"]:  # a DCP step
        from ckpt.restoring.dcp_reader import (
            check_bytes_items,  # byte items load as dcp.load would, safely
        )

        check_bytes_items(path)
    return body
