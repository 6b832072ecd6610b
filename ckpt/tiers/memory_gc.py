"""``ckpt gc DIR``'s pass over the memory tier of ``DIR``: clear it if it is stale.

A memory tier is stale when no live process holds its writer lock (``.lock`` is an ``flock``,
released by the kernel when its holder dies, whatever the pid in it says). A stale tier may hold
the newest state of a crashed run, so its newest snapshot that verifies is first persisted to
``DIR`` (a verified copy) unless ``DIR`` has a step as new; then the tier is freed, deleting only
what ckpt wrote (``ckpt.tiers.memory.MemoryTier.free``). A tier held by a live run is never
touched, nor a directory without ckpt's marker holding an entry ckpt did not write (one with
only ckpt's entries is what a killed gc or close left), nor a symlink or a directory of
another user (``ckpt.tier_guard``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpt import _owner
from ckpt.errors import CheckpointError, LockedError
from ckpt.saving import commit
from ckpt.tier_guard import check_tier
from ckpt.tiers.memory import MemoryTier
from ckpt.tiers.memory_options import MemoryOptions, tier_dir

__all__ = ["clear_stale"]


def _ignore(step: int, path: Path) -> None:
    """No post-persist action: ``ckpt gc`` applies the disk's retention afterwards."""


def clear_stale(disk: Path, root: str | os.PathLike[str], dry_run: bool) -> list[str]:
    """Clear the memory tier of ``disk`` under ``root`` if stale (module docstring); returns
    the lines ``ckpt gc`` prints. The caller holds ``disk``'s writer lock."""
    where = tier_dir(disk, root)
    try:
        if not check_tier(where):
            return []
    except CheckpointError as exc:  # a symlink or another user's: never followed nor freed
        return [f"skipped {exc}"]
    if not _owner.owned(where) and _owner.foreign(where):  # no marker: a gc or close cut
        return [f"skipped memory tier {where} (not written by ckpt)"]  # after removing it
    tier = MemoryTier(disk, MemoryOptions(root=root), _ignore)
    try:
        tier.lock.acquire(0.0)
    except LockedError as exc:
        return [f"kept memory tier {where} (in use: {exc})"]
    try:
        steps = tier.steps()
        newest_disk = max(commit.steps(disk), default=-1)
        newer = [s for s in steps if s > newest_disk]
        if dry_run:
            keep = f"; would persist step {newer[-1]} first" if newer else ""
            return [f"would free stale memory tier {where} (steps {steps}{keep})"]
        commit.remove_leftovers(where)
        saved = tier.salvage()
        out = [f"persisted step {saved} from the stale memory tier"] if saved is not None else []
        left = tier.free()
        if left:
            return [*out, f"kept memory tier {where}: it holds {left} (not ckpt's)"]
        return [*out, f"freed stale memory tier {where} (steps {steps})"]
    finally:
        tier.lock.release()
