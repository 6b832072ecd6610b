"""What the remote root holds: one ``RemoteListing`` per ``step-N`` prefix, from one recursive
listing (``list_remote``)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt import _layout

__all__ = ["RemoteListing", "list_remote"]


@dataclass
class RemoteListing:
    """One ``step-N`` prefix on the remote: committed (has a manifest), its newest object time,
    and the names under it that ckpt never writes (``foreign``: such a prefix is never deleted)."""

    step: int
    committed: bool
    newest_mtime: float
    foreign: list[str] = field(default_factory=list)


def _mtime(info: Mapping[str, Any]) -> float:
    value = info.get("LastModified") or info.get("mtime") or info.get("created") or 0.0
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def list_remote(fs: Any, root: str) -> dict[int, RemoteListing]:
    """Every ``step-N`` prefix below ``root`` (one recursive listing)."""
    fs.invalidate_cache(root)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[int, RemoteListing] = {}
    base = root.rstrip("/") + "/"
    for path, info in found.items():
        rel = path[len(base) :] if path.startswith(base) else path
        head, _, tail = rel.partition("/")
        step = _layout.step_number(head)
        if step is None:
            continue
        entry = out.setdefault(step, RemoteListing(step, False, 0.0))
        entry.committed |= tail == _layout.MANIFEST
        if tail != _layout.MANIFEST and not _layout.is_data_name(tail):
            entry.foreign.append(tail)
        entry.newest_mtime = max(entry.newest_mtime, _mtime(info))
    return out
