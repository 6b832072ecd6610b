"""docs/glossary.md gives each recurring word one meaning (issue 17, rule 7), and the code's
parameter names follow it."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "glossary.md"

REQUIRED = {"stage", "fetch", "pin", "direct", "index", "lease", "preadv", "download", "shard"}

# A parameter named after a glossary word must mean what the page says. Where the word has a
# meaning only in some packages, the parameter may appear only there.
PARAMETER_HOMES: dict[str, tuple[str, ...]] = {
    "direct": ("feedpipe/loader/", "feedpipe/device/", "feedpipe/datasets/zarr.py"),  # zarr: alias
    "pin": ("feedpipe/loader/", "feedpipe/device/", "ckpt/saving/pool.py"),  # page-locked memory
    "preadv": ("feedpipe/datasets/",),
}
# Today's exceptions: (file, parameter) -> why. The list may only shrink.
PARAMETER_EXCEPTIONS: dict[tuple[str, str], str] = {
}


def _rows(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows[1:]]


def _words() -> list[str]:
    out = []
    for cells in _rows(PAGE.read_text(), "# Glossary"):
        out += re.findall(r"\*\*([\w ]+?)\*\*", cells[0])
    return out


def test_the_glossary_is_in_the_site_and_defines_each_word_once() -> None:
    assert "glossary.md" in (ROOT / "mkdocs.yml").read_text()
    words = _words()
    assert len(words) == len(set(words)), sorted(w for w in words if words.count(w) > 1)
    assert set(words) >= REQUIRED, REQUIRED - set(words)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _members(path: Path, cls: str) -> set[str] | None:
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            for n in ast.walk(node):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    names.add(n.attr)
            return names
    return None


def test_names_not_following_the_glossary_yet_still_exist() -> None:
    """The list of names awaiting a rename shrinks: a renamed one must leave the list."""
    rows = _rows(PAGE.read_text(), "## Names that do not follow this page yet")
    assert rows
    sources = [*ROOT.glob("feedpipe/**/*.py"), *ROOT.glob("ckpt/**/*.py")]
    for cells in rows:
        for cls, member in re.findall(r"`(\w+)\.(\w+)", cells[0]):
            found = [m for p in sources if (m := _members(p, cls)) is not None]
            assert found, f"glossary: class {cls} not found"
            assert any(member in m for m in found), f"glossary: {cls}.{member} is gone"


def _parameters() -> set[tuple[str, str]]:
    out = set()
    for path in [*ROOT.glob("feedpipe/**/*.py"), *ROOT.glob("ckpt/**/*.py")]:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    if arg.arg in PARAMETER_HOMES:
                        out.add((rel, arg.arg))
    return out


def test_parameters_named_after_a_glossary_word_live_where_the_word_means_that() -> None:
    bad = {
        (f, w) for f, w in _parameters() if not any(f.startswith(h) for h in PARAMETER_HOMES[w])
    }
    assert sorted(bad - set(PARAMETER_EXCEPTIONS)) == []
    stale = sorted(set(PARAMETER_EXCEPTIONS) - bad)
    assert stale == [], f"these exceptions are gone, remove them from the list: {stale}"
