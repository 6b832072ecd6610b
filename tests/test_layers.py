"""The dependency rules of docs/architecture.md, checked by scanning every import (AST, no import).

Rule 1 (strict): ``feedpipe.io`` imports nothing else from feedpipe; ckpt imports only
``feedpipe.io`` from feedpipe; feedpipe never imports ckpt.
Rule 2: a feedpipe module imports only from its own layer or the layers below.
Rule 3: no private name (``_name`` that is not a module) is imported from another module.
Rule 4: only ``feedpipe.loader._torch_compat`` touches torch's private API.
Rule 5: no measured figure (throughput, ratio, measured cost) in a docstring or comment of
feedpipe or ckpt: the decision is stated and docs/benchmarks.md holds the numbers.

Rules 2 and 3 list today's exceptions in ``LAYER_EXCEPTIONS`` and ``PRIVATE_EXCEPTIONS``. An
entry that no longer matches an import fails the test too, so the lists can only shrink: remove
an entry when its import goes away, and never add one for new code.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Layers of feedpipe, bottom (1) to top (4); a module's layer is that of its longest prefix.
LAYERS: dict[str, int] = {
    # 1: errors, the shared I/O layer, the contract
    "feedpipe.errors": 1,
    "feedpipe.io": 1,
    "feedpipe.protocols": 1,
    "feedpipe._crc": 1,  # shim of feedpipe.io.crc
    # 2: datasets, remote access and staging, the sampler, the DMA path of a memmap dataset
    "feedpipe.datasets": 2,
    "feedpipe.remote": 2,
    "feedpipe.remote.transfer": 2,
    "feedpipe.sampler": 2,
    "feedpipe._permutation": 2,
    "feedpipe.device.dma": 2,
    "feedpipe.device.hostreg": 2,  # every host registration with CUDA (dma and the loader use it)
    # 3: loader internals, the GPU feed, stall counters
    "feedpipe.loader.": 3,  # the loader package's internals (feedpipe.loader itself is 4)
    "feedpipe.device": 3,
    "feedpipe.stall": 3,
    # 4: the DataLoader, DALI, integrations, commands, the CLI, the package and its shims
    "feedpipe": 4,
    "feedpipe.loader": 4,
    "feedpipe.loader.dataloader": 4,
    "feedpipe.loader.bench": 4,  # measures a DataLoader (public path feedpipe.bench)
    "feedpipe.gpu": 4,  # shim of feedpipe.device.feed
    "feedpipe.dali": 4,
    "feedpipe.integrations": 4,
    "feedpipe.commands": 4,
    "feedpipe.cli": 4,
    "feedpipe.bench": 4,
    "feedpipe.testing": 4,  # the dataset conformance suite (runs a DataLoader)
    "feedpipe.memmap": 4,  # shim of feedpipe.datasets.memmap
    "feedpipe.zarr_dataset": 4,  # shim of feedpipe.datasets.zarr
    "feedpipe.convert": 4,  # shim of feedpipe.datasets.convert
    "feedpipe.cache": 4,  # shim of feedpipe.remote.cache
    "feedpipe.stage": 4,  # shim of feedpipe.remote.stage
}

# Rule 2, today's exceptions: (importer, imported module) -> why it is still there.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}

# Rule 3, today's exceptions: (importer, "module:name") -> why it is still there.
PRIVATE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """Every import of ``path`` (top level, inside functions, under TYPE_CHECKING) as
    ``(module, name)``: ``name`` is None for ``import module``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.extend((base, alias.name) for alias in node.names)
    return out


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _target(module: str, name: str | None) -> str:
    """The module an import loads: ``from a import b`` loads ``a.b`` when that is a module."""
    if name is not None and _is_module(f"{module}.{name}"):
        return f"{module}.{name}"
    return module


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> int | None:
    best = ""
    for prefix in LAYERS:
        hit = module.startswith(prefix) if prefix.endswith(".") else _in(module, prefix)
        if hit and len(prefix) > len(best):
            best = prefix
    return LAYERS[best] if best else None


def test_rule1_io_imports_nothing_else_from_feedpipe() -> None:
    bad = [
        (_module_name(p), _target(m, n))
        for p in _sources("feedpipe/io")
        for m, n in _imports(p)
        if _in(m, "feedpipe") and not _in(_target(m, n), "feedpipe.io")
    ]
    assert bad == []


def test_rule1_ckpt_imports_only_feedpipe_io() -> None:
    bad = [
        (_module_name(p), _target(m, n))
        for p in _sources("ckpt")
        for m, n in _imports(p)
        if _in(m, "feedpipe") and not _in(_target(m, n), "feedpipe.io")
    ]
    assert bad == []


def test_rule1_feedpipe_never_imports_ckpt() -> None:
    bad = [
        (_module_name(p), m) for p in _sources("feedpipe") for m, _ in _imports(p) if _in(m, "ckpt")
    ]
    assert bad == []


def test_every_feedpipe_module_has_a_layer() -> None:
    """A new module must say where it belongs (add it to LAYERS and docs/architecture.md)."""
    assert [_module_name(p) for p in _sources("feedpipe") if _layer(_module_name(p)) is None] == []


def _layer_violations() -> set[tuple[str, str]]:
    found = set()
    for path in _sources("feedpipe"):
        me = _module_name(path)
        for module, name in _imports(path):
            target = _target(module, name)
            if not _in(target, "feedpipe") or _in(target, me):
                continue
            mine, theirs = _layer(me), _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.add((me, target))
    return found


def _private_violations() -> set[tuple[str, str]]:
    """``from module import _name`` where ``_name`` is not a module: a private function, class
    or constant used outside its module. A private *module* is fine to import: inside it names
    carry no underscore, and the module is the privacy boundary."""
    found = set()
    for path in [*_sources("feedpipe"), *_sources("ckpt")]:
        me = _module_name(path)
        for module, name in _imports(path):
            if not (_in(module, "feedpipe") or _in(module, "ckpt")):
                continue
            if name is None or not name.startswith("_"):
                continue
            if module != me and not _is_module(f"{module}.{name}"):
                found.add((me, f"{module}:{name}"))
    return found


@pytest.mark.parametrize(
    ("found", "allowed", "rule"),
    [
        (_layer_violations, LAYER_EXCEPTIONS, "imports go down the layers"),
        (_private_violations, PRIVATE_EXCEPTIONS, "no _name imported across modules"),
    ],
    ids=["rule2", "rule3"],
)
def test_rules_2_and_3_hold_outside_the_listed_exceptions(
    found: object, allowed: dict[tuple[str, str], str], rule: str
) -> None:
    now = found()  # type: ignore[operator]
    new = sorted(now - set(allowed))
    assert new == [], f"{rule}: new violations (fix them; do not add exceptions): {new}"
    stale = sorted(set(allowed) - now)
    assert stale == [], f"{rule}: these exceptions are gone, remove them from the list: {stale}"


# Rule 4: torch's private API, reached only from feedpipe.loader._torch_compat. Private torch
# modules (``torch._utils``, ``torch.utils.data._utils``) and private members of torch's
# DataLoader; ckpt's private DCP hooks are out of this rule's scope (ckpt owns its own).
_TORCH_PRIVATE_MEMBERS = {
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
}


def _torch_private_touches(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            mod = node.module or ""
            if any(part.startswith("_") for part in mod.split(".")) or any(
                a.name.startswith("_") for a in node.names
            ):
                out.append(f"line {node.lineno}: from {mod} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(
                    part.startswith("_") for part in alias.name.split(".")
                ):
                    out.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in _TORCH_PRIVATE_MEMBERS:
            out.append(f"line {node.lineno}: .{node.attr}")
    return out


def test_rule4_only_torch_compat_touches_torch_privates() -> None:
    compat = ROOT / "feedpipe" / "loader" / "_torch_compat.py"
    bad = {
        _module_name(p): hits
        for p in _sources("feedpipe")
        if p != compat and (hits := _torch_private_touches(p))
    }
    assert bad == {}
    assert _torch_private_touches(compat), "the scan must see the compat module's own touches"


# Rule 5: no measured figures in library code. A docstring or comment states the decision and
# points at its section of docs/benchmarks.md, which benchmarks/ generates. A measured figure is
# a throughput (``12.3 GB/s``, ``900 samples/s``), a ratio (``9.4x``) or a measured cost
# (``costs ~40%``, ``took 1.2 ms``); arithmetic (``2**-30 s (~1 ns)``) is not one.
MEASURED = re.compile(
    r"\b\d[\d.,]*\s*(?:[KMGT]i?B|B|samples|records|batches|images|steps)/s\b"
    r"|\b\d+(?:\.\d+)?x\b"
    r"|\b(?:cost|costs|took|takes|reached|reaches|measured)\b[^.;:]{0,40}?\d+(?:\.\d+)?\s*"
    r"(?:%|ns|us|µs|ms|s)(?!\w)",
    re.IGNORECASE,
)

# Rule 5, today's exceptions (the list may only shrink): file -> why.
FIGURE_EXCEPTIONS: dict[str, str] = {}


def _prose(path: Path) -> list[tuple[int, str]]:
    """Every docstring line and comment of ``path``, with its line number."""
    src = path.read_text()
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(src, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines = first.value.value.splitlines()
                out.extend((first.lineno + i, line) for i, line in enumerate(lines))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _figures() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _sources("feedpipe") + _sources("ckpt"):
        for line, text in _prose(path):
            for m in MEASURED.finditer(text):
                rel = str(path.relative_to(ROOT))
                found.setdefault(rel, []).append(f"{rel}:{line}: {m.group(0)!r}")
    return found


def test_rule5_no_measured_figures_in_docstrings_or_comments() -> None:
    found = _figures()
    new = sorted(hit for f, hits in found.items() if f not in FIGURE_EXCEPTIONS for hit in hits)
    assert new == [], (
        "measured figures in library prose: state the decision and link to its section of "
        f"docs/benchmarks.md instead: {new}"
    )
    stale = sorted(set(FIGURE_EXCEPTIONS) - set(found))
    assert stale == [], f"rule 5: these exceptions are gone, remove them from the list: {stale}"


@pytest.mark.parametrize(
    "text",
    [
        "measured 19.1 GB/s direct against 12.3",
        "# moved 900 samples/s",
        "torch's best (9.4x)",
        "# Enum attribute lookups cost ~100 ns each",
        "# it costs ~40% of throughput",
        "the copy took 1.5 ms",
        "| 256 KiB | 54.1-54.7 GB/s |",
        "8.45 (mmap) against 4.19 GiB/s",
    ],
)
def test_rule5_pattern_finds_figures(text: str) -> None:
    assert MEASURED.search(text)


@pytest.mark.parametrize(
    "text",
    [
        "# Wait histogram: from 2**-30 s (~1 ns) to 2**12 s.",
        "its midpoint is within ~3% of every value in it",
        "20% busy means the input is idle 80% of the time",
        "the page-locked ring of 64 MiB; timeout=300 s",
        "a 0x10 flag and a 16-byte header",
        "see the staging section of docs/benchmarks.md",
    ],
)
def test_rule5_pattern_leaves_settings_and_arithmetic(text: str) -> None:
    assert not MEASURED.search(text)


# Rule 6: the docs name public paths only. A dotted path of feedpipe or ckpt with a component
# that starts with "_" (``ckpt._layout.MANIFEST``) is private; docs/architecture.md, the map of
# the modules, names private modules on purpose and is not scanned.
PRIVATE_PATH = re.compile(r"\b(?:feedpipe|ckpt)(?:\.\w+)*\._(?!_)\w+")  # not a __dunder__
PATH_RULE_EXEMPT = {"docs/architecture.md"}


def _doc_pages() -> list[Path]:
    return sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])


def test_rule6_docs_reference_public_paths_only() -> None:
    bad = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for page in _doc_pages()
        if str(page.relative_to(ROOT)) not in PATH_RULE_EXEMPT
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in PRIVATE_PATH.finditer(line)
    ]
    assert bad == [], f"docs name private module paths; name the public path instead: {bad}"


@pytest.mark.parametrize(
    ("text", "private"),
    [
        ("::: ckpt._layout.MANIFEST", True),
        ("`feedpipe._memmap_writer.MemmapWriter`", True),
        ("feedpipe.loader._torch_compat", True),
        ("::: ckpt.manager.PoolOptions", False),
        ("`feedpipe.datasets.memmap.MemmapDataset.__getitems__`", False),
        ("feedpipe.DataLoader(direct=False)", False),
    ],
)
def test_rule6_pattern(text: str, private: bool) -> None:
    assert bool(PRIVATE_PATH.search(text)) is private
