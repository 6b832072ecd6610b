"""The names a dataset writer gives its files: one owner for them (the writer, the conversion's
work folders, the publisher and the destination checks all ask here).

A shard's files are ``shard-NNNNN.<suffix>`` (:func:`shard_name`); each is written under a
temporary name holding :data:`TMP_MARK` and renamed when complete; ``index.json`` is written last.
"""

from __future__ import annotations

import re

__all__ = ["TMP_MARK", "is_writer_file", "shard_name"]

TMP_MARK = ".tmp-"
# names a writer creates: shard files, their temps, and the index and its temps
_OWN_NAME = re.compile(
    r"^(index\.json|\.index\.json\..*\.tmp|\.?shard-\d{5,}\.[A-Za-z0-9_.]+(\.tmp-[0-9a-f]{8})?)$"
)


def is_writer_file(name: str) -> bool:
    """Whether ``name`` is one a writer creates (a shard file, the index, their temps)."""
    return _OWN_NAME.match(name) is not None


def shard_name(shard_id: int, suffix: str) -> str:
    """Relative file name of one shard file, e.g. ``shard-00003.data``."""
    return f"shard-{shard_id:05d}.{suffix}"
