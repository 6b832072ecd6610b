"""Size and complexity of the library's code, measured from its AST (no import, no radon).

Used by the limits rule of ``tests/test_layers.py`` and runnable as a report::

    python -m tests._code_metrics            # the table: packages, largest objects, hot spots

Complexity is McCabe's, counted as radon counts it: 1, plus one for each ``if``/``elif``/
conditional expression, loop (and its ``else``), ``except`` handler (and ``try``'s ``else``),
``match`` case, comprehension (and each of its ``if``), and each extra operand of ``and``/``or``.
A nested function or class is measured on its own, not added to the one around it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("feedpipe", "ckpt")

__all__ = ["Block", "blocks", "complexity", "module_lines", "source_files"]


@dataclass(frozen=True)
class Block:
    """One function or class: ``where`` is ``module:Qual.name``."""

    kind: str  # "function" or "class"
    where: str
    lines: int
    complexity: int


def source_files(packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


class _Counter(ast.NodeVisitor):
    def __init__(self) -> None:
        self.n = 1

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return  # measured on its own
        if isinstance(node, (ast.If, ast.IfExp)):
            self.n += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            self.n += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            self.n += len(node.handlers) + bool(node.orelse)  # type: ignore[attr-defined]
        elif isinstance(node, ast.BoolOp):
            self.n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            self.n += 1 + len(node.ifs)
        elif type(node).__name__ == "match_case":
            self.n += 1
        super().generic_visit(node)


def complexity(node: ast.AST) -> int:
    counter = _Counter()
    for child in ast.iter_child_nodes(node):
        counter.visit(child)
    return counter.n


def _walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{child.name}" if prefix else child.name
            yield name, child
            yield from _walk(child, name)
        else:
            yield from _walk(child, prefix)


def blocks(path: Path) -> list[Block]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mod = module_name(path)
    out = []
    for name, node in _walk(tree, ""):
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines = (node.end_lineno or node.lineno) - start + 1
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        cx = complexity(node) if kind == "function" else 0
        out.append(Block(kind, f"{mod}:{name}", lines, cx))
    return out


def _report() -> None:
    files = source_files()
    all_blocks = [b for f in files for b in blocks(f)]
    funcs = [b for b in all_blocks if b.kind == "function"]
    classes = [b for b in all_blocks if b.kind == "class"]
    print("| package | modules | lines |")
    print("|---|---|---|")
    for pkg in PACKAGES:
        mods = [f for f in files if f.relative_to(ROOT).parts[0] == pkg]
        print(f"| {pkg} | {len(mods)} | {sum(module_lines(f) for f in mods)} |")
    print()
    print(f"functions > 60 lines: {sum(b.lines > 60 for b in funcs)}; "
          f"complexity > 15: {sum(b.complexity > 15 for b in funcs)}; "
          f"complexity > 20: {sum(b.complexity > 20 for b in funcs)}; "
          f"classes > 400 lines: {sum(b.lines > 400 for b in classes)}; "
          f"modules > 600 lines: {sum(module_lines(f) > 600 for f in files)}")
    for title, rows, key in (
        ("largest classes", classes, lambda b: b.lines),
        ("largest functions", funcs, lambda b: b.lines),
        ("most complex functions", funcs, lambda b: b.complexity),
    ):
        print(f"\n{title}:")
        for b in sorted(rows, key=key, reverse=True)[:10]:
            print(f"  {b.lines:5d} lines  cx {b.complexity:3d}  {b.where}")


if __name__ == "__main__":
    _report()
