"""Size and complexity of the library's code, measured from its AST (no import, no radon).

Used by the limits rule of ``tests/test_layers.py`` and runnable as a report::

    python -m tests._code_metrics            # the table: packages, largest objects, hot spots
    python -m tests._code_metrics --allow-lists           # print tests/_allow_lists.py anew
    python -m tests._code_metrics --allow-lists --write   # rewrite it (keeps the reasons)

Complexity is McCabe's, counted as radon counts it: 1, plus one for each ``if``/``elif``/
conditional expression, loop (and its ``else``), ``except`` handler (and ``try``'s ``else``),
``match`` case, comprehension (and each of its ``if``), and each extra operand of ``and``/``or``.
A nested function or class is measured on its own, not added to the one around it.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("feedpipe", "ckpt")

# The limits of tests/test_layers.py.
FUNCTION_LINES = 60
FUNCTION_COMPLEXITY = 15
CLASS_LINES = 400
MODULE_LINES = 600

__all__ = [
    "CLASS_LINES",
    "FUNCTION_COMPLEXITY",
    "FUNCTION_LINES",
    "MODULE_LINES",
    "Block",
    "blocks",
    "complexity",
    "module_lines",
    "over_limits",
    "source_files",
]


@dataclass(frozen=True)
class Block:
    """One function or class: ``where`` is ``module:Qual.name``."""

    kind: str  # "function" or "class"
    where: str
    lines: int
    complexity: int


def source_files(packages: tuple[str, ...] = PACKAGES, root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mod = module_name(path, root)
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
    print(
        f"functions > 60 lines: {sum(b.lines > 60 for b in funcs)}; "
        f"complexity > 15: {sum(b.complexity > 15 for b in funcs)}; "
        f"complexity > 20: {sum(b.complexity > 20 for b in funcs)}; "
        f"classes > 400 lines: {sum(b.lines > 400 for b in classes)}; "
        f"modules > 600 lines: {sum(module_lines(f) > 600 for f in files)}"
    )
    for title, rows, key in (
        ("largest classes", classes, lambda b: b.lines),
        ("largest functions", funcs, lambda b: b.lines),
        ("most complex functions", funcs, lambda b: b.complexity),
    ):
        print(f"\n{title}:")
        for b in sorted(rows, key=key, reverse=True)[:10]:
            print(f"  {b.lines:5d} lines  cx {b.complexity:3d}  {b.where}")


def over_limits(
    packages: tuple[str, ...] = PACKAGES, root: Path = ROOT
) -> tuple[dict[str, tuple[int, int]], dict[str, int], dict[str, int]]:
    """What is over the limits now: functions ``{"module:Qual.name": (lines, complexity)}``,
    classes ``{"module:Qual.name": lines}``, modules ``{"module": lines}``. Two definitions of
    one name in a module (a property's getter and setter) count as one, with the larger figures."""
    funcs: dict[str, tuple[int, int]] = {}
    classes: dict[str, int] = {}
    modules: dict[str, int] = {}
    for path in source_files(packages, root):
        if module_lines(path) > MODULE_LINES:
            modules[module_name(path, root)] = module_lines(path)
        for b in blocks(path, root):
            if b.kind == "class" and b.lines > CLASS_LINES:
                classes[b.where] = max(b.lines, classes.get(b.where, 0))
            elif b.kind == "function":
                was = funcs.get(b.where, (0, 0))
                funcs[b.where] = (max(was[0], b.lines), max(was[1], b.complexity))
    funcs = {k: v for k, v in funcs.items() if v[0] > FUNCTION_LINES or v[1] > FUNCTION_COMPLEXITY}
    return dict(sorted(funcs.items())), dict(sorted(classes.items())), dict(sorted(modules.items()))


ALLOW_LISTS = Path(__file__).resolve().parent / "_allow_lists.py"
_TODO = "TODO: say why it is still there"

_HEADER = '''"""Today's exceptions to the rules of tests/test_layers.py. Every list may only
shrink: an entry that grew or is gone fails the test, and a new offender is never added by hand.

Regenerated after a refactor by ``python -m tests._code_metrics --allow-lists --write`` (a cycle
keeps the reason it had; a cycle new to the list says TODO and wants one).
"""'''


def _reasons(name: str) -> dict[tuple[str, ...], str]:
    """The reasons the current allow-list file gives for its cycles (read as text: a shell
    redirect may have emptied it)."""
    if not ALLOW_LISTS.is_file():
        return {}
    for node in ast.parse(ALLOW_LISTS.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == name and node.value:
            return dict(ast.literal_eval(node.value))
    return {}


def _py(value: object) -> str:
    """``value`` as ruff format writes it (double quotes)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, tuple):
        return "(" + ", ".join(_py(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def _value(prefix: str, value: object) -> list[str]:
    """``prefix`` followed by ``value``, a long string split over lines within 100 columns."""
    line = f"{prefix}{_py(value)},"
    if len(line) <= 100 or not isinstance(value, str):
        return [line]
    words, chunks, cur = value.split(" "), [], ""
    for word in words:
        if cur and len(cur) + len(word) + 12 > 100:
            chunks.append(cur)
            cur = ""
        cur += word + " "
    chunks.append(cur.rstrip(" "))
    return [f"{prefix}(", *(f"        {_py(c)}" for c in chunks), "    ),"]


def _literal(name: str, kind: str, value: dict[Any, Any], why: str) -> str:
    lines = [f"# {why}", f"{name}: {kind} = {{"]
    for k, v in value.items():
        flat = _value(f"    {_py(k)}: ", v)
        if len(flat) == 1 or not isinstance(k, tuple):
            lines += flat
        else:
            lines += ["    (", *(f"        {_py(part)}," for part in k), *_value("    ): ", v)]
    lines.append("}")
    return "\n".join(lines) + "\n"


def allow_lists(root: Path = ROOT) -> str:
    """The text of tests/_allow_lists.py for the tree under ``root`` as it is now."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import _code_scan as scan

    funcs, classes, modules = over_limits(PACKAGES, root)
    parts = [_HEADER]
    for name, found, what in (
        ("IMPORT_CYCLES", scan.cycles(root), "module import cycles (TYPE_CHECKING imports count)"),
        ("ROOM_CYCLES", scan.room_cycles(root), "cycles between rooms (subpackages)"),
    ):
        old = _reasons(name)
        listed = {c: old.get(c, _TODO) for c in found}
        parts.append(_literal(name, "dict[tuple[str, ...], str]", listed, what))
    parts.append(
        _literal(
            "PRIVATE_ATTRIBUTES",
            "dict[str, int]",
            dict(scan.private_attributes(root)),
            "obj._x where obj is not self/cls: 'module: access' -> how many times",
        )
    )
    parts.append(
        _literal(
            "TORCH_PRIVATE",
            "dict[str, int]",
            dict(scan.torch_private_touches(root)),
            "torch's private API outside the two _torch_compat modules -> how many times",
        )
    )
    parts.append(
        _literal(
            "FUNCTIONS",
            "dict[str, tuple[int, int]]",
            dict(funcs),
            f"functions over {FUNCTION_LINES} lines or complexity {FUNCTION_COMPLEXITY}: "
            "(lines, complexity)",
        )
    )
    parts.append(
        _literal("CLASSES", "dict[str, int]", dict(classes), f"classes over {CLASS_LINES} lines")
    )
    parts.append(
        _literal("MODULES", "dict[str, int]", dict(modules), f"modules over {MODULE_LINES} lines")
    )
    return "\n\n".join(parts)


def main(argv: list[str]) -> int:
    if "--allow-lists" not in argv:
        _report()
        return 0
    text = allow_lists()
    if "--write" in argv:
        ALLOW_LISTS.write_text(text, encoding="utf-8")
        print(f"wrote {ALLOW_LISTS}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
