"""The ``ckpt ls|verify|gc DIR`` command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt import _commit, cli
from ckpt.manager import CheckpointManager


def _populate(root: Path) -> None:
    with CheckpointManager(root, keep_last=None) as m:
        for step in (10, 20, 30):
            m.save(step, {"w": torch.ones(1000) * step}).result()
    (root / "step-40.tmp-1-dead").mkdir()  # an interrupted save


def test_ls(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    assert cli.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "10" and "3.9 KiB" in lines[1]
    assert "committed, latest" in lines[3] and lines[3].split()[0] == "30"
    assert "leftover: step-40.tmp-1-dead" in lines[4]


def test_verify_ok_and_single_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    assert cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK: ok (") == 3
    assert cli.main(["verify", str(tmp_path), "--step", "20"]) == 0
    assert capsys.readouterr().out.startswith("step 20: OK")
    assert cli.main(["verify", str(tmp_path), "--step", "99"]) == 1
    assert "does not exist" in capsys.readouterr().out


def test_gc(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1", "--dry-run"]) == 0
    assert "would delete step 10" in capsys.readouterr().out
    assert _commit.steps(tmp_path) == [10, 20, 30]
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "removed leftover step-40.tmp-1-dead" in out and "deleted step 20" in out
    assert _commit.steps(tmp_path) == [30] and _commit.leftovers(tmp_path) == []


def test_gc_keeps_newest_valid(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    (tmp_path / "step-30" / "data.bin").write_bytes(b"garbage")
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert "kept step 20 (newest valid checkpoint)" in capsys.readouterr().out
    assert _commit.steps(tmp_path) == [20, 30]


def test_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["ls", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
