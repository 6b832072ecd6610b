"""Concurrency: saving while another manager restores, gc against a live writer, and two managers
on one directory either work or fail loudly, and never corrupt anything."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ckpt import cli
from ckpt.errors import LockedError
from ckpt.manager import CheckpointManager, WriteOptions
from ckpt.saving import commit


def _state(step: int) -> dict:
    return {"w": torch.full((50_000,), float(step)), "step": step}


def test_two_managers_one_directory_fail_loudly(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path)
    first.save(0, _state(0)).result()
    second = CheckpointManager(tmp_path, write=WriteOptions(lock_timeout_s=0.1))
    with pytest.raises(LockedError, match=r"another writer holds .*pid \d+"):
        second.save(1, _state(1))
    first.save(1, _state(1)).result()  # the first is unaffected
    assert second.restore()["step"] == 1  # reading needs no lock
    first.close()
    second.save(2, _state(2)).result()  # once released, the second can write
    second.close()
    assert second.steps() == [0, 1, 2]


def test_writer_waits_for_a_short_gc(tmp_path: Path) -> None:
    gc_lock = commit.WriterLock(tmp_path)
    gc_lock.acquire()
    timer = threading.Timer(0.2, gc_lock.release)
    timer.start()
    with CheckpointManager(tmp_path, write=WriteOptions(lock_timeout_s=30)) as m:
        m.save(0, _state(0)).result()
    timer.join()
    assert m.steps() == [0]


def test_cli_gc_refuses_a_live_writer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(0, _state(0)).result()
        assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 1
        assert "another writer holds" in capsys.readouterr().err
        m.save(1, _state(1)).result()
    assert m.steps() == [0, 1]


@pytest.mark.serial
def test_save_while_another_manager_restores(tmp_path: Path) -> None:
    writer = CheckpointManager(tmp_path, keep_last=1, write=WriteOptions(chunk_bytes=32 << 10))
    writer.save(0, _state(0)).result()
    reader = CheckpointManager(tmp_path)
    seen: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def read_loop() -> None:
        try:
            while not stop.is_set():
                state = reader.restore()
                assert torch.equal(state["w"], _state(state["step"])["w"])
                seen.append(state["step"])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    for step in range(1, 40):
        writer.save(step, _state(step))
    writer.wait(60)
    stop.set()
    thread.join(60)
    writer.gc()  # steps kept while being read are evicted once free
    writer.close()
    assert not errors, errors
    assert len(seen) > 1 and seen == sorted(seen)
    assert writer.steps() == [39] and commit.leftovers(tmp_path) == []
