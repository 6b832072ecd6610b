"""Stage a dataset from any fsspec URL (``s3://``, ``file://``, a Lustre/NFS path) to local disk.

The rules, in order:

0. The destination holds nothing stage did not write: a folder of user files, a user's own
   ``index.json`` or a symlink there is refused by name before anything is written
   (:func:`feedpipe.io.ownership.claim`, the rule ``convert`` follows too); a folder stage
   staged into before (marked ``.stage-owner.json``, or holding only a dataset's files) is
   resumed or refreshed.
1. The destination's ``index.json`` is removed before any shard is touched (unless it already is
   the source's index and every file is in place), so an interrupted stage of v2 over v1 leaves
   no index at all, never v1's index over v2's shards. ``index.json`` is written last, so a
   directory with an index is a complete dataset of that index.
2. Files are copied in parallel, each under a temp name
   (:data:`feedpipe.remote.transfer.TEMP_PREFIX`, which no dataset file may have), verified
   against the index (size and CRC32C) and renamed into place. No file is ever truncated or
   rewritten in place: a reader that has the old file mapped keeps reading the old bytes.
3. A symlink in the destination is never written through: a linked file or directory there is
   refused by rule 0; every write after that (temps, renames, the index, the lock, removals) names
   an entry under a directory fd opened once, each level with ``O_NOFOLLOW``
   (:mod:`feedpipe.io.dirfd`), so a directory swapped for a symlink during the stage is refused
   or the write lands in the directory that was opened, never through the link. Files are fsynced
   before their rename and their directories before ``index.json`` is written.
4. Ctrl-C (or any exception) cancels the transfers in flight at their next chunk; the temps are
   removed. ``deadline_s`` bounds the retries of every remote call and the index read as a
   whole, and caps the clients' socket timeouts (see :func:`feedpipe.remote.transfer.resolve`); a
   download that keeps receiving bytes is not cut off.
5. Two stages into one directory take turns (an exclusive ``flock`` on a lock file there).

Rerunning after an interruption copies only files that are missing or wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.io.cliargs import add_storage_arguments, positive_int, storage_options
from feedpipe.io.destination import DestinationError, claim_folder, folder_entries, is_writer_file
from feedpipe.io.dirfd import Dir, TempFile, Tree, UnsafePathError
from feedpipe.io.ownership import owns
from feedpipe.io.reaper import join_threads, pid_alive
from feedpipe.io.remote import is_s3_url, local_file_path
from feedpipe.remote import transfer as _remote
from feedpipe.remote.transfer import INDEX_NAME, FileEntry

__all__ = ["StageResult", "add_arguments", "run", "stage"]

_log = logging.getLogger("feedpipe.stage")

DEFAULT_WORKERS = 16
_CANCEL_GRACE_S = 2.0  # after Ctrl-C, how long transfers get to notice before we return


@dataclass(frozen=True)
class StageResult:
    """What :func:`stage` did: files copied, files skipped (already present and verified), bytes."""

    copied: int
    skipped: int
    bytes_copied: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_copied / 2**20 / self.seconds if self.seconds > 0 else 0.0


class _Bar:
    """A thread-safe byte counter feeding an optional tqdm bar (bytes, rate, ETA)."""

    def __init__(self, total: int, show: bool, desc: str) -> None:
        self._lock = threading.Lock()
        self._bar: Any = None
        if show:  # drawn only on a terminal, in the binary units of the summary
            from feedpipe.io.progress import progress

            self._bar = progress(total, desc, unit="B")

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def stage(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: bool = True,
    verify_existing: bool = True,
    deadline_s: float = 120.0,
) -> StageResult:
    """Copy the dataset at ``src`` (any fsspec URL or local path) into the local directory ``dst``.

    Files already in ``dst`` with the indexed size and CRC32C are kept (``verify_existing=False``
    trusts the size alone, but only when ``dst`` already holds this very ``index.json``);
    everything else is fetched with up to ``workers`` parallel transfers. Each remote call is
    retried on transient errors until ``deadline_s``. See the module docstring for what holds
    when the stage is interrupted. Raises :class:`~feedpipe.remote.transfer.RemoteError` (a
    :class:`~feedpipe.DatasetError`) naming the URL, with credentials redacted.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    url = os.fspath(src)
    dst = os.path.abspath(local_file_path(dst))  # file:///abs: /abs, never ./file:/abs
    if not _remote.is_remote(url) and os.path.realpath(local_file_path(url)) == os.path.realpath(
        dst
    ):  # a restage would remove the source's own index before it copies a file onto itself
        raise DatasetError(f"{dst}: is the source dataset itself; stage it into another folder")
    fs, root = _remote.resolve(url, _pooled(url, storage_options, workers), deadline_s)
    policy = _remote.RetryPolicy(deadline_s=deadline_s)
    t0 = time.perf_counter()
    # the first contact fails at once on an unreachable host (a wrong URL or a server that is
    # down); the transfers that follow retry every transient error until the deadline
    first = _remote.RetryPolicy(deadline_s=deadline_s, retry_unreachable=False)
    raw_index, entries = _remote.read_remote_index(fs, root, url, storage_options, first)
    _claim(dst, entries, adopt=False)  # before the lock file: a refused folder is left as is
    with _open_tree(dst) as tree, _exclusive(tree), _unsafe_as_dataset_error():
        return _stage_locked(
            fs,
            root,
            url,
            tree,
            raw_index=raw_index,
            entries=entries,
            storage_options=storage_options,
            workers=workers,
            progress=progress,
            verify_existing=verify_existing,
            policy=policy,
            t0=t0,
        )


def _stage_locked(
    fs: Any,
    root: str,
    url: str,
    tree: Tree,
    *,
    raw_index: bytes,
    entries: list[FileEntry],
    storage_options: Mapping[str, Any] | None,
    workers: int,
    progress: bool,
    verify_existing: bool,
    policy: _remote.RetryPolicy,
    t0: float,
) -> StageResult:
    """The body of :func:`stage`, run while this process alone stages into ``tree``."""
    _claim(tree.path, entries, at=tree.root)
    _open_dirs(tree, entries)
    _clean_stale_temps(tree.root)

    same_index = tree.root.read(INDEX_NAME) == raw_index
    # sizes alone are trusted only for this very version: another version's shards (or an
    # interrupted stage's leftovers) can have the same sizes and other bytes
    check_crc = verify_existing or not same_index
    todo: list[FileEntry] = []
    for e in entries:
        if not _remote.is_complete(*tree.parent(e.relpath), e, check_crc=check_crc):
            todo.append(e)
    if todo or not same_index:
        _invalidate(tree.root)  # before any shard is touched: never v1's index over v2's shards
    total = sum(e.nbytes for e in todo)
    bar = _Bar(total, progress, desc=f"stage {_remote.redact(url, storage_options)}")
    try:
        # largest first keeps the pool busy at the end of the run
        transfers = _Transfers(fs, root, url, tree, storage_options, policy, bar)
        transfers.run(sorted(todo, key=lambda e: -e.nbytes), workers)
    finally:
        bar.close()
    tree.fsync()  # every rename durable before the index that vouches for the files
    tree.root.write_atomic(INDEX_NAME, raw_index)
    return StageResult(len(todo), len(entries) - len(todo), total, time.perf_counter() - t0)


class _Transfers:
    """The verified downloads of one stage into ``tree``, on ``workers`` threads: on a failure
    (or an interrupt) the others are cancelled and the temps still in flight removed."""

    def __init__(  # noqa: PLR0917 - stage's own values, passed on
        self,
        fs: Any,
        root: str,
        url: str,
        tree: Tree,
        storage_options: Mapping[str, Any] | None,
        policy: _remote.RetryPolicy,
        bar: _Bar,
    ) -> None:
        self.fs, self.root, self.url, self.tree = fs, root, url, tree
        self.options, self.policy, self.bar = storage_options, policy, bar
        self.cancel = threading.Event()
        self._temps: set[TempFile] = set()
        self._lock = threading.Lock()

    def run(self, todo: list[FileEntry], workers: int) -> None:
        try:
            _run_all(todo, self.one, workers, self.cancel)
        except BaseException:
            self.cancel.set()
            with self._lock:
                left = list(self._temps)
            for tmp in left:  # transfers still in flight write to an unlinked file, then stop
                with contextlib.suppress(OSError):
                    tmp.where.unlink(tmp.name)
            raise

    def one(self, e: FileEntry) -> None:
        where, name = self.tree.parent(e.relpath)
        tmp = where.temp(name, e.nbytes)
        with self._lock:
            self._temps.add(tmp)
        try:
            _remote.fetch_verified(
                self.fs,
                _remote.join(self.root, e.relpath),
                _remote.join(self.url, e.relpath),
                (where, name),
                e,
                storage_options=self.options,
                progress=self.bar,
                policy=self.policy,
                tmp=tmp,
                cancel=self.cancel,
            )
        finally:
            with self._lock:
                self._temps.discard(tmp)


def _claim(
    dst: str, entries: list[FileEntry], *, adopt: bool = True, at: Dir | None = None
) -> None:
    """Make ``dst`` stage's by the one ownership rule (:mod:`feedpipe.io.destination`):
    it may hold only a dataset's own files (the source's, or those of the feedpipe index
    there), stage's temps and lock, and stage's marker; anything else (a user's own
    ``index.json``, their files, a symlink) is refused by name before anything is written.
    An unmarked folder counts as stage's earlier output only when it holds stage's lock file;
    any other dataset there (one ``convert`` wrote) is refused. ``adopt=False`` checks only.
    In a folder stage has marked, shard files of an older version whose index an interrupted
    restage removed are stage's too (named as feedpipe writes them).
    A ``dst`` that is a symlink to a folder stages into that folder, as before; ``at`` (the
    open destination) is where the marker goes: a ``dst`` swapped since it was opened is
    refused, never marked through the link."""
    real = os.path.realpath(dst)
    lock = os.path.basename(_lock_path(dst))
    try:
        marked = owns(real, "stage")
    except ValueError as exc:  # a malformed marker: never taken as ours
        raise DatasetError(str(exc)) from None
    except (FileNotFoundError, NotADirectoryError):
        marked = False

    def also(name: str) -> bool:
        return name == lock or _remote.is_temp(name) or (marked and is_writer_file(name))

    # an unmarked folder is stage's earlier output only if an earlier stage left its lock file
    # there (every version did); a dataset that convert or a user wrote is not stage's to replace
    earlier = marked or os.path.lexists(os.path.join(real, lock))
    if earlier:
        listed = [e.relpath for e in entries]
        ours = folder_entries(real, INDEX_NAME, _index_files, listed, also)
    else:

        def ours(path: Path) -> bool:
            return also(path.name)

    try:
        claim_folder(real, "stage", ours, INDEX_NAME, adopt=adopt, at=at)
    except DestinationError as exc:
        raise DatasetError(str(exc)) from None


def _index_files(raw: bytes, source: str) -> list[str] | None:
    """The files a feedpipe index lists, or None when ``raw`` is none."""
    try:
        return [e.relpath for e in _remote.parse_index(raw, source)]
    except DatasetError:
        return None


def _lock_path(dst: str) -> str:
    return os.path.join(dst, _remote.TEMP_PREFIX + "stage.lock")


def _pooled(
    url: str, storage_options: Mapping[str, Any] | None, workers: int
) -> Mapping[str, Any] | None:
    """For S3, a connection pool with room for every worker: botocore's default of 10
    connections would otherwise cap ``workers`` transfers at 10 (the caller's value wins)."""
    if not is_s3_url(url):
        return storage_options
    out = dict(storage_options or {})
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", max(10, workers))
    out["config_kwargs"] = config
    return out


@contextlib.contextmanager
def _exclusive(tree: Tree) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the stage lock in ``tree``: two stages into one directory
    (two versions, or every rank of a node) run one after the other, never interleaved. The lock
    file's name has the temp prefix, so no dataset file can have it."""
    import fcntl

    name = os.path.basename(_lock_path(tree.path))
    try:
        fd = tree.root.open(name, os.O_RDWR | os.O_CREAT)
    except OSError as exc:  # ELOOP: a symlink there, never followed
        where = tree.root.entry(name)
        raise DatasetError(f"{where}: cannot open the stage lock: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.info("%s: waiting for another feedpipe stage into this directory", tree.path)
            fcntl.flock(fd, fcntl.LOCK_EX)  # Ctrl-C interrupts the wait
        yield
    finally:
        os.close(fd)  # releases the lock


def _run_all(
    todo: list[FileEntry],
    one: Callable[[FileEntry], None],
    workers: int,
    cancel: threading.Event,
) -> None:
    """Run ``one`` over ``todo`` on daemon threads; the first error cancels the rest.

    Daemon threads, joined with a timeout: a Ctrl-C in the calling thread is seen at once, and a
    transfer stuck in a socket read cannot hold the interpreter's exit.
    """
    pending = iter(todo)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def _worker() -> None:
        while not cancel.is_set():
            with lock:
                e = next(pending, None)
            if e is None:
                return
            try:
                one(e)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                cancel.set()
                return

    threads = [
        threading.Thread(target=_worker, name=f"feedpipe-stage-{i}", daemon=True)
        for i in range(min(workers, max(1, len(todo))))
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except BaseException:
        cancel.set()
        join_threads(threads, "stage transfer", _CANCEL_GRACE_S)  # stuck ones are reported
        raise
    real = [e for e in errors if not isinstance(e, _remote.CancelledError)]
    if real or errors:
        raise (real or errors)[0]


@contextlib.contextmanager
def _open_tree(dst: str) -> Iterator[Tree]:
    """``dst`` (made if missing) held open for every write of the stage (a link to a folder is
    that folder); closed at the end."""
    with _unsafe_as_dataset_error():
        tree = Tree.open(dst, create=True)
    try:
        yield tree
    finally:
        tree.close()


@contextlib.contextmanager
def _unsafe_as_dataset_error() -> Iterator[None]:
    """A linked, missing or replaced directory on the way (:mod:`feedpipe.io.dirfd`), in this
    thread or a transfer's, is a :class:`DatasetError` naming the path."""
    try:
        yield
    except UnsafePathError as exc:
        raise DatasetError(
            f"{exc.filename}: {exc.strerror}; feedpipe stage never writes through links in the "
            "destination (remove it, or stage into another directory)"
        ) from None


def _invalidate(root: Dir) -> None:
    """Remove the destination's index (a link: the link only) and make that durable."""
    try:
        gone = root.unlink(INDEX_NAME)
    except IsADirectoryError:
        raise DatasetError(
            f"{root.entry(INDEX_NAME)}: is a directory, not a dataset index (remove it, or stage "
            "into another directory)"
        ) from None
    if gone:
        root.fsync()


def _open_dirs(tree: Tree, entries: list[FileEntry]) -> None:
    """Open (making them) the directories on every file's path, each level without following a
    link: a symlinked directory would take the write outside the destination, so it is refused
    by name before any transfer, and the ones opened are the ones written into."""
    for e in entries:
        tree.parent(e.relpath, create=True)


def _clean_stale_temps(root: Dir) -> None:
    """Remove temp files (:func:`feedpipe.remote.transfer.temp_name`) of processes now gone,
    walking the destination by directory fds (never into a link)."""
    for _path, _dirs, files, dir_fd in os.fwalk(".", dir_fd=root.fd):
        for name in files:
            target = _remote.temp_target(name)
            if target is not None and not pid_alive(target[2]):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``feedpipe stage SRC DST``."""
    parser.add_argument(
        "src", help="dataset URL or path (s3://bucket/ds, file:///..., /lustre/...)"
    )
    parser.add_argument("dst", help="local destination directory")
    parser.add_argument(
        "--workers", type=positive_int, default=DEFAULT_WORKERS, help="parallel transfers"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-verify-existing",
        action="store_true",
        help="trust sizes of files already there (only when DST already has this index)",
    )
    add_storage_arguments(parser, anon=True)


def run(args: argparse.Namespace) -> int:
    """Run ``feedpipe stage``; credentials come from the usual environment/config of the backend."""
    import sys

    options = storage_options(args)
    try:
        result = stage(
            args.src,
            args.dst,
            storage_options=options or None,
            workers=args.workers,
            progress=not args.no_progress,
            verify_existing=not args.no_verify_existing,
        )
    except KeyboardInterrupt:  # other errors: one redacted line from the CLI's handler
        print(
            "feedpipe stage: interrupted; rerun it to finish (a partly staged destination has no "
            "index.json, so it never opens as a mix of versions)",
            file=sys.stderr,
        )
        return 130
    print(
        f"staged {args.dst}: {result.copied} files copied ({result.bytes_copied / 2**20:.1f} MiB, "
        f"{result.mb_per_s:.1f} MiB/s), {result.skipped} already present"
    )
    return 0
