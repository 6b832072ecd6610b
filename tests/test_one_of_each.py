"""One of each kind of helper (issue 17, docs/architecture.md "One of each"): a module-level
definition of these names (with or without a leading underscore) exists only in its home."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

HOMES: dict[str, set[str]] = {
    "is_remote": {"feedpipe/io/remote.py"},
    "INDEX_NAME": {"feedpipe/datasets/format.py"},
    "scratch": {"feedpipe/datasets/_gather.py"},
    "inverse": {"feedpipe/datasets/_gather.py"},
    "ROW_COPY_MIN": {"feedpipe/datasets/_gather.py"},
    "progress": {"feedpipe/io/progress.py"},
    "NullBar": {"feedpipe/io/progress.py"},
    "atomic_write": {"feedpipe/io/fsutil.py"},
    # ckpt's adds only the fault-injection point of its crash tests (checked below)
    "fsync_dir": {"feedpipe/io/fsutil.py", "ckpt/saving/commit.py"},
}


def _definitions(path: Path) -> set[str]:
    """Module-level functions, classes and assigned names, leading underscores stripped."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n.lstrip("_") for n in names}


def test_each_helper_is_defined_only_in_its_home() -> None:
    found: dict[str, set[str]] = {name: set() for name in HOMES}
    for path in sorted([*ROOT.glob("feedpipe/**/*.py"), *ROOT.glob("ckpt/**/*.py")]):
        for name in _definitions(path) & set(HOMES):
            found[name].add(str(path.relative_to(ROOT)))
    assert found == HOMES


def test_ckpt_fsync_dir_delegates_to_feedpipe_io() -> None:
    """ckpt's ``fsync_dir`` opens and syncs nothing itself: one error rule for both packages."""
    tree = ast.parse((ROOT / "ckpt" / "saving" / "commit.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fsync_dir"]
    calls = {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    assert "io_fsync_dir" in calls
    assert not {"os.open", "os.fsync", "os.close"} & calls


def test_gather_helpers() -> None:
    import threading

    from feedpipe.datasets._gather import inverse, scratch

    order = np.random.default_rng(0).permutation(50)
    inv = inverse(order)
    assert (inv[order] == np.arange(50)).all() and (order[inv] == np.arange(50)).all()
    tls = threading.local()
    a = scratch(tls, np.empty((4, 8), np.float32))
    b = scratch(tls, np.empty((2, 3), np.int64))  # smaller: the same memory, reshaped
    assert a.shape == (4, 8) and b.shape == (2, 3) and b.dtype == np.int64
    assert np.shares_memory(a, b)
    c = scratch(tls, np.empty((100, 8), np.uint8))  # larger: a new buffer
    assert c.shape == (100, 8) and not np.shares_memory(a, c)
