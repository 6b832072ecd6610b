"""The memory tier (``CheckpointManager(memory=...)``, ``ckpt.tiers.memory``): every save lands in
shared memory, every Nth is persisted verified to the disk, a new process restores the newest step
that verifies (memory, then disk, then remote) after a real SIGKILL, ``close`` persists and frees
the tier, ``ckpt ls``/``ckpt gc`` see it, and a tier the tmpfs cannot hold is refused."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckpt import cli
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.manager import CheckpointManager, WriteOptions
from ckpt.saving import commit
from ckpt.tiers.memory import MemoryTier, check_capacity
from ckpt.tiers.memory_options import MemoryOptions, memory_options, tier_dir
from ckpt.tiers.memory_persist import copy_step


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(20_000, generator=gen), "step": step}


def _opts(tmp_path: Path, **kw: object) -> MemoryOptions:
    return MemoryOptions(root=tmp_path / "shm", **kw)  # type: ignore[arg-type]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)


def _corrupt(step_dir: Path) -> None:
    data = step_dir / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_every_save_lands_in_memory_every_nth_is_persisted_and_close_frees(tmp_path: Path) -> None:
    opts = _opts(tmp_path, keep=2, persist_every=3)
    disk = tmp_path / "disk"
    with CheckpointManager(disk, keep_last=None, memory=opts) as m:
        assert m.memory is not None
        for step in range(1, 9):
            m.save(step, _state(step))
            if step % 3 == 0:  # a persist still waiting when retention evicts its step is
                m.wait()  # dropped by design (tested below); here each one is let finish
        m.wait()
        assert m.memory.steps() == [7, 8]  # keep=2 snapshots
        assert commit.steps(disk) == [3, 6]  # the 3rd and 6th saves, copied verified
        assert m.steps() == [3, 6, 7, 8]
        restored = m.restore()
        assert restored["step"] == 8 and torch.equal(restored["w"], _state(8)["w"])
        assert m.stats.last_restore is not None
        assert str(m.stats.last_restore.path).startswith(str(m.memory.directory))
        assert m.metadata(8) == {}
        assert m.stats.memory is not None and m.stats.memory.persist.persisted == 2
        where = m.memory.directory
    assert commit.steps(disk) == [3, 6, 8]  # close persisted the newest snapshot
    assert not where.exists()  # and freed the tier
    with CheckpointManager(disk) as again:
        assert again.restore(8)["step"] == 8


def test_restore_after_sigkill_in_a_new_process_takes_the_newest_that_verifies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    opts = _opts(tmp_path, keep=3, persist_every=4)
    disk = tmp_path / "disk"
    child = textwrap.dedent(f"""
        import os, signal, torch
        from ckpt.manager import CheckpointManager, WriteOptions
        from ckpt.tiers.memory_options import MemoryOptions
        m = CheckpointManager({str(disk)!r}, memory=MemoryOptions(root={str(opts.root)!r},
                              keep=3, persist_every=4))
        for step in range(1, 11):
            g = torch.Generator().manual_seed(step)
            m.save(step, {{"w": torch.randn(20_000, generator=g), "step": step}})
        m.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = _run(child)
    assert proc.returncode == -9, proc.stderr[-2000:]
    where = tier_dir(disk, opts.root)
    assert commit.steps(where) == [8, 9, 10] and commit.steps(disk) == [4, 8]
    m = CheckpointManager(disk, memory=opts)  # a new process on the same node, same options
    assert m.restore()["step"] == 10
    _corrupt(where / "step-10")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert m.restore()["step"] == 9  # 10 fails its CRC and exists nowhere else: skipped
    assert m.stats.last_restore is not None
    assert [s for s, _ in m.stats.last_restore.skipped] == [10]
    _corrupt(where / "step-8")
    state = m.restore(8)  # corrupt in memory, whole on disk: the disk's copy
    assert torch.equal(state["w"], _state(8)["w"])
    assert str(m.stats.last_restore.path).startswith(str(disk))
    for step in (8, 9, 10):
        commit.remove_path(where / f"step-{step}")
    assert m.restore()["step"] == 8  # the node's memory lost: the disk
    m.close()  # never saved: the tier is not this manager's to free
    assert where.is_dir()


def test_restore_after_sigkill_resumes_saving_into_the_same_tier(tmp_path: Path) -> None:
    opts = _opts(tmp_path, keep=1, persist_every=2)
    disk = tmp_path / "disk"
    first = CheckpointManager(disk, memory=opts)
    for step in range(3):
        first.save(step, _state(step)).result(30)
    first.wait()
    second = CheckpointManager(disk, memory=opts, write=WriteOptions(lock_timeout_s=0.1))
    with pytest.raises(CheckpointError, match="another writer holds"):
        second.save(9, _state(9))  # a live writer's tier is never shared
    assert first.memory is not None
    first.memory.lock.release()  # as if its process died: the tier stays as it was
    first.close()
    assert second.restore()["step"] == 2  # from the memory tier: the disk has only step 1
    assert commit.steps(disk) == [1]
    second.save(3, _state(3)).result(30)  # the same tier, taken over
    assert second.memory is not None and second.memory.steps() == [3]
    second.close()
    assert commit.steps(disk) == [1, 3] and not second.memory.directory.exists()


def test_copy_step_refuses_a_corrupt_snapshot_and_publishes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "mem"
    with CheckpointManager(src, keep_last=None) as m:
        m.save(5, _state(5)).result(30)
    _corrupt(src / "step-5")
    (tmp_path / "disk").mkdir()
    with pytest.raises(CorruptCheckpointError):
        copy_step(src / "step-5", tmp_path / "disk", 5)
    assert commit.steps(tmp_path / "disk") == [] and commit.leftovers(tmp_path / "disk") == []


def test_a_memory_tier_larger_than_the_tmpfs_is_refused_with_the_figures(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(CheckpointError, match=r"2 \+ 2 snapshots of .* GiB need .* can hold"):
        check_capacity(root / "t", root, 2, free // 2, 0)
    check_capacity(root / "t", root, 2, free // 6, 0)  # fits
    check_capacity(root / "t", root, 2, free // 2, 2 * free)  # fits: its own snapshots are replaced
    tier = MemoryTier(tmp_path / "disk", MemoryOptions(root=root), lambda s, p: None)
    with pytest.raises(CheckpointError, match=r"lower MemoryOptions\.keep"):
        tier.prepare(lambda: free, 0.0)
    tier.lock.release()


def test_options_are_validated() -> None:
    assert memory_options(True) == MemoryOptions()
    assert memory_options(False) is None and memory_options(None) is None
    with pytest.raises(TypeError, match="MemoryOptions"):
        memory_options("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep"):
        MemoryOptions(keep=0)
    with pytest.raises(ValueError, match="multiple of persist_every"):
        MemoryOptions(persist_every=4, remote_every=6)


def test_remote_every_uploads_only_those_steps(tmp_path: Path) -> None:
    opts = _opts(tmp_path, keep=1, persist_every=2, remote_every=4)
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "d", keep_last=None, remote=f"file://{remote}",
                           memory=opts) as m:  # fmt: skip
        for step in range(1, 10):
            m.save(step, _state(step))
            m.wait()  # each persist done before the next is due: none is replaced
        m.wait(uploads=True)
        assert commit.steps(tmp_path / "d") == [2, 4, 6, 8]
        assert sorted(int(p.name[5:]) for p in remote.iterdir()) == [4, 8]
    # close persisted step 9, the run's last state, and uploaded it
    assert sorted(int(p.name[5:]) for p in remote.iterdir()) == [4, 8, 9]


def _killed_run(disk: Path, root: Path) -> None:
    child = textwrap.dedent(f"""
        import os, signal, torch
        from ckpt.manager import CheckpointManager, WriteOptions
        from ckpt.tiers.memory_options import MemoryOptions
        m = CheckpointManager({str(disk)!r}, memory=MemoryOptions(root={str(root)!r},
                              persist_every=100))
        for step in range(1, 4):
            m.save(step, {{"w": torch.full((100,), float(step))}})
        m.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = _run(child)
    assert proc.returncode == -9, proc.stderr[-2000:]


def test_ckpt_ls_and_gc_see_the_memory_tier(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    disk, root = tmp_path / "disk", tmp_path / "shm"
    _killed_run(disk, root)
    where = tier_dir(disk, root)
    assert cli.main(["ls", str(disk), "--memory-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"memory tier {where}" in out and "committed, latest" in out
    # a live writer's tier is kept
    live = MemoryTier(disk, MemoryOptions(root=root), lambda s, p: None)
    live.lock.acquire()
    assert cli.main(["gc", str(disk), "--keep-last", "2", "--memory-root", str(root)]) == 0
    assert "kept memory tier" in capsys.readouterr().out and where.is_dir()
    live.lock.release()
    assert cli.main(["gc", str(disk), "--keep-last", "2", "--memory-root", str(root),
                     "--dry-run"]) == 0  # fmt: skip
    assert "would persist step 3 first" in capsys.readouterr().out and where.is_dir()
    (where / "notes.txt").write_text("mine")  # a foreign file is never deleted
    assert cli.main(["gc", str(disk), "--keep-last", "2", "--memory-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "persisted step 3" in out and "notes.txt" in out
    assert (where / "notes.txt").read_text() == "mine" and commit.steps(where) == []
    with CheckpointManager(disk) as m:
        assert torch.equal(m.restore()["w"], torch.full((100,), 3.0))
    (where / "notes.txt").unlink()
    assert cli.main(["gc", str(disk), "--keep-last", "2", "--memory-root", str(root)]) == 0
    assert not where.exists()


@pytest.mark.gpu
def test_gpu_restore_from_the_memory_tier_into_cuda(tmp_path: Path) -> None:
    opts = _opts(tmp_path, keep=1, persist_every=5)
    with CheckpointManager(tmp_path / "d", memory=opts) as m:
        m.save(1, {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32)}).result(60)
        state = m.restore(map_location="cuda")
        assert state["w"].is_cuda and torch.equal(state["w"].cpu(), torch.arange(1 << 20).float())


def test_the_default_tier_on_dev_shm_persists_across_filesystems(tmp_path: Path) -> None:
    """``memory=True``: the tier under /dev/shm (a tmpfs), persisted to a disk directory on
    another filesystem (the copy runs in the kernel across filesystems), freed by ``close``."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with CheckpointManager(tmp_path / "d", memory=True) as m:
        assert m.memory is not None and str(m.memory.directory).startswith("/dev/shm/ckpt-mem-")
        m.save(1, _state(1)).result(30)
        where = m.memory.directory
    assert commit.steps(tmp_path / "d") == [1] and not where.exists()
    with CheckpointManager(tmp_path / "d") as plain:
        assert torch.equal(plain.restore()["w"], _state(1)["w"])


def test_a_persist_waiting_behind_a_slow_one_is_replaced_by_the_newer_step(tmp_path: Path) -> None:
    """Saves never wait for the disk: while one persist runs, a newer due step replaces the one
    waiting (counted in ``superseded``)."""
    import threading

    from ckpt.tiers.memory_persist import Persister

    src, disk = tmp_path / "mem", tmp_path / "disk"
    with CheckpointManager(src, keep_last=None) as m:
        for step in (3, 6, 9):
            m.save(step, _state(step)).result(30)
    disk.mkdir()
    started, release, done = threading.Event(), threading.Event(), []

    def persisted(step: int, path: Path) -> None:
        done.append(step)
        started.set()
        assert release.wait(30)

    persister = Persister(src, disk, persisted)
    persister.submit(3)
    assert started.wait(30)  # step 3 copied, its post-persist action held
    persister.submit(6)
    persister.submit(9)  # replaces 6, still waiting
    assert persister.holds(3) and not persister.holds(9)  # only the step being copied
    release.set()
    persister.wait(30)
    persister.raise_pending()
    assert done == [3, 9] and commit.steps(disk) == [3, 9]
    assert persister.stats.superseded == 1 and persister.stats.persisted == 2
    # a waiting step that retention evicted from memory before its copy began is dropped too
    started.clear()
    release.clear()
    with CheckpointManager(src, keep_last=None) as m:
        for step in (12, 15):
            m.save(step, _state(step)).result(30)
    persister.submit(12)
    assert started.wait(30)
    persister.submit(15)
    assert commit.evict(src, 15)
    release.set()
    persister.wait(30)
    persister.raise_pending()  # not a failure
    assert done == [3, 9, 12] and persister.stats.superseded == 2
    assert persister.stats.failed == 0


def test_a_failed_persist_is_raised_and_close_keeps_the_tier(tmp_path: Path) -> None:
    opts = _opts(tmp_path, keep=2, persist_every=2)
    disk = tmp_path / "disk"
    m = CheckpointManager(disk, memory=opts)
    m.save(1, _state(1)).result(30)
    (disk / "step-2").write_text("not a checkpoint")  # the disk refuses to replace it
    m.save(2, _state(2)).result(30)  # committed in memory; its persist fails
    with pytest.raises(CheckpointError, match="persisting step 2 from the memory tier"):
        m.wait()
    assert m.memory is not None
    where = m.memory.directory
    with pytest.raises(CheckpointError):
        m.close()  # the newest snapshot cannot be persisted: the tier stays
    assert commit.steps(where) == [1, 2]
    assert (disk / "step-2").read_text() == "not a checkpoint"
    with CheckpointManager(disk, memory=opts) as again:
        assert again.restore()["step"] == 2  # from the memory tier that was kept
    (disk / "step-2").unlink()


@pytest.mark.slow  # a child process and two managers: about 15 s on a loaded 2-core machine
def test_the_memory_tier_benchmark_runs_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """benchmarks/ckpt_memory_tier.py on a tiny state (no timing asserted): both comparisons
    print their ratio, and it leaves nothing behind."""
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "ckpt_memory_tier.py"
    bench = runpy.run_path(str(script), run_name="ckpt_memory_tier_bench")
    (tmp_path / "shm").mkdir()
    (tmp_path / "work").mkdir()
    argv = ["--size-mb", "1", "--saves", "2", "--repeats", "1", "--persist-every", "2",
            "--shm", str(tmp_path / "shm"), "--dir", str(tmp_path / "work")]  # fmt: skip
    assert bench["main"](argv) == 0
    out = capsys.readouterr().out
    assert "ratio disk/memory" in out and "ratio memory/disk cold" in out
    assert "freed stale memory tier" in out
    assert list((tmp_path / "shm").iterdir()) == [] and list((tmp_path / "work").iterdir()) == []
