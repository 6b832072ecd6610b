"""Disk full: on a size-limited tmpfs (or with ENOSPC injected at the write call) the save fails
with a clear error on the next call, earlier checkpoints stay intact, and training continues."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt.errors import CheckpointError
from ckpt.format import writer
from ckpt.manager import CheckpointManager
from ckpt.saving import commit


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=30, check=False)


def _check_full_then_continue(root: Path, m: CheckpointManager) -> None:
    small = {"w": torch.full((100_000,), 1.0)}  # 400 kB
    m.save(1, small).result(60)
    handle = m.save(2, {"w": torch.zeros(2_000_000)})  # 8 MB: does not fit
    with pytest.raises(CheckpointError, match="No space left on device"):
        handle.result(60)
    with pytest.raises(CheckpointError, match=r"background save of step 2 failed: .*No space left"):
        m.save(3, small)  # the next call reports it
    assert m.steps() == [1] and commit.leftovers(root) == []
    assert torch.equal(m.restore()["w"], small["w"])  # earlier checkpoint intact and verified
    m.save(4, {"w": torch.full((100_000,), 4.0)}).result(60)  # training continues
    assert m.steps() == [1, 4] and torch.equal(m.restore()["w"], torch.full((100_000,), 4.0))


def test_disk_full_tmpfs(small_fs: Path) -> None:
    with CheckpointManager(small_fs, keep_last=3) as m:
        _check_full_then_continue(small_fs, m)


def test_disk_full_injected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = writer.pwrite_all

    def limited(fd: int, view: memoryview, offset: int) -> None:
        if offset + len(view) > 4 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view, offset)

    monkeypatch.setattr(writer, "pwrite_all", limited)
    with CheckpointManager(tmp_path, keep_last=3) as m:
        _check_full_then_continue(tmp_path, m)
