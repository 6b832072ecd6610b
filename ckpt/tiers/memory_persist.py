"""Persisting a snapshot of the memory tier to the disk tier: a verified copy, in the background.

``copy_step`` copies a committed ``step-N`` of one ckpt root into another by the commit protocol
of ``ckpt.saving.commit``: every data file is copied into ``step-N.tmp-*`` and fsynced, then read
back and checked against the manifest's per-chunk CRC32C, the manifest goes last, and the
directory is published by rename. A crash at any point leaves the disk's previous steps whole and,
at worst, a ``.tmp-`` leftover that the next writer removes. The source step is read under its
shared lock, so the memory tier's retention never deletes it mid-copy.

``Persister`` runs those copies on one thread (``ckpt-mem-persist``) so that saves into memory
never wait for the disk: it holds at most one waiting step, and a newer one replaces it. A waiting
step that the memory tier's retention evicted before its copy began is dropped the same way
(counted as superseded): only the step being copied is kept from eviction.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpt import _faults, _layout
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.saving import commit

__all__ = ["PersistStats", "Persister", "copy_step"]

log = logging.getLogger("ckpt")


def _copy_file(src: Path, dst: Path) -> None:
    """Copy the regular file ``src`` to the new file ``dst`` (no symlink followed), fsynced."""
    fd_in = fmt.open_regular(src)
    try:
        fd_out = commit.open_nofollow(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            size, pos = os.fstat(fd_in).st_size, 0
            while pos < size:  # in the kernel, tmpfs to any filesystem (copy_file_range is not)
                done = os.sendfile(fd_out, fd_in, pos, min(size - pos, 1 << 30))
                if done == 0:
                    raise CheckpointError(f"{src}: shrank while being persisted")
                pos += done
            _faults.pause("persist")
            os.fsync(fd_out)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    _faults.fs_op(f"copy {dst.name}")


def copy_step(source: Path, root: Path, step: int) -> Path:
    """Copy the committed ``source`` (a ``step-N`` directory) to ``root/step-N``, verified, and
    point ``root/latest`` at it when it is the newest; returns the published path. A source
    that fails its checks raises ``CorruptCheckpointError`` and nothing is published."""
    tmp: Path | None = commit.make_tmp(root, step)
    assert tmp is not None
    try:
        with commit.reading(source):
            body = fmt.read_manifest(source)  # its own CRC checked
            for rec in body["files"]:
                name = fmt.safe_relpath(rec["name"])
                _copy_file(source / name, tmp / name)
                fmt.verify_file(tmp, rec)  # the copy's every chunk against the manifest
            _copy_file(source / fmt.MANIFEST, tmp / fmt.MANIFEST)
        final = commit.publish(tmp, root, step)
        tmp = None
    finally:
        if tmp is not None:
            commit.remove_path(tmp)
    if step >= max(commit.steps(root), default=step):
        commit.write_latest(root, step)
    return final


class _EvictedError(Exception):
    """The waiting step left the memory tier before its copy began."""


@dataclass
class PersistStats:
    """Counters of the persists: done, replaced by a newer one before starting, failed; the
    last one's step and seconds."""

    persisted: int = 0
    superseded: int = 0
    failed: int = 0
    last_step: int | None = None
    last_s: float = 0.0


class Persister:
    """Copies steps of the memory root ``source`` to the disk root ``target`` on one thread.

    ``submit(step)`` returns at once; ``on_persisted(step, path)`` runs on the thread after each
    copy (the manager's post-commit actions on the disk tier). A failure is kept and raised by
    the next ``raise_pending``. ``holds(step)``: whether ``step`` is being copied (the memory
    tier's retention keeps it)."""

    def __init__(
        self, source: Path, target: Path, on_persisted: Callable[[int, Path], None]
    ) -> None:
        self.source = source
        self.target = target
        self.on_persisted = on_persisted
        self.stats = PersistStats()
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._running: int | None = None
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None

    def submit(self, step: int) -> None:
        """Queue ``step`` for persisting; a step still waiting is replaced (counted)."""
        with self._cond:
            if self._pending is not None:
                self.stats.superseded += 1
                log.info("ckpt: persist of step %d replaced by step %d", self._pending, step)
            self._pending = step
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="ckpt-mem-persist", daemon=False
                )
                self._thread.start()

    def holds(self, step: int) -> bool:
        """Whether ``step`` is being persisted."""
        with self._cond:
            return step == self._running

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._pending is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                step, self._pending, self._running = self._pending, None, self._pending
            try:
                if not _layout.step_dir(self.source, step).is_dir():
                    raise _EvictedError
                self.persist(step)
            except _EvictedError:
                self._evicted(step)
            except BaseException as exc:  # kept for the caller; the thread goes on
                if self._vanished(step, exc):
                    self._evicted(step)
                    continue
                with self._cond:
                    self.stats.failed += 1
                    self._error = self._error or (step, exc)
                log.error("ckpt: persisting step %d to %s failed: %s", step, self.target, exc)
            finally:
                with self._cond:
                    self._running = None

    def _vanished(self, step: int, exc: BaseException) -> bool:
        """Whether ``exc`` came from ``step`` leaving the memory tier after the check and
        before its copy was opened (nothing published on the disk)."""
        return (
            isinstance(exc, CheckpointError)
            and not _layout.step_dir(self.source, step).is_dir()
            and not _layout.step_dir(self.target, step).is_dir()
        )

    def _evicted(self, step: int) -> None:
        with self._cond:
            self.stats.superseded += 1
        log.info("ckpt: persist of step %d dropped: evicted from memory before its copy", step)

    def persist(self, step: int) -> Path:
        """Copy ``step`` now, on the calling thread, then run ``on_persisted``."""
        t0 = time.perf_counter()
        path = copy_step(_layout.step_dir(self.source, step), self.target, step)
        with self._cond:
            self.stats.persisted += 1
            self.stats.last_step = step
            self.stats.last_s = time.perf_counter() - t0
        self.on_persisted(step, path)
        return path

    def wait(self, timeout: float | None = None) -> None:
        """Wait until nothing waits or runs (``TimeoutError`` after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._thread is None, timeout):
                raise TimeoutError(f"{self.target}: persists still running after {timeout} s")

    def raise_pending(self) -> None:
        """Raise the first persist failure not raised yet (once)."""
        with self._cond:
            pending, self._error = self._error, None
        if pending is not None:
            step, exc = pending
            raise CheckpointError(
                f"persisting step {step} from the memory tier {self.source} to {self.target} "
                f"failed: {exc}"
            ) from exc
