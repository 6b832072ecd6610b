"""Special files where ckpt expects a regular file (a FIFO, a directory, a hard-linked lock) are a
clear error and never hang."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import save_two_steps as _run
from _helpers import small_state as _state

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager


def _no_hang(fn: Callable[[], Any], fifos: list[Path], timeout_s: float = 5.0) -> Any:
    """Run ``fn`` in a thread; if it is still running after ``timeout_s`` (blocked opening a
    FIFO), release it by opening the FIFOs' write ends and fail."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"hung on a FIFO: {fifos}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _fifo(path: Path) -> Path:
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_manifest_fifo_never_hangs(tmp_path: Path) -> None:
    """A manifest replaced by a FIFO: ckpt.load, CkptStorageReader-free CLI verify and ls end
    with a clear error, never block on open."""
    path = ckpt.save(tmp_path / "one", _state(1))
    fifo = _fifo(path / "manifest.json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: .*not a regular file"):
        _no_hang(lambda: ckpt.load(path), [fifo])
    assert _no_hang(lambda: ckpt_main(["verify", str(path)]), [fifo]) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_data_file_fifo_never_hangs(tmp_path: Path) -> None:
    """A data file replaced by a FIFO: restore falls back to the older step (logged), verify
    fails, and nothing blocks."""
    root = _run(tmp_path / "run")
    fifo = _fifo(root / "step-2" / "data.bin")
    with CheckpointManager(root) as m:
        state = _no_hang(m.restore, [fifo])
    assert state["step"] == 1
    with pytest.raises(CheckpointError, match=r"data\.bin: .*not a regular file"):
        _no_hang(lambda: ckpt.load(root / "step-2"), [fifo])
    assert _no_hang(lambda: ckpt_main(["verify", str(root)]), [fifo]) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_data_file_directory_is_corrupt(tmp_path: Path) -> None:
    """A data file replaced by a directory is a CheckpointError naming it, not a raw OSError."""
    root = _run(tmp_path / "run")
    (root / "step-2" / "data.bin").unlink()
    (root / "step-2" / "data.bin").mkdir()
    with pytest.raises(CheckpointError, match=r"data\.bin"):
        ckpt.load(root / "step-2")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_data_file_fifo_never_hangs(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt.dcp import CkptStorageReader, CkptStorageWriter

    root = tmp_path / "run"
    dcp.save({"w": torch.ones(10)}, storage_writer=CkptStorageWriter(root, step=5))
    data = [p for p in (root / "step-5").iterdir() if p.name != "manifest.json"]
    assert data
    fifos = [_fifo(p) for p in data]
    out = {"w": torch.zeros(10)}
    with pytest.raises((CheckpointError, CheckpointException)) as info:  # DCP wraps it
        _no_hang(lambda: dcp.load(out, storage_reader=CkptStorageReader(root / "step-5")), fifos)
    assert "rank-00000.bin: not a regular file" in repr(info.value) + str(info.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_latest_fifo_never_hangs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``DIR/latest`` replaced by a FIFO: ``ckpt ls`` does not block; the next save commits its
    step, then refuses to replace a ``latest`` that ckpt did not write, naming it (issue 25)."""
    root = _run(tmp_path / "run")
    fifo = _fifo(root / "latest")
    assert _no_hang(lambda: ckpt_main(["ls", str(root)]), [fifo]) == 0
    with (
        pytest.raises(CheckpointError, match=r"latest: was not written by ckpt"),
        CheckpointManager(root, keep_last=None) as m,
    ):
        _no_hang(lambda: m.save(3, _state(3)).result(30), [fifo])
    assert stat.S_ISFIFO(os.lstat(root / "latest").st_mode)
    with CheckpointManager(root) as m:
        assert m.steps() == [1, 2, 3]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_lock_special_file_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    """``DIR/.lock`` that is a directory or a FIFO: a CheckpointError naming it, never a hang."""
    root = _run(tmp_path / "run")
    lock = root / ".lock"
    lock.unlink()
    if kind == "dir":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(CheckpointError, match=r"\.lock"):
        _no_hang(lambda: CheckpointManager(root).save(3, _state(3)).result(30), [lock])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_hard_linked_lock_is_never_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``DIR/.lock`` hard-linked to a file elsewhere (``cp -al``, an attacker): the writer lock
    refuses it instead of truncating the other file; ``ckpt gc`` too."""
    root = _run(tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    (root / ".lock").unlink()
    os.link(victim, root / ".lock")
    with pytest.raises(CheckpointError, match=r"\.lock: .*hard link"):
        CheckpointManager(root).save(3, _state(3)).result(30)
    for args in (["gc", str(root), "--dry-run"], ["gc", str(root), "--keep-last", "1"]):
        assert ckpt_main(args) == 1
        assert "hard link" in capsys.readouterr().err
    assert victim.read_bytes() == b"precious\n"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_latest_directory_is_named_and_kept(tmp_path: Path) -> None:
    """A directory named ``latest``: the save commits its step, then fails naming ``latest``;
    the directory and its files are left alone, and no ``latest.tmp-`` is left behind."""
    root = _run(tmp_path / "run")
    (root / "latest").unlink()
    (root / "latest").mkdir()
    (root / "latest" / "notes.txt").write_text("keep\n")
    with (
        pytest.raises(CheckpointError, match=r"latest: is a directory"),
        CheckpointManager(root, keep_last=None) as m,
    ):
        m.save(3, _state(3)).result(30)
    assert (root / "latest" / "notes.txt").read_text() == "keep\n"
    assert not [p for p in os.listdir(root) if p.startswith("latest.tmp-")]
    with CheckpointManager(root) as m:
        assert m.steps() == [1, 2, 3]
