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
from collections.abc import Mapping
from typing import Any

from feedpipe.datasets.format import INDEX_NAME, parse_index, read_index
from feedpipe.errors import DatasetError
from feedpipe.remote import transfer as _remote

__all__ = ["check_remote_destination", "publish"]


def _listing(fs: Any, root: str) -> list[str]:
    try:
        return [p.rstrip("/") for p in fs.ls(root, detail=False) if p.rstrip("/") != root]
    except (FileNotFoundError, NotADirectoryError):
        return []


def check_remote_destination(
    url: str, storage_options: Mapping[str, Any], *, overwrite: bool
) -> None:
    """Refuse ``url`` unless it is empty, absent, or (with ``overwrite``) a dataset."""
    safe = _remote.redact(url, storage_options)
    try:
        fs, root = _remote.resolve(url, storage_options)
        has_index = fs.exists(_remote.join(root, INDEX_NAME))
        entries = [] if has_index else _listing(fs, root)
    except DatasetError:
        raise
    except Exception as exc:
        detail = _remote.redact(f"{type(exc).__name__}: {exc}", storage_options)
        raise DatasetError(f"{safe}: cannot check the destination: {detail}") from None
    if has_index and not overwrite:
        raise DatasetError(f"{safe}: a dataset already exists here (pass overwrite=True)")
    if entries:
        raise DatasetError(
            f"{safe}: destination is not empty and is not a feedpipe dataset; refusing to write "
            "into it, even with overwrite"
        )


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
