"""Freeing a memory tier (or a peer replica): delete a ckpt root that this process holds the
writer lock of, deleting only what ckpt wrote (``ckpt._owner``), its marker last."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckpt import _layout, _owner
from ckpt.saving import commit
from feedpipe.io.ownership import marker_name

__all__ = ["free_root"]

log = logging.getLogger("ckpt")


def free_root(directory: Path, lock: commit.WriterLock) -> list[str]:
    """Delete the ckpt root ``directory`` whose ``lock`` is held: its steps, then its files,
    then the directory. What ckpt did not write is left and returned (the directory then
    stays); the lock is released either way."""
    for step in commit.steps(directory):
        commit.evict(directory, step)
    commit.remove_leftovers(directory)
    for name in (_layout.LATEST, _layout.RETENTION_FILE):
        path = directory / name
        if os.path.lexists(path) and _owner.is_ours(path):
            commit.remove_path(path)
    left = sorted(n for n in os.listdir(directory) if n != _layout.LOCK)
    if left == [marker_name(_owner.TOOL)] and _owner.owned(directory):
        commit.remove_path(directory / left[0])  # ckpt's marker, last
    left = sorted(n for n in os.listdir(directory) if n != _layout.LOCK)
    if not left:
        commit.remove_path(directory / _layout.LOCK)
    lock.release()
    if left:
        log.warning("ckpt: %s kept: it holds %s", directory, left)
        return left
    os.rmdir(directory)
    return []
