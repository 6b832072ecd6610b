"""The names a dataset writer gives its files: one owner for them (the writer, the conversion's
work folders, the publisher and the destination checks all ask here).

A shard's files are ``shard-NNNNN.<suffix>`` (:func:`shard_name`); each is written under a
temporary name holding :data:`TMP_MARK` and renamed when complete; ``index.json`` is written last.
Whether a name is one of these is :func:`feedpipe.io.destination.is_writer_file` (the destination
rule, shared with ``stage``).
"""

from __future__ import annotations

__all__ = ["TMP_MARK", "shard_name"]

TMP_MARK = ".tmp-"


def shard_name(shard_id: int, suffix: str) -> str:
    """Relative file name of one shard file, e.g. ``shard-00003.data``."""
    return f"shard-{shard_id:05d}.{suffix}"
