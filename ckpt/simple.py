"""One-off helpers: ``ckpt.save(path, state)`` and ``ckpt.load(path)`` (synchronous, same format,
same commit protocol: a temporary sibling directory renamed into place)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from ckpt import _commit
from ckpt import format as fmt
from ckpt._flatten import Leaf, flatten
from ckpt._paths import local_path
from ckpt._pool import Buffer
from ckpt._reader import MapLocation, read_checkpoint
from ckpt.errors import CheckpointError

__all__ = ["load", "save"]

_REMOTE_HINT = "for remote storage use CheckpointManager('/local/dir', remote=URL)"


def save(path: str | os.PathLike[str], state: Any, *, metadata: dict | None = None) -> Path:
    """Write ``state`` to the checkpoint directory ``path`` and return it once durable.

    An existing checkpoint at ``path`` is replaced; a crash leaves either the old or the new one.
    """
    path = local_path(path, "ckpt.save", _REMOTE_HINT)
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves: list[Leaf] = []
    tree = flatten(state, leaves)
    entries, nbytes = fmt.plan(leaves)
    buf = Buffer(nbytes, pin=False)
    fmt.stage(leaves, entries, buf)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        rec = fmt.write_file(tmp / "data.bin", buf.view())
        body = {
            "format": "ckpt",
            "version": fmt.FORMAT_VERSION,
            "step": None,
            "nbytes": nbytes,
            "tree": tree,
            "entries": entries,
            "files": [rec],
            "metadata": metadata or {},
        }
        fmt.write_manifest(tmp, body)
        _commit.fsync_dir(tmp)
        old = None
        if path.exists():
            old = path.with_name(f"{path.name}.del-{secrets.token_hex(4)}")
            os.rename(path, old)
        os.rename(tmp, path)
        _commit.fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    mmap: bool = False,
    verify: bool = True,
) -> Any:
    """Load the checkpoint directory ``path`` (verified unless ``verify=False``)."""
    path = local_path(path, "ckpt.load", _REMOTE_HINT)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    state, _, _ = read_checkpoint(path, map_location=map_location, mmap=mmap, verify=verify)
    return state
