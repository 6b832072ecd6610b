"""Remote datasets: the shared remote layer (:mod:`feedpipe.io.remote`) plus verified transfers.

Resolving, retrying, classifying and redacting live in :mod:`feedpipe.io.remote` (shared with
ckpt) and are re-exported here. This module adds what knows about datasets: :func:`call` raising
:class:`~feedpipe.errors.RemoteError` (a ``DatasetError``), the index listing
(:func:`read_remote_index`, :func:`parse_index`) and :func:`fetch_verified`, which copies a file
through a temp name and checks its size and CRC32C against the index, every write under an open
directory fd (:mod:`feedpipe.io.dirfd`).
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from feedpipe.errors import DatasetError, RemoteError, require
from feedpipe.format import INDEX_NAME
from feedpipe.io.crc import crc32c_file, to_hex
from feedpipe.io.dirfd import Dir, TempFile, fd_path
from feedpipe.io.remote import (
    DEFAULT_POLICY,
    TEMP_PREFIX,
    CancelledError,
    RetryPolicy,
    classify,
    is_remote,
    is_s3_url,
    is_temp,
    join,
    redact,
    temp_name,
    temp_target,
    within,
)
from feedpipe.io.remote import call as _io_call
from feedpipe.io.remote import resolve as _io_resolve

__all__ = [
    "DEFAULT_POLICY",
    "INDEX_NAME",
    "TEMP_PREFIX",
    "CancelledError",
    "FileEntry",
    "RemoteError",
    "RetryPolicy",
    "call",
    "classify",
    "fetch_verified",
    "is_complete",
    "is_remote",
    "is_temp",
    "join",
    "parse_index",
    "read_remote_index",
    "redact",
    "resolve",
    "temp_name",
    "temp_target",
]

T = TypeVar("T")


def resolve(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    deadline_s: float | None = None,
) -> tuple[Any, str]:
    """:func:`feedpipe.io.remote.resolve`; a missing ``s3fs`` is a ``MissingExtraError``."""
    if is_s3_url(url):
        require("s3fs", "s3")
    return _io_resolve(url, storage_options, deadline_s)


def call(
    fn: Callable[[], T],
    url: str,
    *,
    what: str = "read",
    policy: RetryPolicy | None = None,
    storage_options: Mapping[str, Any] | None = None,
    on_retry: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> T:
    """:func:`feedpipe.io.remote.call` raising :class:`~feedpipe.errors.RemoteError`."""
    return _io_call(
        fn,
        url,
        what=what,
        policy=policy,
        storage_options=storage_options,
        on_retry=on_retry,
        cancel=cancel,
        error=RemoteError,
    )


# ---------------------------------------------------------------- verified transfers

_MIN_ATTEMPT_S = 5.0  # the least time one bounded attempt gets, even past the deadline


@dataclass(frozen=True)
class FileEntry:
    """One file of a dataset as its index lists it."""

    shard: int
    relpath: str
    nbytes: int
    crc32c: str


def _entries_from_index(doc: Any, url: str) -> list[FileEntry]:
    from feedpipe.format import Index

    out: list[FileEntry] = []
    for shard_id, rel, nbytes, crc in Index.from_json(doc, url).files():
        if not isinstance(rel, str) or any(ord(c) < 32 or ord(c) == 127 for c in rel):
            raise DatasetError(
                f"{url}: shard {shard_id} file path {rel!r} is not a string without control "
                "characters"
            )
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts:
            raise DatasetError(f"{url}: shard {shard_id} file path {rel!r} escapes the dataset")
        if rel == INDEX_NAME or any(p.startswith(TEMP_PREFIX) or p in ("", ".") for p in parts):
            raise DatasetError(
                f"{url}: shard {shard_id} file path {rel!r} is not a valid dataset file name "
                f"(empty, '.', {INDEX_NAME!r}, or starts with {TEMP_PREFIX!r}, which feedpipe "
                "keeps for temps)"
            )
        out.append(FileEntry(shard_id, rel, int(nbytes), str(crc).lower()))
    return out


def read_remote_index(
    fs: Any,
    root: str,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    policy: RetryPolicy | None = None,
) -> tuple[bytes, list[FileEntry]]:
    """Fetch ``index.json`` below ``root`` (retries under ``policy``); return bytes and files."""
    index_url = join(url, INDEX_NAME)
    policy = policy or DEFAULT_POLICY
    end = time.monotonic() + policy.deadline_s
    raw: bytes = call(
        # a server that answers a byte at a time resets every socket timeout: bound the whole
        # read (an attempt gets at least a few seconds: the first one also builds the client)
        lambda: within(
            lambda: fs.cat_file(join(root, INDEX_NAME)),
            max(end - time.monotonic(), _MIN_ATTEMPT_S),
        ),
        index_url,
        what="read dataset index",
        storage_options=storage_options,
        policy=policy,
    )
    return raw, parse_index(raw, redact(index_url, storage_options))


def parse_index(raw: bytes, index_url: str) -> list[FileEntry]:
    """The files an ``index.json`` lists; raises :class:`DatasetError` naming ``index_url``."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise DatasetError(f"{index_url}: index is not valid JSON: {why}") from None
    return _entries_from_index(doc, index_url)


def is_complete(where: Dir, name: str, entry: FileEntry, *, check_crc: bool = True) -> bool:
    """True if ``name`` in ``where`` is a regular file (not a link) with the indexed size (and
    CRC32C)."""
    try:
        fd = where.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False  # missing, a link, a fifo without a writer...
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.nbytes:
            return False
        if not check_crc:
            return True
        crc, _ = crc32c_file(fd_path(fd))
        return to_hex(crc) == entry.crc32c
    finally:
        os.close(fd)


def fetch_verified(
    fs: Any,
    rpath: str,
    url: str,
    dest: tuple[Dir, str],
    entry: FileEntry,
    *,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    policy: RetryPolicy | None = None,
    tmp: TempFile | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Copy ``rpath`` to ``dest`` (an open directory and a name there) via a temp file, verify size
    and CRC32C, fsync it and rename it into place (:mod:`feedpipe.io.dirfd`: nothing is written
    through a symlink, even one swapped in for a directory meanwhile).

    ``tmp`` is the temp to use (default: a new one beside ``name``); it is removed on failure
    and closed in any case. ``name`` is never written in place (a reader may have it mapped):
    the rename replaces it (or a symlink there, whose target is left alone). ``cancel``, once
    set, aborts the transfer at its next chunk with :class:`CancelledError`.

    Transient errors are retried (a partial download is discarded and its progress rolled back);
    a checksum mismatch is retried once, then raises :class:`DatasetError` naming the URL.
    """
    where, name = dest
    tmp = tmp or where.temp(name, entry.nbytes)
    download = _Download(fs, rpath, url, tmp, progress=progress, cancel=cancel)
    try:
        for attempt in (1, 2):
            call(
                download.get,
                url,
                what="download",
                storage_options=storage_options,
                policy=policy,
                on_retry=download.rollback,
                cancel=cancel,
            )
            crc, size = crc32c_file(tmp.fd_path)
            if cancel is not None and cancel.is_set():
                raise CancelledError(url)
            if size == entry.nbytes and to_hex(crc) == entry.crc32c:
                tmp.commit()
                return
            download.rollback()
            if attempt == 2:
                raise DatasetError(
                    f"{redact(url, storage_options)}: downloaded file does not match the index "
                    f"(got {size} bytes, crc32c {to_hex(crc)}; index says {entry.nbytes} bytes, "
                    f"crc32c {entry.crc32c})"
                )
    finally:
        tmp.discard()


class _Download:
    """One file's download into ``tmp``: the bytes it reported to ``progress`` (rolled back with
    the partial file before a retry), and the check of ``cancel`` at each chunk."""

    def __init__(
        self,
        fs: Any,
        rpath: str,
        url: str,
        tmp: TempFile,
        *,
        progress: Callable[[int], None] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.fs, self.rpath, self.url, self.tmp = fs, rpath, url, tmp
        self.progress, self.cancel = progress, cancel
        self.done = 0

    def advance(self, inc: int) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(self.url)
        self.done += inc
        if self.progress is not None:
            self.progress(inc)

    def rollback(self) -> None:
        if self.progress is not None and self.done:
            self.progress(-self.done)
        self.done = 0
        self.tmp.reset()

    def get(self) -> None:
        from fsspec.callbacks import Callback

        advance = self.advance

        class _Progress(Callback):  # type: ignore[misc]
            def relative_update(self, inc: int = 1) -> None:
                advance(inc)

            def call(self, *args: Any, **kwargs: Any) -> None:
                return None

        # the open temp's own path: the library looks no directory entry up (feedpipe.io.dirfd)
        self.fs.get_file(self.rpath, self.tmp.fd_path, callback=_Progress())
        if self.done == 0 and self.progress is not None:  # filesystems that report no progress
            size = os.fstat(self.tmp.fd).st_size
            self.done = size
            self.progress(size)
