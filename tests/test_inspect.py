"""feedpipe inspect: the printed index, and --verify naming a corrupt or missing file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from feedpipe import MemmapWriter
from feedpipe.cli import main as cli_main


def _dataset(path: Path) -> None:
    with MemmapWriter(
        path,
        shape=(32,),
        dtype="float32",
        fields={"label": "int64"},
        shard_bytes=1024,
        extra={"classes": ["x", "y"]},
    ) as w:
        w.append_batch(np.zeros((20, 32), np.float32), label=np.arange(20))


def test_inspect_prints_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dataset(tmp_path / "d")
    assert cli_main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "fixed [32] float32" in out and "records   20" in out and "shards    3" in out
    assert "label: int64" in out and "classes" in out and "shard-00002.data" in out


def test_verify_ok_and_checksum_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dataset(tmp_path / "d")
    assert cli_main(["inspect", str(tmp_path / "d"), "--verify"]) == 0
    assert "all 6 files match" in capsys.readouterr().out
    with open(tmp_path / "d" / "shard-00001.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x01")
    assert cli_main(["inspect", str(tmp_path / "d"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "shard-00001.data: crc32c" in out and "1 of 6 files" in out
    (tmp_path / "d" / "shard-00002.label").unlink()
    assert cli_main(["inspect", str(tmp_path / "d"), "--verify"]) == 1
    assert "shard-00002.label: missing" in capsys.readouterr().out


def test_not_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["inspect", str(tmp_path)]) == 1
    assert "not a feedpipe dataset" in capsys.readouterr().err
