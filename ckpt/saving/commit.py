"""The POSIX commit protocol and the directory layout.

``DIR/step-N.tmp-<pid>-<rand>/`` is written and fsynced (files, then the directory), renamed to
``DIR/step-N``, and the parent fsynced; only then ``DIR/latest`` is replaced by rename. Readers
hold a shared ``flock`` on the step directory; eviction only takes steps it can lock exclusively.

Every committed step stays reachable at every instant of a crash:

1. Re-saving an existing ``step-N`` swaps the new directory in with one atomic
   ``renameat2(RENAME_EXCHANGE)``; the old copy, now under the temporary name, is then deleted.
2. Where the kernel or filesystem lacks the exchange (``EINVAL``/``ENOSYS``), ``step-N`` is
   renamed to ``step-N.del-*`` and the new directory to ``step-N``. Between those renames the
   ``.del-`` copy is the only complete one, so recovery (``settle``) deletes a ``step-N.del-*``
   only while a complete ``step-N`` exists, and renames a complete ``.del-`` back to ``step-N``
   when there is none.
3. A retired copy loses its manifest first (``discard``), so a half-deleted copy never looks
   complete. Eviction removes the step's manifest before anything else (under the step's
   exclusive lock), so an evicted step is never brought back; a ``step-N`` without a manifest is
   not a checkpoint, and recovery removes it.
4. Recovery runs under the writer lock (``remove_leftovers``), or from a reader listing the
   steps when no writer holds the lock (``steps`` calls ``recover``).

5. Nothing is deleted or overwritten that ckpt cannot prove it wrote (``ckpt._owner``): leftovers,
   retired copies, evicted steps, a replaced ``step-N`` and ``latest`` are checked first, and
   what is not ckpt's is left in place (a warning, or a ``CheckpointError`` where the caller
   asked to replace it). ``publish`` claims the root (its marker) before the first commit.

Nothing in the directory is followed out of it: ``.lock``, ``latest``, step directories and data
files that are symlinks are a ``CheckpointError`` naming the path, never opened through. A FIFO,
device or directory where a regular file belongs is an error too, never a hang, and a ``.lock``
with more than one hard link is refused rather than written into.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from ckpt import _faults, _layout, _owner
from ckpt._layout import LATEST, LEFTOVER, LOCK, MANIFEST, RETIRED, step_dir
from ckpt.errors import CheckpointError, LockedError
from ckpt.format import open_regular
from feedpipe.io.fsutil import fsync_dir as io_fsync_dir

__all__ = [
    "WriterLock",
    "check_no_symlinks",
    "discard",
    "evict",
    "exchange",
    "fsync_dir",
    "is_complete",
    "leftovers",
    "make_tmp",
    "open_nofollow",
    "publish",
    "read_latest",
    "reading",
    "recover",
    "remove_leftovers",
    "remove_path",
    "replace_dir",
    "roll_latest_forward",
    "settle",
    "steps",
    "write_latest",
]

log = logging.getLogger("ckpt")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _not_ours(path: Path, what: str) -> None:
    log.warning("ckpt: leaving %s alone: ckpt did not write it (%s)", path, what)


def _symlink_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: is a symlink; ckpt never follows symlinks inside a checkpoint directory "
        "(replace it with a real file or directory)"
    )


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symlink as the last component (``CheckpointError``)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (
            exc.errno == errno.ENOTDIR and os.path.islink(path)
        ):  # O_DIRECTORY on a symlink to a file gives ENOTDIR
            raise _symlink_error(Path(path)) from None
        raise


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """:func:`feedpipe.io.fsync_dir` (the one durability rule of both packages; the checkpoint
    directory may be reached through a symlink), then the fault-injection point of tests."""
    io_fsync_dir(path)
    _faults.fs_op(f"fsync {Path(path).name}")


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a real directory holding a regular manifest (no symlink followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(
            os.lstat(path / MANIFEST).st_mode
        )
    except (FileNotFoundError, NotADirectoryError):
        return False


def steps(root: Path) -> list[int]:
    """Committed steps (``step-N`` directories holding a manifest), ascending. A ``step-N`` that
    is a symlink is a ``CheckpointError``. A step that a crashed writer left only under its
    ``.del-`` name is renamed back first, unless a live writer holds the lock (it recovers).

    A listing is a snapshot of names whose manifests are checked after it. When a listed step
    turns out incomplete and newer than every complete one, another writer's retention evicted
    it after the listing: that eviction began only after a newer step was published, which a
    listing taken now shows, so the directory is listed again (until it stops changing, at most
    ``_LISTINGS`` times). Without this a reader could see no step at all while the directory
    always held one."""
    before: set[str] | None = None
    out: list[int] = []
    for _ in range(_LISTINGS):
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
        if any((m := RETIRED.match(n)) and m.group(1) not in names for n in names):
            recover(root, lock_held=False)  # a re-save cut between its renames (module doc, 2)
            names = os.listdir(root)
        if set(names) == before:  # nothing changed: an incomplete step is a crash's leftover
            break
        before = set(names)
        out, incomplete = [], -1
        for name in names:
            step = _layout.step_number(name)
            if step is None:
                continue
            for path in (root / name, root / name / MANIFEST):
                if os.path.islink(path):
                    raise _symlink_error(path)
            if is_complete(root / name):
                out.append(step)
            else:
                incomplete = max(incomplete, step)
        if incomplete < max(out, default=-1) or incomplete < 0:
            break
    return sorted(out)


_LISTINGS = 10  # steps(): listings while the newest listed step is evicted under the listing


def check_no_symlinks(root: Path) -> None:
    """Refuse a directory whose ``.lock``, ``latest`` or step entries are symlinks."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in sorted(names):
        if (name in (LOCK, LATEST) or _layout.is_step_name(name) or LEFTOVER.match(name)) and (
            os.path.islink(root / name)
        ):
            raise _symlink_error(root / name)


def leftovers(root: Path) -> list[Path]:
    """Temporary directories/files of interrupted saves or deletions."""
    try:
        return sorted(root / n for n in os.listdir(root) if LEFTOVER.match(n))
    except FileNotFoundError:
        return []


def remove_path(path: Path) -> None:
    """Remove a file or directory tree if it exists (a symlink itself, never its target)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    _faults.fs_op(f"remove {path.name}")


def discard(path: Path) -> None:
    """Delete a retired copy: its manifest first (fsynced), so it never looks complete again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, a file or a symlink: nothing to retire first
        fd = -1
    if fd >= 0:
        try:  # relative to the fd: never a manifest that a swapped-in symlink reaches
            with contextlib.suppress(FileNotFoundError):
                os.unlink(MANIFEST, dir_fd=fd)
                _faults.fs_op(f"unlink {path.name}/{MANIFEST}")
                os.fsync(fd)
                _faults.fs_op(f"fsync {path.name}")
        finally:
            os.close(fd)
    remove_path(path)


@functools.lru_cache(maxsize=1)
def _renameat2() -> Callable[..., int] | None:
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:  # libc without renameat2 (glibc < 2.28, musl < 1.2.?)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (``renameat2(RENAME_EXCHANGE)``); ``False``
    where the kernel or filesystem lacks it (nothing was changed then)."""
    import ctypes

    fn = _renameat2() if _faults.exchange_allowed() else None
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        _faults.fs_op(f"exchange {a.name} {b.name}")
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_dir(new: Path, final: Path, retired: Path) -> None:
    """Make the complete, fsynced directory ``new`` take the name ``final`` (which may exist),
    such that a crash at any instant leaves a complete copy reachable (module doc, 1-3).
    ``retired`` is the ``.del-`` name the fallback moves the old copy to."""
    if os.path.islink(final):
        raise _symlink_error(final)
    if os.path.lexists(final) and not _owner.is_ckpt_dir(final):
        raise CheckpointError(
            f"{final}: exists and was not written by ckpt (it holds files other than a ckpt "
            "manifest and data files); refusing to replace it: move it away or choose another "
            "name"
        )
    if os.path.lexists(final):
        if exchange(new, final):  # ``new`` now holds the old copy
            fsync_dir(final.parent)
            discard(new)
            return
        os.rename(final, retired)
        _faults.fs_op(f"rename {final.name} {retired.name}")
        os.rename(new, final)
        _faults.fs_op(f"rename {new.name} {final.name}")
        fsync_dir(final.parent)
        discard(retired)
        return
    os.rename(new, final)
    _faults.fs_op(f"rename {new.name} {final.name}")
    fsync_dir(final.parent)


def settle(final: Path, retired: list[Path]) -> list[Path]:
    """Apply the recovery rule to ``final`` and its ``.del-`` copies; returns what was deleted.

    A retired copy is deleted only while ``final`` is complete; a complete retired copy is
    renamed back to ``final`` when there is no ``final``; an incomplete one (a half-deleted
    copy) is deleted.
    """
    removed = []
    for path in sorted(retired, key=lambda p: not is_complete(p)):  # complete ones first
        if os.path.islink(path):
            raise _symlink_error(path)
        if not _owner.is_ckpt_dir(path, scratch=True):
            _not_ours(path, "not only ckpt files")
            continue
        if is_complete(final):
            discard(path)
            removed.append(path)
        elif not os.path.lexists(final) and is_complete(path):
            os.rename(path, final)
            _faults.fs_op(f"rename {path.name} {final.name}")
            fsync_dir(final.parent)
        elif not is_complete(path):
            discard(path)
            removed.append(path)
    return removed


def remove_leftovers(root: Path) -> list[Path]:
    """Recover and remove leftovers (call only under the writer lock); returns what was removed.

    Temporary directories of unfinished saves are deleted; ``.del-`` copies follow ``settle``.
    Only entries that ckpt wrote (``ckpt._owner.is_ours``) are touched; others are logged.
    """
    check_no_symlinks(root)
    found = leftovers(root)
    retired: dict[str, list[Path]] = {}
    removed = []
    for path in found:
        m = RETIRED.match(path.name)
        if not _owner.is_ours(path):
            _not_ours(path, "a leftover's name, not its contents")
        elif m:
            retired.setdefault(m.group(1), []).append(path)
        else:
            remove_path(path)
            removed.append(path)
    for name, paths in retired.items():
        removed += settle(root / name, paths)
    for name in os.listdir(root):  # an eviction cut short after removing the manifest
        path = root / name
        if (
            _layout.is_step_name(name)
            and not os.path.islink(path)
            and path.is_dir()
            and not os.path.lexists(path / MANIFEST)
        ):
            if not _owner.is_ours(path):
                _not_ours(path, "a step's name without a ckpt manifest")
                continue
            remove_path(path)
            removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


def recover(root: Path, lock_held: bool) -> None:
    """Rename back a step that a writer crashed in the middle of replacing (module doc, 2), if
    any; without ``lock_held``, only when no writer holds the lock (a live one recovers itself)."""
    orphans: dict[str, list[Path]] = {}
    for path in leftovers(root):
        m = RETIRED.match(path.name)
        if m and not os.path.lexists(root / m.group(1)) and is_complete(path):
            orphans.setdefault(m.group(1), []).append(path)
    if not orphans:
        return
    lock = None
    if not lock_held:
        lock = WriterLock(root)
        try:
            lock.acquire()
        except (LockedError, OSError):
            return
    try:
        for name, paths in orphans.items():
            settle(root / name, paths)
    finally:
        if lock is not None:
            lock.release()


def make_tmp(root: Path, step: int) -> Path:
    """Create ``step-N.tmp-<pid>-<rand>`` for a save in progress."""
    path = root / _layout.tmp_name(_layout.step_name(step))
    path.mkdir()
    _faults.fs_op(f"mkdir {path.name}")
    return path


def publish(tmp: Path, root: Path, step: int) -> Path:
    """Make a fully written ``tmp`` directory the committed ``step-N`` (crash-safe even when
    ``step-N`` exists: module doc). The root is claimed first (``ckpt._owner.claim_root``)."""
    _owner.claim_root(root)
    fsync_dir(tmp)
    final = step_dir(root, step)
    _faults.pause("rename")
    replace_dir(tmp, final, root / _layout.del_name(final.name))
    return final


def roll_latest_forward(root: Path, step: int) -> bool:
    """Finish a commit that a crash interrupted between its rename and its ``latest`` update:
    when ``latest`` names a step older than ``step`` (the newest committed step, verified by the
    caller) or is missing, point it at ``step``. Call under the writer lock. Returns whether
    ``latest`` was written. Retention keeps the step ``latest`` names, so a stale one would keep
    an old step alive past the policy."""
    named = read_latest(root)
    if named is not None and named >= step:
        return False
    write_latest(root, step)
    return True


def write_latest(root: Path, step: int) -> None:
    """Atomically point ``DIR/latest`` at ``step-N``; a ``latest`` that ckpt did not write (e.g.
    DeepSpeed's ``global_step10``) is a ``CheckpointError``, never overwritten."""
    final = root / LATEST
    if os.path.isdir(final) and not os.path.islink(final):
        raise CheckpointError(
            f"{final}: is a directory; ckpt keeps its latest-step pointer there "
            "(remove or rename that directory)"
        )
    if os.path.lexists(final) and not _owner.is_ours(final):
        raise CheckpointError(
            f"{final}: was not written by ckpt (not a regular file holding step-N); refusing "
            "to overwrite it: move it away, or give ckpt a directory of its own"
        )
    _faults.pause("latest")
    tmp = root / _layout.tmp_name(LATEST)
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, _layout.latest_text(step))
        os.fsync(fd)
    finally:
        os.close(fd)
    _faults.fs_op(f"write {tmp.name}")
    try:
        os.rename(tmp, final)  # checked above: ckpt's own latest, replaced, never written through
    except IsADirectoryError:  # a directory made since the check
        remove_path(tmp)
        raise CheckpointError(f"{final}: is a directory (made by another program)") from None
    _faults.fs_op(f"rename {tmp.name} {LATEST}")
    fsync_dir(root)


def read_latest(root: Path) -> int | None:
    """The step named by ``DIR/latest``, or ``None`` if absent, unreadable or not a regular
    file (a symlink is a ``CheckpointError``)."""
    try:  # O_NONBLOCK: a FIFO named latest never blocks the open
        fd = open_nofollow(root / LATEST, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, device or directory
            return None
        return _layout.latest_step(os.read(fd, 64))
    except (UnicodeDecodeError, OSError):
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Hold a shared lock on a step directory while reading it (eviction skips locked steps)."""
    try:
        fd = open_nofollow(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint does not exist (deleted?)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.lstat(path).st_ino == os.fstat(fd).st_ino
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
        fd = open_nofollow(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not _owner.is_ckpt_dir(path, fd):
            _not_ours(path, "not only ckpt files")
            return False
        _faults.pause("retention")
        # relative to the locked directory's fd: had ``step-N`` been swapped for a symlink since
        # the open, the path would reach a manifest elsewhere
        os.unlink(MANIFEST, dir_fd=fd)  # no longer a checkpoint: never brought back by recovery
        _faults.fs_op(f"unlink {path.name}/{MANIFEST}")
        os.fsync(fd)
        _faults.fs_op(f"fsync {path.name}")
        doomed = root / _layout.del_name(path.name)
        os.rename(path, doomed)
        _faults.fs_op(f"rename {path.name} {doomed.name}")
        fsync_dir(root)
    finally:
        os.close(fd)
    remove_path(doomed)
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
        check_no_symlinks(self.root)
        fd = open_regular(self.root / LOCK, os.O_RDWR | os.O_CREAT, error=CheckpointError)
        if os.fstat(fd).st_nlink > 1:  # it is written below: never into a file shared elsewhere
            os.close(fd)
            raise CheckpointError(
                f"{self.root / LOCK}: has more than one hard link; ckpt never writes into a "
                "file that another path shares (remove it; it is recreated)"
            )
        if not _owner.is_ours(self.root / LOCK):  # another tool's file under ckpt's lock name
            os.close(fd)
            raise CheckpointError(
                f"{self.root / LOCK}: was not written by ckpt (not empty, not 'pid N'); "
                "refusing to write into it: move it away"
            )
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
        _faults.fs_op("lock")

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
