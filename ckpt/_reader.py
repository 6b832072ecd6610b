"""Reading one checkpoint directory back: manifest, verified data files, the nested state."""

from __future__ import annotations

import logging
import os
import time
import warnings
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from ckpt import format as fmt
from ckpt._flatten import unflatten
from ckpt.errors import CheckpointError

__all__ = ["MapLocation", "RestoreStats", "read_checkpoint", "verify_step"]

log = logging.getLogger("ckpt")

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


def _device(entry: dict, map_location: MapLocation, path: Path, moved: set[str]) -> torch.device:
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
) -> tuple[Any, dict, RestoreStats]:
    """Load the checkpoint in directory ``path``; returns (state, manifest body, stats).

    Raises ``CorruptCheckpointError`` naming the file if the manifest or a data file is bad.
    """
    path = Path(path)
    t0 = time.perf_counter()
    body = fmt.read_manifest(path)
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
                files[rec["name"]] = _mmap(path / rec["name"], rec["size"])
            else:
                files[rec["name"]], crc_s = fmt.read_file(path, rec, verify, pool)
                stats.verify_s += crc_s
    finally:
        if own:
            pool.shutdown()
    arrays = fmt.load_arrays(body, files)
    moved: set[str] = set()
    for i, entry in enumerate(body["entries"]):
        if entry["kind"] == "tensor":
            arrays[i] = _place(arrays[i], _device(entry, map_location, path, moved))
    _warn_moved(path, moved)
    state = unflatten(body["tree"], arrays)
    stats.read_s = time.perf_counter() - t0
    return state, body, stats


def _mmap(file: Path, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    # copy-on-write private mapping: pages are read lazily, writes never reach the file
    return torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8)


def verify_step(path: str | os.PathLike[str]) -> dict:
    """Check that the checkpoint directory ``path`` is restorable, without reading tensors
    beyond their checksums: the manifest (its CRC32C and the whole body, tree and entries
    included, by the same ``validate_manifest`` a restore runs), each data file's size and every
    chunk's CRC32C. Returns the manifest body; raises ``CorruptCheckpointError`` naming the
    file and field at fault."""
    path = Path(path)
    body = fmt.read_manifest(path)
    for rec in body["files"]:
        fmt.verify_file(path, rec)
    return body
