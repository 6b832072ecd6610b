"""Corruption: flipped bytes in data files and the manifest, truncated and deleted files are all
detected, named in the error, and skipped over by ``restore()`` (falling back to a valid step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt import cli
from ckpt import format as fmt
from ckpt.errors import CorruptCheckpointError
from ckpt.manager import CheckpointManager, WriteOptions

CHUNK = 64 << 10


def _make(root: Path) -> CheckpointManager:
    m = CheckpointManager(root, keep_last=None, write=WriteOptions(chunk_bytes=CHUNK))
    for step in (1, 2):
        m.save(step, {"w": torch.full((100_000,), float(step)), "step": step}).result()
    return m


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _fallback_ok(root: Path, m: CheckpointManager, name: str) -> None:
    state = m.restore()
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((100_000,), 1.0))
    stats = m.stats.last_restore
    assert stats is not None and [s for s, _ in stats.skipped] == [2]
    assert name in stats.skipped[0][1]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_data_byte(tmp_path: Path, where: str, capsys: pytest.CaptureFixture) -> None:
    m = _make(tmp_path)
    data = tmp_path / "step-2" / "data.bin"
    size = data.stat().st_size
    offset = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    _flip(data, offset)
    chunk = offset // CHUNK
    with pytest.raises(
        CorruptCheckpointError, match=rf"step-2/data.bin: checksum mismatch in chunk {chunk} "
    ):
        m.restore(2)
    _fallback_ok(tmp_path, m, "data.bin")
    assert cli.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step 1: OK" in out and "step 2: FAILED" in out and "data.bin" in out
    m.restore(2, verify=False)  # the explicit opt-out skips checksums


def test_every_manifest_byte_flip_is_detected(tmp_path: Path) -> None:
    m = _make(tmp_path)
    manifest = tmp_path / "step-2" / "manifest.json"
    original = manifest.read_bytes()
    for offset in range(len(original)):
        corrupt = bytearray(original)
        corrupt[offset] ^= 0x01
        manifest.write_bytes(bytes(corrupt))
        with pytest.raises(CorruptCheckpointError, match=r"step-2/manifest.json"):
            fmt.read_manifest(tmp_path / "step-2")
    manifest.write_bytes(original[: len(original) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json: manifest is not valid"):
        m.restore(2)
    _fallback_ok(tmp_path, m, "manifest.json")


def test_truncated_data_file(tmp_path: Path) -> None:
    m = _make(tmp_path)
    data = tmp_path / "step-2" / "data.bin"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 100)
    with pytest.raises(CorruptCheckpointError, match=r"data.bin: size \d+ != \d+ bytes"):
        m.restore(2, verify=False)  # sizes are checked even without checksums
    _fallback_ok(tmp_path, m, "truncated")


def test_deleted_files(tmp_path: Path) -> None:
    m = _make(tmp_path)
    (tmp_path / "step-2" / "data.bin").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"step-2/data.bin: data file missing"):
        m.restore(2)
    _fallback_ok(tmp_path, m, "data file missing")
    (tmp_path / "step-2" / "manifest.json").unlink()
    assert m.steps() == [1]  # a directory without a manifest is not a checkpoint
    assert m.restore()["step"] == 1


def test_every_step_corrupt_names_all(tmp_path: Path) -> None:
    m = _make(tmp_path)
    for step in (1, 2):
        _flip(tmp_path / f"step-{step}" / "data.bin", 10)
    with pytest.raises(Exception, match=r"no valid checkpoint.*step 2: .*step 1: "):
        m.restore()
