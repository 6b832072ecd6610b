"""The code in docs/migration.md's sections "From MosaicML Streaming", "From LitData", "From
WebDataset" and "From Hugging Face datasets" runs as written: every ``python`` block of a
section, in order, in a fresh folder (offline, ``HF_HOME`` there), as the body of one module
(so that a function it defines pickles into ``feedpipe.convert``'s worker processes)."""

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


def _blocks(section: str) -> list[str]:
    text = (ROOT / "docs" / "migration.md").read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    body = next(p for p in parts if p.startswith(section + "\n"))
    return re.findall(r"^```python\n(.*?)^```", body, flags=re.M | re.S)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_migration_section_runs(
    section: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in SECTIONS[section]:
        pytest.importorskip(module)
    code = "\n".join(_blocks(section))
    assert code.strip(), f"{section}: no python code"
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)
    name = "migration_" + re.sub(r"\W", "_", section.lower())
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(code, f"docs/migration.md: {section}", "exec"), module.__dict__)
