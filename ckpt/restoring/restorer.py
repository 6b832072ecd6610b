"""The restore side of a ``CheckpointManager``: which step to load, from which tier.

``Restorer.restore`` picks the step (the one asked for, or the newest that verifies, falling
back past corrupt ones with a warning), reads it from the memory tier when it holds the step
(``memory``: its ckpt root on a tmpfs; a corrupt or vanished copy there falls back to the disk's,
then the remote's), locally (``ckpt.restoring.reader``) or from the
remote tier (downloaded into a temp dir, verified, kept as ``step-N`` when this manager is the
writer), and re-lists while steps vanish under a concurrent writer's retention. The manager's
post-restore actions (``on_restored``) run for the step restored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckpt import _layout
from ckpt import format as fmt
from ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DcpCheckpointError,
    LockedError,
    RemoteCheckpointError,
)
from ckpt.restoring.reader import MapLocation, RestoreStats, read_checkpoint
from ckpt.saving import commit
from ckpt.tier_guard import check_tier


class RemoteSource(Protocol):
    """What a restore needs of the remote tier (``ckpt.tiers.remote.RemoteTier`` is one): the
    restore room names this interface instead of importing the tier, which retains through the
    retention room, which reads steps through this room."""

    url: str

    def committed_steps(self) -> list[int]: ...

    def read_manifest(self, step: int) -> dict[str, Any]: ...

    def download(self, step: int) -> Path: ...


__all__ = ["RELISTS", "RemoteSource", "RestoreRequest", "Restorer"]

log = logging.getLogger("ckpt")

RELISTS = 20
"""Listings a restore tries while the steps listed vanish (concurrent retention)."""


@dataclass(frozen=True)
class RestoreRequest:
    """How to load: ``CheckpointManager.restore``'s options (``into`` is the target)."""

    into: Any = None
    map_location: MapLocation = None
    mmap: bool = False
    verify: bool = True
    strict: bool = True


class _VanishedError(Exception):
    """A listed step was deleted before it could be opened: list again."""


class Restorer:
    """Loads the steps of one directory and its remote tier (see the module docstring).

    ``lock``: the directory's writer lock (a download is published only while it is held);
    ``ensure_writer``: takes it; ``on_download(step)``: records a published download; ``shm``:
    the memory tier's root, whose steps are read first."""

    def __init__(
        self,
        directory: Path,
        remote: RemoteSource | None,
        lock: commit.WriterLock,
        ensure_writer: Callable[[], None],
        on_download: Callable[[int], None],
        *,
        shm: Path | None = None,
    ) -> None:
        self.directory = directory
        self.memory = shm  # the memory tier's root (ckpt.tiers.memory), read first
        self.remote = remote
        self.lock = lock
        self.ensure_writer = ensure_writer
        self.on_download = on_download

    # ---- which steps exist ------------------------------------------------------------------
    def remote_steps(self, strict: bool = False) -> set[int]:
        """Steps committed on the remote; a failed listing raises if ``strict``, else it is
        logged (the remote is then only a fallback that is unavailable)."""
        if self.remote is None:
            return set()
        try:
            return set(self.remote.committed_steps())
        except Exception as exc:
            if strict:
                raise CheckpointError(
                    f"cannot list the remote tier {self.remote.url} of {self.directory}: {exc}"
                ) from exc
            log.warning("ckpt: cannot list %s: %s", self.remote.url, exc)
        return set()

    def memory_steps(self) -> set[int]:
        """Steps in the memory tier (none without one); a tier that is not this user's own
        raises (``ckpt.tier_guard``: never read what another user planted)."""
        if self.memory is None or not check_tier(self.memory):
            return set()
        return set(commit.steps(self.memory))

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of ``step``: the local one, else the memory tier's, else the remote's."""
        path = _layout.step_dir(self.directory, step)
        if not (path / fmt.MANIFEST).is_file() and step in self.memory_steps():
            assert self.memory is not None
            path = _layout.step_dir(self.memory, step)
        if not (path / fmt.MANIFEST).is_file() and step in self.remote_steps():
            assert self.remote is not None
            return self.remote.read_manifest(step)
        with commit.reading(path):
            return fmt.read_manifest(path)

    # ---- restoring --------------------------------------------------------------------------
    def restore(self, step: int | None, request: RestoreRequest) -> tuple[int, Any, RestoreStats]:
        """Load ``step`` (``None``: the newest that verifies); returns (step, state, stats)."""
        skipped: list[tuple[int, str]] = []
        remote = self.remote_steps(strict=step is None)  # unlisted, a newer step would be missed
        # re-list while a step vanishes under us: another manager's retention deleted it after
        # the listing, so a newer step exists; only a writer that deletes every listed step
        # before this reader can open it, RELISTS times in a row, makes this give up
        for _attempt in range(RELISTS):
            local = set(commit.steps(self.directory))
            memory = self.memory_steps()
            listed = local | remote | memory
            candidates = [step] if step is not None else sorted(listed, reverse=True)
            vanished = False
            for s in candidates:
                if any(s == done for done, _ in skipped):
                    continue
                try:
                    found = self._candidate(
                        s,
                        asked=step is not None,
                        local=local,
                        remote=remote,
                        request=request,
                        skipped=skipped,
                        memory=memory,
                    )
                except _VanishedError:
                    vanished = True  # try the older ones, then list again
                    continue
                if found is not None:
                    found[1].skipped = skipped
                    return s, found[0], found[1]
            if not vanished:
                break
        else:
            raise CheckpointError(
                f"{self.directory}: no valid checkpoint to restore (every listed step was "
                f"deleted before it could be opened, {RELISTS} times in a row: another "
                "manager's retention deletes steps faster than this reader opens them)"
            )
        detail = "; ".join(f"step {s}: {why}" for s, why in skipped) or "no committed steps"
        raise CheckpointError(f"{self.directory}: no valid checkpoint to restore ({detail})")

    def _candidate(
        self,
        s: int,
        *,
        asked: bool,
        local: set[int],
        remote: set[int],
        request: RestoreRequest,
        skipped: list[tuple[int, str]],
        memory: set[int],
    ) -> tuple[Any, RestoreStats] | None:
        """Load step ``s`` (from the memory tier first); ``None`` if it is corrupt and another
        may be tried (noted in ``skipped``); ``_VanishedError`` if it was deleted under us."""
        path = _layout.step_dir(self.directory, s)
        try:
            found = self._restore_memory(s, s in local or s in remote, request, memory)
            if found is not None:
                return found
            if s not in local and s in remote:
                return self._restore_remote(s, request)
            return self._restore_local(s, path, s in remote, request)
        except CorruptCheckpointError as exc:
            if asked:
                raise
            log.warning("ckpt: skipping step %d: %s", s, exc)
            skipped.append((s, str(exc)))
            return None
        except DcpCheckpointError:
            raise  # not corrupt: never fall back to an older step because of it
        except CheckpointError as exc:
            if not asked and s not in local and s not in remote:  # in the memory tier only
                log.warning("ckpt: step %d left the memory tier (%s); re-listing", s, exc)
                raise _VanishedError from exc
            gone = not path.is_dir() if s in local else s not in self.remote_steps()
            if asked or not gone:
                raise  # only corruption falls back; a step deleted under us is re-listed
            log.warning("ckpt: step %d vanished while restoring (%s); re-listing", s, exc)
            raise _VanishedError from exc

    def _restore_memory(
        self, s: int, elsewhere: bool, request: RestoreRequest, memory: set[int]
    ) -> tuple[Any, RestoreStats] | None:
        """Load ``s`` from the memory tier; ``None`` if it is not listed there, or if that copy
        is corrupt or gone and the disk or the remote has one (logged), else the error."""
        if s not in memory or self.memory is None:
            return None
        try:
            return self._restore_local(s, _layout.step_dir(self.memory, s), False, request)
        except CheckpointError as exc:
            if not elsewhere or isinstance(exc, DcpCheckpointError):
                raise
            log.warning("ckpt: step %d in the memory tier: %s; reading another tier's copy", s, exc)
        return None

    def _restore_local(
        self, s: int, path: Path, in_remote: bool, request: RestoreRequest
    ) -> tuple[Any, RestoreStats]:
        """Load the local ``step-N``; a corrupt copy falls back to the remote's, if any."""
        try:
            with commit.reading(path):
                state, _, stats = read_checkpoint(
                    path,
                    map_location=request.map_location,
                    mmap=request.mmap,
                    verify=request.verify,
                    into=request.into,
                    strict=request.strict,
                )
            return state, stats
        except CorruptCheckpointError as exc:
            if not in_remote:
                raise
            log.warning("ckpt: step %d: %s; fetching the remote copy", s, exc)
        return self._restore_remote(s, request)

    def _restore_remote(self, step: int, request: RestoreRequest) -> tuple[Any, RestoreStats]:
        """Download ``step`` to a temp dir, verify every checksum, load, keep it as ``step-N``."""
        assert self.remote is not None
        try:
            self.ensure_writer()  # to publish the downloaded copy; not required to restore
        except LockedError:
            pass
        tmp = self.download(step, CorruptCheckpointError)
        try:
            state, _, stats = read_checkpoint(
                tmp,
                map_location=request.map_location,
                mmap=request.mmap,
                into=request.into,
                strict=request.strict,
            )
            stats.path = f"{self.remote.url}/{_layout.step_name(step)}"
            if self.lock.held:
                self.publish(tmp, step)
        finally:
            commit.remove_path(tmp)
        return state, stats

    # ---- the local copy of a remote step ------------------------------------------------------
    def fetch(self, step: int) -> Path:
        """Make sure ``DIR/step-N`` holds a verified copy of ``step`` (see
        ``CheckpointManager.fetch``); return its path."""
        path = _layout.step_dir(self.directory, step)
        try:
            with commit.reading(path):
                for rec in fmt.read_manifest(path)["files"]:
                    fmt.verify_file(path, rec)
            return path
        except CheckpointError as exc:
            if self.remote is None:
                raise
            log.warning("ckpt: step %d: %s; fetching the remote copy", step, exc)
        self.ensure_writer()  # publishing the download needs the writer lock
        tmp = self.download(step, CheckpointError)
        try:
            for rec in fmt.read_manifest(tmp)["files"]:
                fmt.verify_file(tmp, rec)
            self.publish(tmp, step)
        finally:
            commit.remove_path(tmp)
        return path

    def download(self, step: int, error: type[CheckpointError]) -> Path:
        """Download remote ``step`` into a temp dir here. A failure that outlived the retries
        (the copy may still be there) is a ``CheckpointError``, never a reason to fall back to
        an older step; other failures (a missing or forbidden object) become ``error``."""
        assert self.remote is not None
        try:
            return self.remote.download(step)
        except RemoteCheckpointError as exc:
            if not exc.permanent:
                raise CheckpointError(
                    f"step {step}: cannot download the remote copy: {exc}"
                ) from exc
            raise error(f"step {step}: remote copy unavailable: {exc}") from exc
        except CheckpointError:
            raise
        except Exception as exc:
            raise error(f"step {step}: remote copy unavailable: {exc}") from exc

    def publish(self, tmp: Path, step: int) -> None:
        """Commit a verified download as local ``step-N``, known uploaded (writer lock held)."""
        commit.publish(tmp, self.directory, step)
        if step >= max(commit.steps(self.directory), default=step):
            commit.write_latest(self.directory, step)
        self.on_download(step)
