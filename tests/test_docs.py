"""The documentation site builds in strict mode (broken links, missing pages or API references
fail), and the README's numbers come from docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None
    or importlib.util.find_spec("mkdocstrings_handlers") is None
    or importlib.util.find_spec("material") is None,
    reason="needs mkdocs, mkdocs-material and mkdocstrings[python]: pip install 'feedpipe[docs]'",
)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    # the API reference was generated from docstrings (not an empty page)
    ref = (site / "reference" / "feedpipe" / "index.html").read_text()
    assert "load_state_dict" in ref and "worker_type" in ref
    assert "CkptCheckpointIO" in (site / "reference" / "integrations" / "index.html").read_text()


def _pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(ROOT / "docs")) for p in _pages()
               if str(p.relative_to(ROOT / "docs")) not in nav]  # fmt: skip
    assert not missing, f"pages not in mkdocs.yml nav: {missing}"


def _numbers(text: str) -> set[str]:
    """Ratios like 4.91x and 10.43 and thousands like 15,747 (the claims a reader checks)."""
    found = set(re.findall(r"\b\d+(?:\.\d+)?x\b", text))
    found |= set(re.findall(r"\b\d{1,3}(?:,\d{3})+\b", text))
    return found


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_headline_numbers_come_from_benchmarks(page: str) -> None:
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    text = (ROOT / page).read_text()
    unknown = sorted(n for n in _numbers(text) if n not in bench)
    assert not unknown, f"{page} quotes numbers that are not in docs/benchmarks.md: {unknown}"


def _run_all() -> Any:
    spec = importlib.util.spec_from_file_location("_run_all", ROOT / "benchmarks" / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_headline_blocks_match_the_benchmark_tables() -> None:
    """README.md and docs/index.md list exactly what run_all.headline() derives from the tables
    (``python benchmarks/run_all.py --headline`` regenerates them)."""
    lines = _run_all().headline((ROOT / "docs" / "benchmarks.md").read_text())
    assert lines, "no headline ratios found in docs/benchmarks.md"
    for page in ("README.md", "docs/index.md"):
        text = (ROOT / page).read_text()
        m = re.search(r"<!-- BEGIN headline -->(.*?)<!-- END headline -->", text, re.S)
        assert m, f"{page}: no headline block"
        got = [x[2:] for x in m.group(1).strip().splitlines() if x.startswith("- ")]
        assert got == lines, f"{page}: stale headline block; run benchmarks/run_all.py --headline"


def test_update_headlines_rewrites_only_the_block(tmp_path: Path) -> None:
    run_all = _run_all()
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(
        "<!-- BEGIN staging -->\n| method | s | MB/s | ratio |\n|---|---|---|---|\n"
        "| `feedpipe.stage`, 16 workers | 1 | 2 | 9.99x |\n<!-- END staging -->\n"
        "<!-- BEGIN ckpt_save -->\n- ckpt steady blocked / DCP async_save (default stager) "
        "steady blocked: 0.11x (target <= 0.5x)\n<!-- END ckpt_save -->\n"
    )
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- BEGIN headline -->\nold\n<!-- END headline -->\noutro\n")
    lines = run_all.update_headlines((page,), doc)
    assert len(lines) == 2 and "**9.99x**" in lines[0] and "**0.11x**" in lines[1]
    text = page.read_text()
    assert text.startswith("intro\n<!-- BEGIN headline -->\n- ") and text.endswith("outro\n")
    assert "old" not in text and "(docs/benchmarks.md)" in text
    # a table without the rows it reads gives no line rather than a guess
    doc.write_text("<!-- BEGIN staging -->\nnothing\n<!-- END staging -->\n")
    assert run_all.headline(doc.read_text()) == []
