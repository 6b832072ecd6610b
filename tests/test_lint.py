"""Strict tooling runs in CI: ruff on the whole tree, mypy on the packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (it is in the 'test' extra)")
    return found


def test_ruff_clean() -> None:
    out = subprocess.run(
        [_tool("ruff"), "check", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_clean(tmp_path: Path) -> None:
    out = subprocess.run(
        [_tool("mypy"), "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
