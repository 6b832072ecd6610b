"""Publish a dataset written in a local folder to an fsspec URL: shard files first, index last.

A remote destination is treated like a local one (see
:func:`feedpipe.datasets.writer.prepare_destination`): an existing dataset is replaced only with
``overwrite``, and a non-empty prefix that is not a dataset is refused. When a dataset is
replaced, its ``index.json`` is deleted before any shard is written, so no reader ever sees the
old index over new shards; the new ``index.json`` is uploaded last, so a failed upload never
looks like a complete dataset.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from feedpipe.errors import DatasetError, DatasetExistsError
from feedpipe.format import INDEX_NAME, Index, parse_index, read_index
from feedpipe.io.destination import is_writer_file
from feedpipe.remote import transfer as _remote

__all__ = ["RemoteFolder", "check_remote_destination", "publish"]


def _listing(fs: Any, root: str) -> list[str]:
    try:
        return [p.rstrip("/") for p in fs.ls(root, detail=False) if p.rstrip("/") != root]
    except (FileNotFoundError, NotADirectoryError):
        return []


class RemoteFolder:
    """What a destination prefix holds: its entries' names, and its ``index.json`` if any."""

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        self.safe = _remote.redact(url, storage_options)
        try:
            fs, root = _remote.resolve(url, storage_options)
            self.entries = _listing(fs, root)
            self.names = sorted({e.rsplit("/", 1)[-1] for e in self.entries})
            has_index = INDEX_NAME in self.names
            self.raw_index: bytes | None = (
                fs.cat_file(_remote.join(root, INDEX_NAME)) if has_index else None
            )
        except DatasetError:
            raise
        except Exception as exc:
            detail = _remote.redact(f"{type(exc).__name__}: {exc}", storage_options)
            raise DatasetError(f"{self.safe}: cannot check the destination: {detail}") from None

    def index(self) -> Index:
        """The prefix's index; one that is not a feedpipe index is refused."""
        assert self.raw_index is not None, "index() of a prefix without index.json"
        try:
            return parse_index(self.raw_index, _remote.join(self.safe, INDEX_NAME))
        except DatasetError as exc:
            raise DatasetError(f"{exc}; refusing to write there, even with overwrite") from None

    def foreign(self, index: Index, also: Callable[[str], bool]) -> list[str]:
        """Entries that ``index`` does not list and ``also`` does not accept."""
        listed = {rel.split("/", 1)[0] for _s, rel, _n, _c in index.files()}
        return [n for n in self.names if n != INDEX_NAME and n not in listed and not also(n)]


def check_remote_destination(
    url: str,
    storage_options: Mapping[str, Any],
    *,
    overwrite: bool,
    also: Callable[[str], bool] = is_writer_file,
) -> None:
    """Refuse ``url`` unless it is empty, absent, or (with ``overwrite``) a feedpipe dataset
    holding only its own files: the rule of local destinations
    (:func:`feedpipe.datasets.destination.check_convert_destination`). An ``index.json`` that is
    not a feedpipe index, and any entry that index does not list (other than names ``also``
    accepts: a writer's or a conversion's own), is refused by name, even with ``overwrite``."""
    folder = RemoteFolder(url, storage_options)
    safe = folder.safe
    if folder.raw_index is None:
        if folder.entries:
            raise DatasetError(
                f"{safe}: destination is not empty and is not a feedpipe dataset; refusing to "
                f"write into it, even with overwrite ({', '.join(map(repr, folder.names[:10]))})"
            )
        return
    foreign = folder.foreign(folder.index(), also)
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:10])
        more = f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        raise DatasetError(
            f"{safe}: refusing to write a dataset here: it holds {len(foreign)} entr"
            f"{'y' if len(foreign) == 1 else 'ies'} that its dataset did not write ({shown}"
            f"{more}); choose an empty prefix, or move them away"
        )
    if not overwrite:
        raise DatasetExistsError(safe)


def publish(local: str, url: str, storage_options: Mapping[str, Any], *, overwrite: bool) -> None:
    """Upload the dataset in ``local`` to ``url``: old index removed, shard files, index last."""
    check_remote_destination(url, storage_options, overwrite=overwrite)
    index = read_index(local)
    fs, root = _remote.resolve(url, storage_options)
    old_index = _remote.join(root, INDEX_NAME)
    old_files: list[str] = []
    if fs.exists(old_index):
        old = _remote.call(
            lambda: fs.cat_file(old_index),
            url,
            what="read the old index",
            storage_options=storage_options,
        )
        old_files = [rel for _sid, rel, _n, _c in parse_index(old, url).files()]
        _remote.call(
            lambda: fs.rm_file(old_index),
            url,
            what="remove the old index",
            storage_options=storage_options,
        )
    new_files = [rel for _sid, rel, _n, _c in index.files()]
    for rel in [*new_files, INDEX_NAME]:
        src, dst = os.path.join(local, rel), _remote.join(root, rel)
        _remote.call(
            functools.partial(fs.put_file, src, dst),
            _remote.join(url, rel),
            what="upload",
            storage_options=storage_options,
        )
    for rel in sorted(set(old_files) - set(new_files)):  # the replaced dataset's leftovers
        try:
            fs.rm_file(_remote.join(root, rel))
        except FileNotFoundError:
            pass
