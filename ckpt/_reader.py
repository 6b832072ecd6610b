"""Reading one checkpoint directory back: manifest, verified data files, the nested state."""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from ckpt import format as fmt
from ckpt._flatten import unflatten
from ckpt.errors import CheckpointError, CorruptCheckpointError, DcpCheckpointError

__all__ = ["MapLocation", "RestoreStats", "read_checkpoint"]

MapLocation = Union[str, torch.device, None]  # noqa: UP007 (a runtime alias on 3.10)


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
    skipped: list[tuple[int, str]] = field(default_factory=list)


def _place(value: torch.Tensor, entry: dict, map_location: MapLocation, path: Path) -> torch.Tensor:
    target = map_location if map_location is not None else entry.get("device", "cpu")
    device = torch.device(target)
    if device.type == "cpu":
        return value
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            f"{path}: tensor was saved on {target} but CUDA is not available; "
            "pass map_location='cpu'"
        )
    return value.to(device)


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    mmap: bool = False,
    verify: bool = True,
    executor: Executor | None = None,
) -> tuple[Any, dict, RestoreStats]:
    """Load the checkpoint in directory ``path``; returns (state, manifest body, stats).

    Raises ``CorruptCheckpointError`` naming the file if the manifest or a data file is bad.
    """
    path = Path(path)
    t0 = time.perf_counter()
    body = fmt.read_manifest(path)
    if isinstance(body.get("metadata"), dict) and "dcp" in body["metadata"] and not body["entries"]:
        raise DcpCheckpointError(
            f"{path}: this step was written by DCP (ckpt.dcp.CkptStorageWriter); load it with "
            f"dcp.load(state, storage_reader=CkptStorageReader({str(path)!r}))"
        )
    stats = RestoreStats(step=body.get("step"), path=str(path), verified=verify, mmap=mmap)
    own = executor is None
    pool = executor or ThreadPoolExecutor(2, thread_name_prefix="ckpt-read")
    files: dict[str, torch.Tensor] = {}
    try:
        for rec in body["files"]:
            stats.nbytes += rec["size"]
            if mmap:
                if verify:
                    v0 = time.perf_counter()
                    fmt.verify_file(path, rec)
                    stats.verify_s += time.perf_counter() - v0
                files[rec["name"]] = _mmap(fmt.inside(path, rec["name"]), rec["size"])
            else:
                files[rec["name"]], crc_s = fmt.read_file(path, rec, verify, pool)
                stats.verify_s += crc_s
    finally:
        if own:
            pool.shutdown()
    arrays = fmt.load_arrays(body, files)
    for i, entry in enumerate(body["entries"]):
        if entry["kind"] == "tensor":
            arrays[i] = _place(arrays[i], entry, map_location, path)
    state = unflatten(body["tree"], arrays)
    stats.read_s = time.perf_counter() - t0
    return state, body, stats


def _mmap(file: Path, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    if file.is_symlink():  # never map through a symlink out of the checkpoint
        raise CorruptCheckpointError(f"{file}: data file is a symlink")
    # copy-on-write private mapping: pages are read lazily, writes never reach the file
    return torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8)
