"""``MemoryTier``: the newest snapshots of a run in shared memory, outliving the process.

Every save of a manager with ``memory=`` is written, by the save pipeline and its commit protocol
(``ckpt.saving.commit``), into the tier's own ckpt root on a tmpfs (``ckpt.tiers.memory_options``
names it): the same ``step-N`` directories, manifest and per-chunk CRC32C as on disk, so the
verified reader restores from it and a persist is a verified copy (``ckpt.tiers.memory_persist``).

Double buffering is the commit protocol plus retention: a save writes ``step-N.tmp-*`` and
renames it; the older snapshots are evicted only after that, down to ``keep``. A SIGKILL at any
instant leaves every committed snapshot whole. The tier holds at most ``keep + 2`` snapshots: the
newest ``keep``, one being written and one older being copied to the disk.

Lifecycle: ``prepare`` (before each save: the tier claimed and locked, leftovers removed, the
first save's size admitted against the tmpfs, a persist failure raised); ``committed`` (after each
snapshot, on the save thread: every ``persist_every``-th is queued for the disk, retention);
``close`` (the newest snapshot persisted if the disk lacks it, then the tier freed). A tier whose
writer died (its ``.lock`` not held) is stale: ``salvage`` persists its newest verified step and
``free`` deletes it (``ckpt gc DIR``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckpt import _layout, _owner
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.policy import KeepLast
from ckpt.retention.retainer import Retainer
from ckpt.saving import commit
from ckpt.tier_guard import check_tier, make_tier
from ckpt.tiers.memory_free import free_root
from ckpt.tiers.memory_options import MemoryOptions, memory_options, tier_dir
from ckpt.tiers.memory_persist import Persister, PersistStats

if TYPE_CHECKING:
    from ckpt.saving.pipeline import WriteOptions
    from ckpt.tiers.replica import PeerReplica

__all__ = ["MemoryStats", "MemoryTier", "check_capacity", "remote_hooks"]

log = logging.getLogger("ckpt")


@dataclass
class MemoryStats:
    """The memory tier's counters: snapshots taken, evicted from memory, and the persists
    (one every ``persist_every`` snapshots)."""

    persist_every: int = 1
    snapshots: int = 0
    evicted: list[int] = field(default_factory=list)
    persist: PersistStats = field(default_factory=PersistStats)


def check_capacity(directory: Path, root: Path, keep: int, nbytes: int, held: int) -> None:
    """Refuse (``CheckpointError`` with the figures) ``keep + 2`` snapshots of ``nbytes`` that
    the filesystem of ``root`` cannot hold: its free space plus the ``held`` bytes of this tier's
    snapshots (they are replaced, not added to)."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    need = (keep + 2) * nbytes
    if need > free + held:
        gib = 1 << 30
        raise CheckpointError(
            f"memory tier {directory}: {keep} + 2 snapshots of {nbytes / gib:.2f} GiB need "
            f"{need / gib:.2f} GiB, but {root} can hold {(free + held) / gib:.2f} GiB "
            f"({free / gib:.2f} GiB free + {held / gib:.2f} GiB held by this tier; size "
            f"{st.f_blocks * st.f_frsize / gib:.2f} GiB): lower MemoryOptions.keep, give a "
            "larger tmpfs as MemoryOptions.root, or grow it (mount -o remount,size=...)"
        )


def _step_bytes(path: Path) -> int:
    """The bytes of the files of the step directory ``path``."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def _held_bytes(directory: Path) -> int:
    return sum(_step_bytes(_layout.step_dir(directory, s)) for s in commit.steps(directory))


class _HasMemoryStats(Protocol):
    memory: MemoryStats | None


class MemoryTier:
    """The memory tier of the checkpoint directory ``disk`` (module docstring).

    ``on_persisted(step, path)``: runs after each step is persisted to ``disk`` (the manager's
    post-commit actions: listeners such as the upload, disk retention)."""

    def __init__(
        self,
        disk: Path,
        options: MemoryOptions,
        on_persisted: Callable[[int, Path], None],
    ) -> None:
        self.disk = disk
        self.options = options
        self.directory = tier_dir(disk, options.root)
        self.stats = MemoryStats(options.persist_every)
        self.lock = commit.WriterLock(self.directory)
        self.on_persisted = on_persisted
        self.persister = Persister(self.directory, disk, self._persisted)
        self.stats.persist = self.persister.stats
        self._retainer = Retainer(
            self.directory, [lambda s: not self.persister.holds(s)], self.stats.evicted
        )
        self._policy = KeepLast(options.keep)
        self._admitted = 0  # the snapshot size admitted against the tmpfs (0: none yet)
        self._grown = 0  # the largest snapshot committed (bytes on the tmpfs)
        self.upload_steps: set[int] = set()  # persisted steps the remote tier is to upload
        self.replica: PeerReplica | None = None
        if options.replica:
            from ckpt.tiers.replica import PeerReplica

            self.replica = PeerReplica(self.directory)

    @classmethod
    def attach(
        cls,
        disk: Path,
        given: bool | MemoryOptions | None,
        on_persisted: Callable[[int, Path], None],
        stats: _HasMemoryStats,
    ) -> MemoryTier | None:
        """The tier of ``memory=given`` (``None`` without one); its counters go to
        ``stats.memory`` (``ckpt.manager.ManagerStats``)."""
        options = memory_options(given)
        if options is None:
            return None
        tier = cls(disk, options, on_persisted)
        stats.memory = tier.stats
        return tier

    def route(self) -> tuple[Path, Callable[[int, Path], None]]:
        """Where the save pipeline writes (this tier) and what it calls after each commit."""
        return self.directory, self.committed

    def steps(self) -> list[int]:
        """The snapshots in the tier, ascending (``[]`` if it does not exist); a tier that is
        not this user's own raises (``ckpt.tier_guard``)."""
        return commit.steps(self.directory) if check_tier(self.directory) else []

    # ---- saving -------------------------------------------------------------------------
    def prepare(self, nbytes: Callable[[], int], write: WriteOptions | float) -> None:
        """Before a save: raise a persist failure; claim and lock the tier (once); refuse a
        snapshot the tmpfs cannot hold ``keep + 2`` times: on the first save (``nbytes()``), and
        again when a committed snapshot outgrew the size admitted (a state that grows: an
        optimizer's state made at its first step, after a save)."""
        self.persister.raise_pending()
        if not self.lock.held:
            self.acquire(write if isinstance(write, float) else write.lock_timeout_s)
        size = self._grown if self._admitted else nbytes()
        if size > self._admitted:
            check_capacity(
                self.directory,
                Path(self.options.root),
                self.options.keep,
                size,
                _held_bytes(self.directory),
            )
            self._admitted = size

    def acquire(self, timeout_s: float = 0.0) -> None:
        """Claim the tier as ckpt's (recording its disk directory), take its writer lock
        (``LockedError`` if a live writer holds it), remove leftovers of interrupted saves and
        apply the tier's retention (a crash may have cut the last pass)."""
        make_tier(self.directory)  # private, never a symlink or another user's
        _owner.claim_root(self.directory, {"memory_of": os.path.realpath(self.disk)})
        self.lock.acquire(timeout_s)
        removed = commit.remove_leftovers(self.directory)
        if removed:
            log.info(
                "ckpt: removed %d leftovers in the memory tier %s", len(removed), self.directory
            )
        self._retainer.retain(self._policy)  # catch up on a pass a crash cut, before adding

    def committed(self, step: int, path: Path) -> None:
        """A snapshot was committed to the tier (the save pipeline's callback): queue every
        ``persist_every``-th for the disk, then apply the tier's retention."""
        self.stats.snapshots += 1
        self._grown = max(self._grown, _step_bytes(path))
        self._retainer.mark_good(step, path)
        if self.stats.snapshots % self.options.persist_every == 0:
            every = self.options.remote_every
            if every is None or self.stats.snapshots % every == 0:
                self.upload_steps.add(step)
            self.persister.submit(step)
        self._retainer.retain(self._policy)
        if self.replica is not None:
            self.replica.committed(step, path)

    def _persisted(self, step: int, path: Path) -> None:
        """After a persist (on the persist thread): the manager's actions on the disk, then the
        tier's retention again, as the copy's read lock kept the step from a pass."""
        self.on_persisted(step, path)
        self._retainer.retain(self._policy)

    def before_restore(self) -> None:
        """With a replica: the collective exchange that brings back a lost node's snapshot."""
        if self.replica is not None:
            self.replica.restore_exchange()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the persists in flight, then raise a failure among them."""
        self.persister.wait(timeout)
        self.persister.raise_pending()

    # ---- the remote tier ------------------------------------------------------------------
    def remote_filter(
        self, enqueue: Callable[[int, Path], Any], may_evict: Callable[[int], bool]
    ) -> tuple[Callable[[int, Path], Any], Callable[[int], bool]]:
        """The remote tier's listener and evict guard, limited to ``remote_every``'s steps."""
        if self.options.remote_every is None:
            return enqueue, may_evict

        def listener(step: int, path: Path) -> None:
            if step in self.upload_steps:
                enqueue(step, path)

        return listener, lambda s: s not in self.upload_steps or may_evict(s)

    # ---- the end of a run -------------------------------------------------------------------
    def salvage(self) -> int | None:
        """Persist the newest snapshot that verifies, if the disk has no step as new; returns
        the step persisted. Corrupt snapshots are skipped with a warning."""
        newest_disk = max(commit.steps(self.disk), default=-1)
        for step in reversed(self.steps()):
            if step <= newest_disk:
                return None
            try:
                self.upload_steps.add(step)  # the run's last state: uploaded too
                self.persister.persist(step)
                return step
            except CorruptCheckpointError as exc:
                log.warning("ckpt: memory tier step %d not persisted: %s", step, exc)
        return None

    def close(self) -> None:
        """With the tier's lock held (this manager saved): wait for persists, persist the newest
        snapshot if the disk lacks it (``persist_on_close``), free the tier. A failure leaves
        the tier in place (it may hold the only copy) and is raised."""
        if not self.lock.held:
            return
        self.wait()
        if self.options.persist_on_close:
            self.salvage()
        self.free()

    def free(self) -> list[str]:
        """Delete the tier (lock held) and the replica it holds (``free_root``)."""
        if self.replica is not None:
            self.replica.free()
        return free_root(self.directory, self.lock)


def remote_hooks(
    tier: MemoryTier | None,
    enqueue: Callable[[int, Path], Any],
    may_evict: Callable[[int], bool],
) -> tuple[Callable[[int, Path], Any], Callable[[int], bool]]:
    """The remote tier's commit listener and evict guard, limited by ``tier``'s
    ``remote_every`` (unchanged without a memory tier)."""
    return (enqueue, may_evict) if tier is None else tier.remote_filter(enqueue, may_evict)
