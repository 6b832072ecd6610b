"""Dead code named by issue 17 stays gone (the other items: ``ShardCache.hold`` goes with the
cache's lease rename, ``_LoaderIter._finalize`` with the loader move)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _members(path: str, cls: str | None) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    body = tree.body
    if cls is not None:
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        body = node.body
    names: set[str] = set()
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def test_memmap_writer_has_no_finish_shards() -> None:
    """It closed the writer without an index, for a shard merger that never came; no caller."""
    assert "finish_shards" not in _members("feedpipe/datasets/writer.py", "MemmapWriter")


def test_ckpt_remote_has_no_state_table() -> None:
    assert "_STATES" not in _members("ckpt/remote.py", None)


def test_image_loader_sets_no_running_flag() -> None:
    """``ImageLoader._running`` was written in five places and read in none."""
    source = (ROOT / "feedpipe" / "dali" / "loader.py").read_text()
    assert "_running" not in source
