"""The ckpt_save benchmark runs end to end on a tiny state (no timing is asserted)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "ckpt_save.py"


def test_ckpt_save_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench = runpy.run_path(str(SCRIPT), run_name="ckpt_save_bench")
    args = ["--size-gb", "0.005", "--saves", "2", "--no-doc", "--dir", str(tmp_path)]
    assert bench["main"](args) == 0
    out = capsys.readouterr().out
    for name in ("torch.save (sync)", "DCP async_save (default stager)", "| ckpt |"):
        assert name in out
    assert list(tmp_path.iterdir()) == []  # everything it wrote is removed
