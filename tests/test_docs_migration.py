"""The code in docs/migration.md's sections "From MosaicML Streaming", "From LitData", "From
WebDataset" and "From Hugging Face datasets", and in docs/guides/parquet-hf.md, runs as
written: every ``python`` block of a section (or page), in order, in a fresh folder (offline,
``HF_HOME`` there), as the body of one module (so that a function it defines pickles into
``feedpipe.convert``'s worker processes)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {
    "From MosaicML Streaming": (),
    "From LitData": (),
    "From WebDataset": ("webdataset", "PIL"),
    "From Hugging Face datasets": ("datasets",),
}


def _blocks(section: str, page: str = "migration.md") -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    body = next(p for p in parts if p.startswith(section + "\n")) if section else text
    return re.findall(r"^```python\n(.*?)^```", body, flags=re.M | re.S)


def _run(code: str, name: str, where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(where / "hf-home"))
    monkeypatch.chdir(where)
    module_name = "docs_" + re.sub(r"\W", "_", name.lower())
    module = types.ModuleType(module_name)
    monkeypatch.setitem(sys.modules, module_name, module)
    exec(compile(code, name, "exec"), module.__dict__)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_migration_section_runs(
    section: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in SECTIONS[section]:
        pytest.importorskip(module)
    code = "\n".join(_blocks(section))
    assert code.strip(), f"{section}: no python code"
    _run(code, f"docs/migration.md: {section}", tmp_path, monkeypatch)


def test_parquet_hf_guide_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyarrow")
    code = "\n".join(_blocks("", "guides/parquet-hf.md"))
    assert "feedpipe.convert" in code
    _run(code, "docs/guides/parquet-hf.md", tmp_path, monkeypatch)
