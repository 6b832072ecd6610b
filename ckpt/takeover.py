"""Becoming a checkpoint directory's writer, and finishing what a crashed writer left behind.

``Takeover.take`` runs once per manager, before its first write (``CheckpointManager.
ensure_writer``): it claims the directory (``ckpt._owner.claim_root``: a directory holding
entries ckpt did not write is refused, naming them, and nothing is written), takes the writer
lock, records the retention policy (``ckpt gc`` applies it) and runs ``on_take`` (the run log of
``ckpt.runlog``). Then it recovers: it removes the leftovers of interrupted saves, finishes a
commit a crash interrupted between its rename and its ``latest`` update, and catches up on
retention, before anything new is added.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ckpt import _owner
from ckpt.policy import Policy
from ckpt.retention import rules
from ckpt.saving import commit

__all__ = ["Takeover"]

log = logging.getLogger("ckpt")


class Takeover:
    """One manager's claim on its directory: the writer lock and the recovery it runs once."""

    def __init__(self, directory: Path, on_take: Callable[[], None]) -> None:
        self.directory = directory
        self.lock = commit.WriterLock(directory)
        self.on_take = on_take

    @property
    def held(self) -> bool:
        """Whether this manager is the directory's writer."""
        return self.lock.held

    def take(
        self,
        policy: Policy | None,
        lock_timeout_s: float,
        newest_verified: int | None,
        retain: Callable[[], None],
    ) -> None:
        """Become the writer (once; see the module docstring). ``newest_verified``: the newest
        step this manager restored verified, if any; ``retain``: the manager's retention pass."""
        if self.lock.held:
            return
        _owner.claim_root(self.directory)
        self.lock.acquire(lock_timeout_s)
        try:
            rules.record(self.directory, policy)
            self.on_take()
        except BaseException:
            self.lock.release()
            raise
        removed = commit.remove_leftovers(self.directory)
        if removed:
            log.info(
                "ckpt: removed %d leftovers of interrupted saves in %s",
                len(removed),
                self.directory,
            )
        if newest_verified is not None:
            # retention keeps the step ``latest`` names: roll a stale one forward first
            if newest_verified == max(commit.steps(self.directory), default=-1):
                commit.roll_latest_forward(self.directory, newest_verified)
            retain()  # catch up on retention, before adding
