"""benchmarks/ holds benchmarks (run by run_all.py, they write docs/benchmarks.md); diagnostics
that explain a figure live in benchmarks/diagnostics/, each with one line in its README; every
``benchmarks/...py`` path the docs and the library name exists (issue 17)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DIAG = BENCH / "diagnostics"

# Files that still name a script by its old path: (file, path named) -> why. These are the
# loader/device files the lead owns; the list may only shrink.
STALE_PATH_EXCEPTIONS: dict[tuple[str, str], str] = {
}


def _run_all() -> Any:
    spec = importlib.util.spec_from_file_location("_run_all_layout", BENCH / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_diagnostic_has_one_readme_line_and_none_is_a_benchmark() -> None:
    scripts = sorted(p.name for p in DIAG.glob("*.py"))
    assert scripts == ["feed_probe.py", "gil_handoff.py", "probe_batchcopy.py", "thread_regress.py"]
    lines = [x for x in (DIAG / "README.md").read_text().splitlines() if x.startswith("- ")]
    named = sorted(re.match(r"- `([\w.]+)`", x).group(1) for x in lines)  # type: ignore[union-attr]
    assert named == scripts  # one line each, no line for a missing script
    run_all = _run_all()
    for b in run_all.BENCHMARKS:
        assert (BENCH / f"{b.name}.py").is_file(), b.name
    assert not {b.name for b in run_all.BENCHMARKS} & {s[:-3] for s in scripts}


def test_no_probe_mode_or_probe_script_left_among_the_benchmarks() -> None:
    assert not (BENCH / "probe_batchcopy.py").exists()
    for script in BENCH.glob("*.py"):
        assert '"--probe"' not in script.read_text(), script.name


def _named_paths() -> set[tuple[str, str]]:
    pages = [*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("benchmarks/**/*.md")]
    code = [*ROOT.glob("feedpipe/**/*.py"), *ROOT.glob("ckpt/**/*.py"), *BENCH.rglob("*.py")]
    found = set()
    for path in pages + code:
        for m in re.finditer(r"benchmarks/[\w/]+\.py", path.read_text()):
            found.add((str(path.relative_to(ROOT)), m.group(0)))
    return found


def test_every_benchmark_path_named_in_docs_and_code_exists() -> None:
    missing = {(f, p) for f, p in _named_paths() if not (ROOT / p).is_file()}
    new = sorted(missing - set(STALE_PATH_EXCEPTIONS))
    assert new == [], f"these files name scripts that do not exist: {new}"
    stale = sorted(set(STALE_PATH_EXCEPTIONS) - missing)
    assert stale == [], f"fixed: remove them from STALE_PATH_EXCEPTIONS: {stale}"


def _top_names(path: Path) -> set[str]:
    """Names a module file defines or imports at its top level."""
    names: set[str] = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def _module_file(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py", BENCH / f"{module}.py"):
        if path.is_file():
            return path
    return None


def test_the_diagnostics_imports_resolve_from_their_new_home() -> None:
    """Each project import of a diagnostic (feedpipe, ckpt, a sibling benchmark: the scripts put
    the repository and benchmarks/ on sys.path) names a module and a name that exist. AST only:
    importing the scripts means importing torch, which the slow test below does."""
    for script in DIAG.glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            module = node.module or ""
            found = _module_file(module)
            if found is None:
                assert importlib.util.find_spec(module.split(".")[0]), (script.name, module)
                continue
            for alias in node.names:
                ok = _module_file(f"{module}.{alias.name}") or alias.name in _top_names(found)
                assert ok, f"{script.name}: from {module} import {alias.name}"


@pytest.mark.slow
def test_the_diagnostics_run_from_their_new_home(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(DIAG / "feed_probe.py"), "--device", "cpu", "--gb", "0.02",
         "--batch-mb", "2", "--seconds", "0.1", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "probe: read_batch read=pread 16 threads" in out.stdout
    assert list(tmp_path.iterdir()) == []  # its temporary dataset is gone
    out = subprocess.run(
        [sys.executable, str(DIAG / "probe_batchcopy.py"), "--help"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0 and "cuMemcpyBatchAsync" in out.stdout, out.stderr


def test_no_test_puts_benchmarks_on_sys_path() -> None:
    """benchmarks/datasets.py would shadow Hugging Face's ``datasets`` for every later test of
    the process (pytest-xdist runs many files in one): tests load benchmark files by path."""
    tests = Path(__file__).resolve().parent
    pattern = re.compile(r"sys\.path\.(insert|append)\(.*benchmarks")
    offenders = [p.name for p in tests.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
