"""The POSIX commit protocol and the directory layout.

``DIR/step-N.tmp-<pid>-<rand>/`` is written and fsynced (files, then the directory), renamed to
``DIR/step-N``, and the parent fsynced; only then ``DIR/latest`` is replaced by rename. Deleting a
step renames it to ``step-N.del-*`` first, so a half-deleted step is never visible. Leftovers of
interrupted saves and deletions are removed under the writer lock (``DIR/.lock``, ``flock``).
Readers hold a shared ``flock`` on the step directory; eviction only takes steps it can lock
exclusively.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from ckpt import _faults
from ckpt.errors import CheckpointError, LockedError
from ckpt.format import MANIFEST

__all__ = [
    "WriterLock",
    "evict",
    "fsync_dir",
    "leftovers",
    "make_tmp",
    "publish",
    "read_latest",
    "reading",
    "remove_leftovers",
    "remove_path",
    "step_dir",
    "step_number",
    "steps",
    "write_latest",
]

_STEP = re.compile(r"^step-(0|[1-9][0-9]*)\Z")  # ASCII, canonical: "step-05" is not step 5
_LEFTOVER = re.compile(r"^(step-\d+\.(tmp|del)-.+|latest\.tmp-.+)$")
LATEST = "latest"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames/creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(root: Path, step: int) -> Path:
    """The committed directory of ``step``."""
    return root / f"step-{step}"


def step_number(name: str) -> int | None:
    """The step a ``step-N`` name stands for (``N`` in ASCII digits, no leading zero), else
    ``None``: the only names that ``step_dir`` gives back."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def steps(root: Path) -> list[int]:
    """Committed steps (``step-N`` directories holding a manifest), ascending."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = _STEP.match(name)
        if m and (root / name / MANIFEST).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def leftovers(root: Path) -> list[Path]:
    """Temporary directories/files of interrupted saves or deletions."""
    try:
        return sorted(root / n for n in os.listdir(root) if _LEFTOVER.match(n))
    except FileNotFoundError:
        return []


def remove_path(path: Path) -> None:
    """Remove a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_leftovers(root: Path) -> list[Path]:
    """Remove leftovers (call only under the writer lock); returns what was removed."""
    found = leftovers(root)
    for path in found:
        remove_path(path)
    if found:
        fsync_dir(root)
    return found


def make_tmp(root: Path, step: int) -> Path:
    """Create ``step-N.tmp-<pid>-<rand>`` for a save in progress."""
    path = root / f"step-{step}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def publish(tmp: Path, root: Path, step: int) -> Path:
    """Make a fully written, fsynced ``tmp`` directory the committed ``step-N``."""
    fsync_dir(tmp)
    final = step_dir(root, step)
    if final.exists():  # re-saving a step: retire the old one first (never half-visible)
        os.rename(final, root / f"step-{step}.del-{secrets.token_hex(4)}")
    _faults.pause("rename")
    os.rename(tmp, final)
    fsync_dir(root)
    return final


def write_latest(root: Path, step: int) -> None:
    """Atomically point ``DIR/latest`` at ``step-N``."""
    _faults.pause("latest")
    tmp = root / f"latest.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, f"step-{step}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> int | None:
    """The step named by ``DIR/latest``, or ``None`` if absent or unreadable."""
    try:
        m = _STEP.match((root / LATEST).read_text().strip())
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Hold a shared lock on a step directory while reading it (eviction skips locked steps)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint does not exist (deleted?)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise CheckpointError(f"{path}: checkpoint was deleted while opening it")
        yield
    finally:
        os.close(fd)


def evict(root: Path, step: int) -> bool:
    """Delete a committed step unless a reader holds it; returns whether it was deleted."""
    path = step_dir(root, step)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        _faults.pause("retention")
        doomed = root / f"step-{step}.del-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        fsync_dir(root)
    finally:
        os.close(fd)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


class WriterLock:
    """Exclusive writer lock on a directory (``DIR/.lock``; released when the process dies)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self, timeout_s: float = 0.0) -> None:
        """Take the lock, waiting up to ``timeout_s``; raises ``LockedError`` naming the holder."""
        import time

        if self._fd is not None:
            return
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise LockedError(
                        f"{self.root}: another writer holds the checkpoint directory "
                        f"({holder}); use one CheckpointManager per directory"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
