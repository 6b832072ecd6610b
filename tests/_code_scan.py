"""The import graph and the private accesses of the library, read from its AST (no import).

Used by the cycle, private-attribute and torch-private rules of ``tests/test_layers.py`` and by
``python -m tests._code_metrics --allow-lists``. Every scanner takes the tree's root, so a test
can run it on a tiny synthetic tree and see it fail on a violation.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import _code_metrics as metrics  # tests/ is on sys.path (pytest, and metrics.allow_lists)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("feedpipe", "ckpt")

# The modules allowed to touch torch's private API (each touch named there).
TORCH_COMPAT = (
    "feedpipe/loader/_torch_compat.py",
    "feedpipe/stall/_torch_compat.py",
    "ckpt/_torch_compat.py",
)

__all__ = [
    "PACKAGES",
    "ROOT",
    "TORCH_COMPAT",
    "cycles",
    "import_graph",
    "imports",
    "module_name",
    "private_attributes",
    "private_attributes_of",
    "room",
    "room_cycles",
    "source_files",
    "strongly_connected",
    "torch_private_touches",
    "torch_private_touches_of",
]


def source_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[Path]:
    return metrics.source_files(tuple(packages), root)


def module_name(path: Path, root: Path = ROOT) -> str:
    return metrics.module_name(path, root)


def is_module(name: str, root: Path = ROOT) -> bool:
    rel = Path(*name.split("."))
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def imports(path: Path, root: Path = ROOT) -> list[tuple[str, str | None]]:
    """Every import of ``path`` (top level, inside functions, under ``TYPE_CHECKING``) as
    ``(module, name)``: ``name`` is None for ``import module``."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.extend((base, alias.name) for alias in node.names)
    return out


# --- import cycles ---------------------------------------------------------------------------


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports. ``from pkg import mod`` of a submodule
    is an edge to the submodule; ``import a.b.c`` is an edge to ``a.b.c`` (not to ``a``, ``a.b``:
    a package's ``__init__`` importing its own submodules would otherwise make every package a
    cycle)."""
    files = source_files(root, packages)
    known = {module_name(p, root) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for path in files:
        me = module_name(path, root)
        for module, name in imports(path, root):
            sub = f"{module}.{name}" if name is not None else None
            target = sub if sub is not None and sub in known else module
            if target in known and target != me:
                graph[me].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                out.append(sorted(comp))
    return out


def cycles(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[tuple[str, ...]]:
    """Every import cycle: a strongly connected component of more than one module."""
    comps = strongly_connected(import_graph(root, packages))
    return sorted(tuple(c) for c in comps if len(c) > 1)


def room(module: str) -> str:
    """The room of a module: its top package and the first name below (``feedpipe.remote``
    for ``feedpipe.remote.transfer``; a top-level module is its own room)."""
    return ".".join(module.split(".")[:2])


def room_cycles(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[tuple[str, ...]]:
    """Every cycle between rooms (``feedpipe.datasets`` and ``feedpipe.remote`` importing each
    other through any of their modules), each a strongly connected component of the room graph."""
    graph: dict[str, set[str]] = {}
    for me, targets in import_graph(root, packages).items():
        graph.setdefault(room(me), set())
        for target in targets:
            graph.setdefault(room(target), set())
            if room(target) != room(me):
                graph[room(me)].add(room(target))
    return sorted(tuple(c) for c in strongly_connected(graph) if len(c) > 1)


# --- private attributes ----------------------------------------------------------------------


def _private(attr: str) -> bool:
    return (
        attr.startswith("_")
        and not (attr.startswith("__") and attr.endswith("__"))
        and bool(attr.strip("_"))
    )


# Underscore names that are public API: ``os._exit`` (documented) and the namedtuple API, whose
# names start with an underscore only to stay clear of field names (``hasattr(x, "_fields")`` is
# how a namedtuple is recognised).
_PUBLIC_UNDERSCORE = {("os", "_exit")}
_NAMEDTUPLE_API = {"_fields", "_field_defaults", "_asdict", "_replace", "_make"}


class _AttributeScan(ast.NodeVisitor):
    """``obj._x`` (and ``getattr(obj, "_x")``) where ``obj`` is not ``self``/``cls``, the
    enclosing class's own name or ``super()`` inside a class."""

    def __init__(self) -> None:
        self.classes: list[str] = []
        self.found: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _own(self, value: ast.expr) -> bool:
        if not self.classes:
            return False
        if isinstance(value, ast.Name):
            return value.id in {"self", "cls", *self.classes}
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            if value.func.id == "super":
                return True
            if value.func.id == "type" and len(value.args) == 1:
                return self._own(value.args[0])
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = node.value
        public = node.attr in _NAMEDTUPLE_API or (
            isinstance(base, ast.Name) and (base.id, node.attr) in _PUBLIC_UNDERSCORE
        )
        if _private(node.attr) and not public and not self._own(base):
            self.found.append(f"{ast.unparse(base)}.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in {"getattr", "setattr", "hasattr", "delattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in _NAMEDTUPLE_API
            and not self._own(node.args[0])
        ):
            self.found.append(f"{func.id}({ast.unparse(node.args[0])}, '{node.args[1].value}')")
        self.generic_visit(node)


def private_attributes_of(source: str) -> list[str]:
    """The private attribute accesses of one module's source, in order (with repeats)."""
    scan = _AttributeScan()
    scan.visit(ast.parse(source))
    return scan.found


def _count(
    scan: Callable[[str], list[str]], root: Path, packages: Iterable[str], exempt: Iterable[str]
) -> dict[str, int]:
    """``"module: hit"`` -> how many times ``scan`` finds it, over every module but ``exempt``."""
    skip = {root / e for e in exempt}
    found: Counter[str] = Counter()
    for path in source_files(root, packages):
        if path not in skip:
            me = module_name(path, root)
            found.update(f"{me}: {hit}" for hit in scan(path.read_text("utf-8")))
    return dict(sorted(found.items()))


def private_attributes(
    root: Path = ROOT, packages: Iterable[str] = PACKAGES, exempt: Iterable[str] = TORCH_COMPAT
) -> dict[str, int]:
    """``"module: obj._x"`` -> how many times, for every module of ``packages`` but the torch
    compat modules (``exempt``, paths relative to ``root``): they touch torch's private API."""
    return _count(private_attributes_of, root, packages, exempt)


# --- torch's private API ---------------------------------------------------------------------

# Private members of torch objects, reached through any name (a loader, a tensor, a module).
TORCH_PRIVATE_MEMBERS = {
    "_index_sampler",
    "_auto_collation",
    "_IterableDataset_len_called",
    "_get_iterator",
    "_DatasetKind",
    "_dataset_kind",
    "_shutdown_workers",
    "_workers_status",
    "_worker_result_queue",
    "_index_queues",
    "_worker_pids_set",
    "_utils",
    "_InfiniteConstantSampler",
    "_num_samples",
    "_is_profiler_enabled",
    "_is_param",
    "_foreach_copy_",
    "_worker_info",
    "_workers",
    "_MultiProcessingDataLoaderIter",
}


def _torch_aliases(tree: ast.AST) -> set[str]:
    """The local names bound to torch modules (``import torch.utils.data as tud``)."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_private_touches_of(source: str) -> list[str]:
    """Every touch of torch's private API in one module's source: an import of a private torch
    module or name, a private attribute reached from a torch module (``torch._foreach_copy_``),
    a known private member of a torch object (``x._is_param``), ``getattr(x, "_workers")``."""
    tree = ast.parse(source)
    torch_names = _torch_aliases(tree)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            mod = node.module or ""
            names = [a.name for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in mod.split(".")) or names:
                out.append(f"from {mod} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            out.extend(
                f"import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch"
                and any(p.startswith("_") for p in a.name.split("."))
            )
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            own = isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}
            member = node.attr in TORCH_PRIVATE_MEMBERS and not own
            if member or _root_name(node.value) in torch_names:
                out.append(f"{ast.unparse(node.value)}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in TORCH_PRIVATE_MEMBERS
        ):
            out.append(f"{node.func.id}({ast.unparse(node.args[0])}, '{node.args[1].value}')")
    return out


def torch_private_touches(
    root: Path = ROOT, packages: Iterable[str] = PACKAGES, exempt: Iterable[str] = TORCH_COMPAT
) -> dict[str, int]:
    """``"module: touch"`` -> how many times, outside the torch compat modules."""
    return _count(torch_private_touches_of, root, packages, exempt)
