"""Where a ``MemmapWriter`` writes: the destination checks (a writer never deletes what it did
not write) and :class:`WriteTarget`, a local folder or a local temporary folder published to a
URL on close (:mod:`feedpipe.datasets._publish`: shard files first, index last).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from feedpipe.errors import DatasetError, DatasetExistsError
from feedpipe.format import INDEX_NAME, read_index
from feedpipe.io.destination import is_writer_file
from feedpipe.io.remote import local_file_path

__all__ = ["WriteTarget", "check_destination", "prepare_destination"]


def check_destination(path: str, *, overwrite: bool) -> bool:
    """Refuse ``path`` unless a new dataset may be written there; True if something is there.

    Absent or empty: fine. A dataset (``index.json``) holding only its own files: fine with
    ``overwrite``, else refused. Anything else (a file, a folder holding other files, a dataset
    with extra files) is refused even with ``overwrite``: feedpipe never deletes what it did not
    write. Leftovers of an interrupted writer (shard files, no index) count as its own.
    """
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not os.path.isdir(path):
        raise DatasetError(
            f"{path}: exists and is not a dataset folder; refusing to replace it"
            + (" (did you forget DEST?)" if path.endswith((".npy", ".npz")) else "")
        )
    folder = _Folder(path)
    foreign = folder.foreign()
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise DatasetError(
            f"{path}: folder holds files feedpipe did not write ({shown}); refusing to write "
            "into it, even with overwrite (choose a new or empty folder)"
        )
    if folder.has_index:
        extra = folder.unlisted()
        if extra:
            raise DatasetError(
                f"{path}: the dataset folder holds files its index does not list ({extra[0]}...); "
                "refusing to replace it"
            )
        if not overwrite:
            raise DatasetExistsError(path)
    return bool(folder.entries)


class _Folder:
    """What an existing destination folder holds, as a writer judges it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries = os.listdir(path)
        self.has_index = INDEX_NAME in self.entries

    def foreign(self) -> list[str]:
        """Entries a writer never creates (other names, links, folders), sorted."""
        return sorted(e for e in self.entries if not self._own(e))

    def _own(self, entry: str) -> bool:
        full = os.path.join(self.path, entry)
        return is_writer_file(entry) and not os.path.islink(full) and not os.path.isdir(full)

    def unlisted(self) -> list[str]:
        """Files the folder's index does not list (a damaged index: not ours, it raises)."""
        listed = {rel for _sid, rel, _n, _c in read_index(self.path).files()}
        return sorted(
            e for e in self.entries if e[0] != "." and e != INDEX_NAME and e not in listed
        )


def prepare_destination(path: str, *, overwrite: bool) -> None:
    """:func:`check_destination`, then delete the old dataset's files (its index first)."""
    if not check_destination(path, overwrite=overwrite):
        return
    entries = os.listdir(path)
    for e in sorted(entries, key=lambda e: e == INDEX_NAME, reverse=True):
        os.unlink(os.path.join(path, e))


class WriteTarget:
    """Where a writer's files go: its folder, or (a URL) a local temporary folder published
    there on close, index last, and deleted on abort."""

    def __init__(
        self, path: str, storage_options: Mapping[str, Any] | None, *, overwrite: bool
    ) -> None:
        from feedpipe.remote import transfer as _remote

        self.overwrite = overwrite
        self.options = dict(storage_options or {})
        self.url: str | None = None
        if _remote.is_remote(path):
            from feedpipe.datasets._publish import check_remote_destination

            check_remote_destination(path, self.options, overwrite=overwrite)
            self.path = self.url = path
            self.local = tempfile.mkdtemp(prefix="feedpipe-upload-")
        else:
            self.path = self.local = local_file_path(path)
            prepare_destination(self.path, overwrite=overwrite)
            os.makedirs(self.path, exist_ok=True)

    def publish(self) -> None:
        """After the index is written: upload a URL's dataset (then the temporary folder goes)."""
        if self.url is None:
            return
        from feedpipe.datasets._publish import publish

        try:
            publish(self.local, self.url, self.options, overwrite=self.overwrite)
        finally:
            shutil.rmtree(self.local, ignore_errors=True)

    def discard(self) -> None:
        """After an abort: a URL's temporary folder goes (a local folder keeps no index)."""
        if self.url is not None:
            shutil.rmtree(self.local, ignore_errors=True)
