"""Writes below a directory that never go through a symlink: the one way ``feedpipe stage`` and
the shard cache create, rename, unlink and fsync files in their directories.

How it holds, whatever another process does to the tree meanwhile:

1. A tree's root is opened once (``O_DIRECTORY``; a root that is itself a link to a folder is
   that folder, resolved at that moment). Each level below it is opened once, relative to its
   parent's fd, with ``O_DIRECTORY | O_NOFOLLOW`` (``openat``): a symlink or a file where a
   directory is expected is refused by name (:class:`UnsafePathError`), never followed.
2. Every create (``O_CREAT | O_EXCL | O_NOFOLLOW``), rename, unlink, ``utime`` and ``fsync``
   names an entry relative to an open directory fd. A directory swapped for a symlink after it
   was opened is never written through: the fd still refers to the directory that was opened,
   and one that was removed takes no new entries (:class:`UnsafePathError` says so).
3. A library that wants a path to write to (fsspec's ``get_file``) gets the temp file's own fd
   path (:attr:`TempFile.fd_path`, ``/proc/self/fd/N``): it names the open file, not a directory
   entry, so no name is looked up on the way.
4. A temp is renamed over its final name only while that name still is the file this process
   created and wrote (:meth:`TempFile.commit` compares device and inode first).

Standard library only. :class:`Dir` and :class:`Tree` are thread-safe; their fds stay open
until :meth:`Tree.close` (or :meth:`Dir.close`, or garbage collection).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import weakref
from types import TracebackType

from feedpipe.io.remote import temp_name

__all__ = ["Dir", "TempFile", "Tree", "UnsafePathError", "fd_path", "read_regular"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_DIR = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)  # EMLINK: O_NOFOLLOW on some BSDs
# fsync(2) on a directory fd that a filesystem cannot sync (see feedpipe.io.fsutil)
_CANNOT_SYNC_DIRS = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


class UnsafePathError(OSError):
    """A path below a tree's root is a symlink, is not a directory, or was removed or replaced
    while in use; the message names it. Nothing was written through it."""


def read_regular(
    path: str | os.PathLike[str], *, dir_fd: int | None = None, limit: int | None = None
) -> bytes | None:
    """The bytes of ``path`` (relative to ``dir_fd`` if given) if it is a regular file of at most
    ``limit`` bytes; ``None`` if it cannot be opened, is a symlink (never followed), is no
    regular file or is longer. Opened non-blocking: a FIFO planted there never hangs the open.
    An error while reading is raised."""
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """A path naming the open file ``fd`` itself (``/proc/self/fd/N``; ``/dev/fd/N`` without
    ``/proc``), for libraries that take a path: opening it looks no name up in any directory."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _named(exc: OSError, path: str) -> OSError:
    """``exc`` again, naming ``path`` (the full path, not the name relative to a dir fd)."""
    cls = UnsafePathError if isinstance(exc, UnsafePathError) else type(exc)
    return cls(exc.errno, exc.strerror or str(exc), path)


class Dir:
    """One directory held open by fd; every entry named below is resolved in it, never through a
    symlink. ``path`` is what messages show."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self._close = weakref.finalize(self, os.close, fd)  # at most once: close() or GC

    @classmethod
    def at(cls, path: str | os.PathLike[str], *, create: bool = False) -> Dir:
        """Open the directory ``path`` (a link to a folder opens that folder); ``create`` makes it
        (and its parents) first. A file there is an :class:`UnsafePathError`."""
        shown = os.path.abspath(os.fspath(path))
        if create:
            os.makedirs(shown, exist_ok=True)
        try:
            fd = os.open(shown, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise UnsafePathError(errno.ENOTDIR, "is not a directory", shown) from None
        except OSError as exc:
            raise _named(exc, shown) from None
        return cls(fd, shown)

    def entry(self, name: str) -> str:
        """The path of ``name`` in this directory, for messages."""
        return os.path.join(self.path, name)

    def child(self, name: str, *, create: bool = False) -> Dir:
        """Open the directory ``name`` here (one level) without following a link; ``create``
        makes it first. A symlink or a file there is an :class:`UnsafePathError`."""
        shown = self.entry(name)
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise self._error(exc, shown) from None
        try:
            return Dir(os.open(name, _DIR_FLAGS, dir_fd=self.fd), shown)
        except OSError as exc:
            raise self._error(exc, shown) from None

    def open(self, name: str, flags: int, mode: int = 0o644) -> int:
        """``os.open`` of ``name`` here, never through a symlink (``O_NOFOLLOW``)."""
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except OSError as exc:
            raise self._error(exc, self.entry(name)) from None

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name`` here, or None (missing, a link, not a file)."""
        return read_regular(name, dir_fd=self.fd)

    def stat(self, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` here, or None when it does not exist."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def unlink(self, name: str) -> bool:
        """Remove the file (or link: the link only) ``name``; False when it was not there."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._error(exc, self.entry(name)) from None
        return True

    def touch(self, name: str) -> bool:
        """Set ``name``'s times to now (a link: the link's own); False when it is not there."""
        try:
            os.utime(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` over ``dst``, both in this directory."""
        try:
            os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            raise self._error(exc, self.entry(dst)) from None

    def fsync(self) -> None:
        """Make the creates, renames and unlinks here durable (where the filesystem can)."""
        try:
            os.fsync(self.fd)
        except OSError as exc:
            if exc.errno not in _CANNOT_SYNC_DIRS:
                raise _named(exc, self.path) from None

    def temp(self, final: str, nbytes: int) -> TempFile:
        """A new temp file beside ``final`` (:func:`~feedpipe.io.remote.temp_name`), open."""
        return TempFile.create(self, final, nbytes)

    def write_atomic(self, name: str, data: bytes, *, durable: bool = True) -> None:
        """Replace ``name`` with ``data`` through a temp: a reader sees old or new, never torn;
        ``durable`` fsyncs the file before the rename and this directory after it."""
        tmp = self.temp(name, len(data))
        try:
            with os.fdopen(os.dup(tmp.fd), "wb") as f:
                f.write(data)
            tmp.commit(durable=durable)
        finally:
            tmp.discard()
        if durable:
            self.fsync()

    def gone(self) -> bool:
        """True when this directory was removed (or renamed over) since it was opened."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Dir:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _error(self, exc: OSError, shown: str) -> OSError:
        """The error of an operation on ``shown`` here, saying what is unsafe about it."""
        if exc.errno in _NOT_A_DIR:
            what = "is a symlink" if _is_link(self.fd, shown) else "is not a directory"
            return UnsafePathError(exc.errno, f"{what} (never followed)", shown)
        if exc.errno == errno.ENOENT and self.gone():
            return UnsafePathError(
                exc.errno, f"{self.path} was removed or replaced while in use", shown
            )
        return _named(exc, shown)


def _is_link(dir_fd: int, shown: str) -> bool:
    try:
        st = os.stat(os.path.basename(shown), dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISLNK(st.st_mode)


class TempFile:
    """A file this process created beside ``final`` in ``where`` under a temp name, held open:
    written through its own fd (or :attr:`fd_path`), then renamed over ``final``."""

    def __init__(self, where: Dir, name: str, final: str, fd: int) -> None:
        self.where, self.name, self.final, self.fd = where, name, final, fd
        self._ident = _ident(os.fstat(fd))

    @classmethod
    def create(cls, where: Dir, final: str, nbytes: int) -> TempFile:
        """A new, empty temp for ``final`` (``O_EXCL``: never an existing file or link)."""
        name = temp_name(final, nbytes)
        fd = where.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        return cls(where, name, final, fd)

    @property
    def path(self) -> str:
        """The temp's path, for messages."""
        return self.where.entry(self.name)

    @property
    def fd_path(self) -> str:
        """A path naming this open file itself (:func:`fd_path`), for libraries."""
        return fd_path(self.fd)

    def reset(self) -> None:
        """Empty the file (a failed attempt's partial bytes), keeping its name and fd."""
        os.ftruncate(self.fd, 0)

    def commit(self, *, durable: bool = True) -> None:
        """Rename the temp over ``final`` (``durable``: fsync it first). Refused, naming the
        temp, when its name no longer is this file (removed or replaced meanwhile)."""
        if durable:
            os.fsync(self.fd)
        st = self.where.stat(self.name)
        if st is None or _ident(st) != self._ident or not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                errno.ESTALE, "was removed or replaced before its rename", self.path
            )
        self.where.replace(self.name, self.final)

    def discard(self) -> None:
        """Close the fd; remove the temp name if it still is this file (not after commit)."""
        try:
            st = self.where.stat(self.name)
            if st is not None and _ident(st) == self._ident:
                self.where.unlink(self.name)
        finally:
            os.close(self.fd)


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class Tree:
    """A root directory held open and the directories below it, each opened once through its
    parent (:meth:`Dir.child`) and kept open until :meth:`close`. Thread-safe."""

    def __init__(self, root: Dir) -> None:
        self.root = root
        self._dirs: dict[str, Dir] = {"": root}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = False) -> Tree:
        """The tree at ``path`` (see :meth:`Dir.at`)."""
        return cls(Dir.at(path, create=create))

    @property
    def path(self) -> str:
        return self.root.path

    def dir(self, rel: str, *, create: bool = False) -> Dir:
        """The directory ``rel`` (``"a/b"``; ``""`` is the root), each level opened once without
        following a link; ``create`` makes the missing levels. A level that is empty, ``.`` or
        ``..`` is a ``ValueError``: nothing below the root leads out of it."""
        with self._lock:
            got = self._dirs.get(rel)
            if got is not None:
                return got
            parts = rel.split("/")
            if any(part in ("", ".", "..") for part in parts):
                raise ValueError(f"{self.root.entry(rel)}: not a path below {self.path}")
            parent = ""
            where = self.root
            for part in parts:
                here = f"{parent}/{part}" if parent else part
                known = self._dirs.get(here)
                if known is None:
                    known = where.child(part, create=create)
                    self._dirs[here] = known
                where, parent = known, here
            return where

    def parent(self, relpath: str, *, create: bool = False) -> tuple[Dir, str]:
        """The open directory of the file ``relpath`` and its name there."""
        head, _, name = relpath.rpartition("/")
        return self.dir(head, create=create), name

    def fsync(self) -> None:
        """fsync every directory this tree opened, the deepest first (see :meth:`Dir.fsync`)."""
        with self._lock:
            dirs = sorted(self._dirs.items(), key=lambda kv: -kv[0].count("/") - bool(kv[0]))
        for _rel, d in dirs:
            d.fsync()

    def close(self) -> None:
        """Close every directory this tree opened (the root last)."""
        with self._lock:
            dirs, self._dirs = self._dirs, {}
        for rel, d in dirs.items():
            if rel:
                d.close()
        self.root.close()

    def __enter__(self) -> Tree:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
