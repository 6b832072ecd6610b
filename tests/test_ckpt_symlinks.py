"""Symlinks inside a checkpoint directory are never followed: ``.lock``, ``latest``, step
directories and data files that are symlinks are a clear ``CheckpointError`` naming the path,
and the file they point to is never read, truncated or written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _helpers import save_two_steps as _run
from _helpers import small_state as _state

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.manager import CheckpointManager


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_eviction_never_unlinks_through_a_swapped_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step-N`` swapped for a symlink after eviction opened and locked it (at the
    ``retention`` fault point): the manifest it removes is the locked step's, never one that
    the symlink reaches."""
    from ckpt import _faults
    from ckpt.saving import commit

    root = _run(tmp_path / "run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text("precious\n")
    real = _faults.pause

    def swap(point: str) -> None:
        if point == "retention":
            (root / "step-1").rename(tmp_path / "moved")
            (root / "step-1").symlink_to(victim)
        real(point)

    monkeypatch.setattr(_faults, "pause", swap)
    commit.evict(root, 1)
    assert (victim / "manifest.json").read_text() == "precious\n"
    assert not (tmp_path / "moved" / "manifest.json").exists()  # the locked step lost it


VICTIM = b"precious data outside the checkpoint directory\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    return victim


def _writers_refuse(root: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """save(), ``ckpt gc`` and ``ckpt gc --dry-run`` all refuse, naming ``name``."""
    with pytest.raises(CheckpointError, match=rf"{name}: is a symlink"):
        CheckpointManager(root).save(3, _state(3))
    for args in (["gc", str(root), "--dry-run"], ["gc", str(root), "--keep-last", "1"]):
        assert ckpt_main(args) == 1
        assert f"{name}: is a symlink" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("name", [".lock", "latest"])
def test_lock_and_latest_symlinks(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _run(tmp_path / "run")
    victim = _victim(tmp_path)
    (root / name).unlink()
    (root / name).symlink_to(victim)
    _writers_refuse(root, name, capsys)
    if name == "latest":
        assert ckpt_main(["ls", str(root)]) == 1
        assert "latest: is a symlink" in capsys.readouterr().err
    assert victim.read_bytes() == VICTIM
    assert (root / name).is_symlink()  # left for the user to look at, not replaced
    assert sorted(p.name for p in root.glob("step-*")) == ["step-1", "step-2"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_step_dir_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``step-N`` symlink to a valid checkpoint elsewhere is neither loaded nor deleted."""
    root = _run(tmp_path / "run")
    outside = tmp_path / "outside"
    shutil.copytree(root / "step-2", outside)
    with CheckpointManager(outside.parent / "other", keep_last=None) as m:
        m.save(7, _state(7)).result(30)
    shutil.rmtree(outside)
    shutil.copytree(outside.parent / "other" / "step-7", outside)
    (root / "step-7").symlink_to(outside, target_is_directory=True)
    reader = CheckpointManager(root)
    for call in (reader.steps, reader.restore, lambda: reader.restore(7)):
        with pytest.raises(CheckpointError, match="step-7: is a symlink"):
            call()
    _writers_refuse(root, "step-7", capsys)
    assert ckpt_main(["verify", str(root)]) == 1
    assert (outside / "manifest.json").is_file() and (outside / "data.bin").is_file()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_data_file_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A data file replaced by a symlink to an identical file elsewhere (so every CRC matches)
    is corrupt: never read, whatever the read mode; restore falls back past it."""
    root = _run(tmp_path / "run")
    outside = tmp_path / "outside.bin"
    shutil.copyfile(root / "step-2" / "data.bin", outside)
    (root / "step-2" / "data.bin").unlink()
    (root / "step-2" / "data.bin").symlink_to(outside)
    reader = CheckpointManager(root)
    for kwargs in ({}, {"mmap": True}, {"mmap": True, "verify": False}, {"verify": False}):
        with pytest.raises(CorruptCheckpointError, match=r"step-2/data\.bin: data file is a sym"):
            reader.restore(2, **kwargs)
    assert reader.restore()["step"] == 1  # the newest step that is not corrupt
    assert reader.stats.last_restore is not None and reader.stats.last_restore.skipped
    assert ckpt_main(["verify", str(root)]) == 1
    assert "data file is a symlink" in capsys.readouterr().out
    single = tmp_path / "single"
    ckpt.save(single, _state(3))
    (single / "data.bin").unlink()
    (single / "data.bin").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        ckpt.load(single)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_rank_file_symlink(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt.dcp import CkptStorageReader, CkptStorageWriter

    state = {"w": torch.arange(6.0)}
    dcp.save(state, storage_writer=CkptStorageWriter(tmp_path / "run", 1), no_dist=True)
    data = tmp_path / "run" / "step-1" / "rank-00000.bin"
    outside = tmp_path / "outside.bin"
    shutil.copyfile(data, outside)
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises((CorruptCheckpointError, CheckpointException)) as info:
        dcp.load(
            {"w": torch.zeros(6)},
            storage_reader=CkptStorageReader(tmp_path / "run" / "step-1"),
            no_dist=True,
        )
    assert "rank-00000.bin: data file is a symlink" in str(info.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_manifest_symlink(tmp_path: Path) -> None:
    """A manifest that is a symlink to a valid manifest elsewhere is refused, not read."""
    root = _run(tmp_path / "run")
    other = _run(tmp_path / "other")
    (root / "step-2" / "manifest.json").unlink()
    (root / "step-2" / "manifest.json").symlink_to(other / "step-2" / "manifest.json")
    with pytest.raises(CheckpointError, match=r"step-2/manifest\.json: is a symlink"):
        CheckpointManager(root).restore()
    with pytest.raises(CorruptCheckpointError, match=r"manifest is a symlink"):
        ckpt.load(root / "step-2")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_directory_itself_may_be_a_symlink(tmp_path: Path) -> None:
    """Only entries inside the checkpoint directory are refused; ``DIR`` itself (e.g. a link to
    a fast disk) and a ``ckpt.save`` path's parent may be symlinks."""
    real = tmp_path / "nvme" / "run"
    real.mkdir(parents=True)
    link = tmp_path / "run"
    link.symlink_to(real, target_is_directory=True)
    with CheckpointManager(link, keep_last=1) as m:
        for s in (1, 2, 2):
            m.save(s, _state(s)).result(30)
        assert m.restore()["step"] == 2 and m.steps() == [2]
    assert ckpt_main(["gc", str(link), "--keep-last", "1"]) == 0
    assert ckpt_main(["verify", str(link)]) == 0
    ckpt.save(link / "single", _state(3))
    ckpt.save(link / "single", _state(4))
    assert ckpt.load(link / "single")["step"] == 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_data_file_under_a_symlinked_subdirectory(tmp_path: Path) -> None:
    """A manifest (CRC-valid) naming ``sub/data.bin`` where ``sub`` links out of the step."""
    from ckpt import format as fmt

    root = _run(tmp_path / "run")
    step = root / "step-2"
    outside = tmp_path / "outside"
    outside.mkdir()
    (step / "data.bin").rename(outside / "data.bin")
    (step / "sub").symlink_to(outside, target_is_directory=True)
    body = fmt.read_manifest(step)
    body["files"][0]["name"] = "sub/data.bin"
    for entry in body["entries"]:
        entry["file"] = "sub/data.bin"
    fmt.write_manifest(step, body)
    reader = CheckpointManager(root)
    for kwargs in ({}, {"mmap": True, "verify": False}):
        with pytest.raises(CorruptCheckpointError, match=r"step-2/sub: data file is a symlink"):
            reader.restore(2, **kwargs)
    assert ckpt_main(["verify", str(root), "--step", "2"]) == 1
