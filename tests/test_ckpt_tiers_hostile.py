"""Attacks on the memory tier, the run log and the new save paths of issue 27 (docs/tiers.md,
docs/interval.md, docs/overlap.md), each a promise a hostile neighbour or a careless user could
break: a tier planted in ``/dev/shm`` by someone else (a symlink, a directory others may write,
another user's), a hostile ``runs.json``. Every test failed before its fix."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _ckpt_tiers_hostile_worker as worker
import pytest
import torch

from ckpt import cli
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.interval import AutoInterval, IntervalRule, daly
from ckpt.manager import CheckpointManager
from ckpt.saving.pipeline import SaveStats
from ckpt.tiers import replica
from ckpt.tiers.memory import MemoryStats
from ckpt.tiers.memory_options import MemoryOptions, tier_dir


def _opts(root: Path) -> MemoryOptions:
    return MemoryOptions(root=root, persist_every=1000)


def _run(path: Path, step: int, value: float) -> Path:
    """A committed ckpt root at ``path`` holding ``step`` of ``{"x": [value] * 3}``."""
    with CheckpointManager(path) as m:
        m.save(step, {"x": torch.full((3,), value)}).result()
    return path


def _tree(path: Path) -> list[tuple[str, bytes]]:
    """Every file under ``path`` and its bytes (to prove nothing changed)."""
    return sorted(
        (str(p.relative_to(path)), p.read_bytes()) for p in path.rglob("*") if p.is_file()
    )


def test_the_tier_is_created_private_to_its_user(tmp_path: Path) -> None:
    """Snapshots in /dev/shm are readable by no other user: the tier is mode 0o700."""
    with CheckpointManager(tmp_path / "run", memory=_opts(tmp_path / "shm")) as m:
        m.save(1, {"x": torch.ones(3)}).result()
        mode = stat.S_IMODE(os.stat(m.memory.directory).st_mode)  # type: ignore[union-attr]
    assert mode == 0o700


def test_a_symlink_planted_at_the_tiers_name_is_never_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: restore() loaded the planted step 100, save() wrote into the link's target and
    close() deleted the target's steps (a symlink to another run's directory lost it)."""
    shm, disk = tmp_path / "shm", _run(tmp_path / "run", 1, 1.0)
    evil = _run(tmp_path / "other-run", 100, 666.0)
    before = _tree(evil)
    shm.mkdir()
    os.symlink(evil, tier_dir(disk, shm))
    m = CheckpointManager(disk, memory=_opts(shm))
    with pytest.raises(CheckpointError, match="is a symlink"):
        m.restore()
    with pytest.raises(CheckpointError, match="is a symlink"):
        m.save(2, {"x": torch.ones(3)}).result()
    m.close()
    assert cli.main(["gc", str(disk), "--keep-last", "5", "--memory-root", str(shm)]) == 0
    assert "skipped memory tier" in capsys.readouterr().out
    assert cli.main(["ls", str(disk), "--memory-root", str(shm)]) == 1
    assert "is a symlink" in capsys.readouterr().out
    assert _tree(evil) == before  # nothing read into the run, written or deleted there
    assert 100 not in CheckpointManager(disk).steps()


def test_a_tier_others_may_write_is_refused(tmp_path: Path) -> None:
    """A planted tier (a real directory, mode 0o777) with a valid step 100 is not restored."""
    shm, disk = tmp_path / "shm", _run(tmp_path / "run", 1, 1.0)
    evil = _run(tmp_path / "other-run", 100, 666.0)
    shm.mkdir()
    planted = tier_dir(disk, shm)
    shutil.copytree(evil, planted)
    os.chmod(planted, 0o777)
    m = CheckpointManager(disk, memory=_opts(shm))
    with pytest.raises(CheckpointError, match="writable by other users"):
        m.restore()
    m.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_tier_of_another_user_is_refused(tmp_path: Path) -> None:
    shm, disk = tmp_path / "shm", _run(tmp_path / "run", 1, 1.0)
    evil = _run(tmp_path / "other-run", 100, 666.0)
    shm.mkdir()
    planted = tier_dir(disk, shm)
    shutil.copytree(evil, planted)
    os.chmod(planted, 0o700)
    os.chown(planted, 65534, 65534)
    m = CheckpointManager(disk, memory=_opts(shm))
    with pytest.raises(CheckpointError, match="owned by uid 65534"):
        m.restore()
    with pytest.raises(CheckpointError, match="owned by uid 65534"):
        m.save(2, {"x": torch.ones(3)}).result()
    m.close()


def test_an_own_tier_readable_by_others_is_made_private(tmp_path: Path) -> None:
    """A tier of this user left 0o755 (an earlier version) is tightened, not refused."""
    shm, disk = tmp_path / "shm", tmp_path / "run"
    with CheckpointManager(disk, memory=MemoryOptions(root=shm, persist_on_close=False)) as m:
        m.save(1, {"x": torch.ones(3)}).result()
        where = m.memory.directory  # type: ignore[union-attr]
        m.memory.lock.release()  # type: ignore[union-attr]  # a crash: the tier stays
        m.memory = None
    os.chmod(where, 0o755)
    with CheckpointManager(disk, memory=_opts(shm)) as m:
        assert torch.equal(m.restore()["x"], torch.ones(3))
        m.save(2, {"x": torch.ones(3)}).result()
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o700


_HOSTILE_LOGS = [
    {"alive_s": float("nan")},  # MTBF NaN: the interval became max_steps (never a save)
    {"alive_s": float("inf")},
    {"open": {"pid": 1, "host": "x", "alive_s": "abc"}},  # a bare ValueError from begin()
    {"open": {"pid": 1, "host": "x", "alive_s": float("nan")}},
    {"open": {"pid": 1, "host": "x", "alive_s": -1e12}},  # math domain error in should_save
    {"failures": 10**400},  # OverflowError in should_save (an int too large for a float)
]


@pytest.mark.parametrize("bad", _HOSTILE_LOGS, ids=lambda d: repr(d)[:40])
def test_a_hostile_run_log_is_refused_naming_the_file(
    tmp_path: Path, bad: dict[str, object]
) -> None:
    doc = {"tool": "ckpt", "version": 1, "runs": 1, "failures": 0, "alive_s": 1.0, **bad}
    tmp_path.joinpath("runs.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"runs\.json: unreadable run log"):
        m = CheckpointManager(tmp_path, save_interval_steps="auto")
        for step in range(3):
            if m.should_save(step):
                m.save(step, {"x": torch.zeros(3)}).result()
        m.interval()
        m.close()


def test_a_state_that_grows_is_checked_against_the_tmpfs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: only the first save's size was checked, so a first save made before the
    optimizer's first step (AdamW's state is made there, twice the model) was admitted and
    the larger snapshots filled the tmpfs. The tmpfs's figures are simulated: 64 KiB free."""
    real = os.statvfs

    class _Small:
        def __init__(self, path: object) -> None:
            st = real(path)  # type: ignore[arg-type]
            self.f_frsize, self.f_blocks, self.f_bavail = st.f_frsize, 16, 65536 // st.f_frsize

    monkeypatch.setattr(os, "statvfs", _Small)
    model = torch.nn.Linear(40, 40)  # 6.5 KiB of parameters
    opt = torch.optim.AdamW(model.parameters())
    m = CheckpointManager(tmp_path / "run", memory=MemoryOptions(root=tmp_path / "shm", keep=4))
    m.save(0, {"model": model, "optim": opt}).result()  # 6 snapshots of ~7 KiB: admitted
    model(torch.randn(2, 40)).sum().backward()
    opt.step()  # the optimizer's state appears: the snapshot triples
    m.save(1, {"model": model, "optim": opt}).result()
    with pytest.raises(CheckpointError, match=r"4 \+ 2 snapshots of .* GiB need"):
        m.save(2, {"model": model, "optim": opt}).result()
    m.close()


def _proc(ctx: Any, target: Any, *args: object) -> int:
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"{target.__name__}{args} hung")
    return int(proc.exitcode)


def _ops(ctx: Any, tmp_path: Path, gc: bool) -> int:
    """How many filesystem operations the close (or the gc of a stale tier) makes."""
    root, trace = tmp_path / "count", tmp_path / "trace"
    _proc(ctx, worker.run, str(root), not gc, 0 if gc else 10**6, None if gc else str(trace))
    if gc:
        assert _proc(ctx, worker.gc, str(root), 10**6, str(trace)) == 0
    return len(trace.read_text().splitlines())


def _newest_whole(root: Path) -> bool:
    reader = CheckpointManager(root / "disk", memory=worker.options(root))
    got = reader.restore()
    return bool(
        got["s"] == worker.NEWEST and torch.equal(got["w"], worker.state(worker.NEWEST)["w"])
    )


@pytest.fixture(scope="module")
def ctx() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "ckpt.manager", "ckpt.cli", "_ckpt_tiers_hostile_worker"]
    )
    return context


def test_a_gc_killed_after_any_operation_leaves_a_tier_the_next_gc_frees(
    tmp_path: Path, ctx: Any
) -> None:
    """Before: a gc killed between removing the tier's marker and removing the tier left a
    directory holding only ``.lock``, that every later ``ckpt gc`` skipped as "not written
    by ckpt": the stale tier was never freed. The newest step is never lost either way."""
    n = _ops(ctx, tmp_path, gc=True)
    assert n > 10
    stale = tmp_path / "stale"
    assert _proc(ctx, worker.run, str(stale), False, 0, None) == -9
    for k in range(1, n + 1):
        root = tmp_path / f"k{k}"
        shutil.copytree(stale, root)  # the same stale tier each time, named for its copy
        copied = root / "shm" / tier_dir(stale / "disk", stale / "shm").name
        os.rename(copied, tier_dir(root / "disk", root / "shm"))
        assert _proc(ctx, worker.gc, str(root), k, None) == -9, f"op {k} of {n}"
        assert cli.main(["gc", str(root / "disk"), "--keep-last", "2", "--memory-root",
                         str(root / "shm")]) == 0  # fmt: skip
        assert not tier_dir(root / "disk", root / "shm").exists(), f"killed after op {k}"
        assert _newest_whole(root), f"killed after op {k}"


def test_a_close_killed_after_any_operation_loses_nothing(tmp_path: Path, ctx: Any) -> None:
    """(Held.) A close killed after any of its operations (the last persist, then freeing the
    tier): the newest step restores whole, and the next run saves and frees the tier."""
    n = _ops(ctx, tmp_path, gc=False)
    assert n > 10
    for k in range(1, n + 1):
        root = tmp_path / f"k{k}"
        assert _proc(ctx, worker.run, str(root), True, k, None) == -9, f"op {k} of {n}"
        assert _newest_whole(root), f"killed after op {k}"
        with CheckpointManager(root / "disk", memory=worker.options(root)) as m:
            m.save(worker.NEWEST + 1, worker.state(0)).result()
        assert not tier_dir(root / "disk", root / "shm").exists(), f"killed after op {k}"


def test_the_reported_bound_is_the_one_that_set_the_held_interval(tmp_path: Path) -> None:
    """Before: ``interval()`` reported the interval held since the last save (60 steps, set by
    Young-Daly) with the bound of the current inputs (``max_steps (100)``, as the steps got
    faster since): a report naming a bound that did not set its ``steps``."""
    rule = IntervalRule(AutoInterval(mtbf_s=3600, max_steps=100), tmp_path)
    stats = SimpleNamespace(last_save=None, remote=None)
    assert rule.should_save(0, stats, now=0.0)  # the first step saves, to measure the cost
    stats.last_save = SaveStats(0, blocked_s=0.5, write_s=0.1, durable_s=1.0)
    assert not rule.should_save(1, stats, now=1.5)  # a 1 s step: 60 steps (Young-Daly)
    for step in range(2, 6):
        assert not rule.should_save(step, stats, now=1.5 + 0.1 * (step - 1))  # 0.1 s steps
    report = rule.report()
    assert report.steps == round(daly(0.5, 3600) / 1.0) == 60
    assert report.bound == "Young-Daly (Daly's higher order)", report


def test_ckpt_ls_and_gc_of_a_lost_disk_show_the_memory_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """'The local disk is lost: memory survives' (docs/tiers.md). Before: ``ckpt ls DIR`` and
    ``ckpt gc DIR`` said only "no such directory", hiding the tier that holds the only copy."""
    shm, disk = tmp_path / "shm", tmp_path / "run"
    m = CheckpointManager(disk, memory=MemoryOptions(root=shm, persist_every=100))
    for step in range(3):
        m.save(step, {"x": torch.full((3,), float(step))}).result()
    m.memory.lock.release()  # type: ignore[union-attr]  # the process dies, its tier stays
    m.memory = None
    m.close()
    shutil.rmtree(disk)
    for command in ("ls", "gc"):
        assert cli.main([command, str(disk), "--memory-root", str(shm)]) == 2
        out, err = capsys.readouterr()
        assert "no such directory" in err and "holds the only copy" in err, err
        rows = [line.split() for line in out.splitlines()]
        assert f"memory tier {tier_dir(disk, shm)}:" in out, out
        assert [rows[-1][0], *rows[-1][-2:]] == ["2", "committed,", "latest"], out
    disk.mkdir()  # the way out the message names: ckpt gc persists the newest step there
    assert cli.main(["gc", str(disk), "--keep-last", "2", "--memory-root", str(shm)]) == 0
    assert not tier_dir(disk, shm).exists()
    assert torch.equal(CheckpointManager(disk).restore()["x"], torch.full((3,), 2.0))


def test_a_replica_file_is_written_whole_whatever_one_write_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: each file of a peer's snapshot was written by one ``os.write``, which moves at
    most 2 GiB on Linux: a shard file over 2 GiB was cut, its CRC failed and the replica of
    every save (and the restore of a lost node from it) failed. A short write is simulated
    (64 KiB a call: POSIX allows any), on a 1 MiB file."""
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, data[: 64 << 10]))
    payload = os.urandom(1 << 20)
    frame = [len(b"data.bin").to_bytes(8, "little"), b"data.bin"]
    frame += [len(payload).to_bytes(8, "little"), payload]
    blob = torch.frombuffer(bytearray(b"".join(frame)), dtype=torch.uint8)
    (tmp_path / "step").mkdir()
    replica.unpack(blob, tmp_path / "step")
    assert (tmp_path / "step" / "data.bin").read_bytes() == payload
    monkeypatch.undo()
    (tmp_path / "cut").mkdir()
    with pytest.raises(CorruptCheckpointError, match="cut short"):
        replica.unpack(blob[:-1], tmp_path / "cut")


def test_with_a_memory_tier_the_disk_floor_is_the_persists_time(tmp_path: Path) -> None:
    """docs/interval.md: with memory-tier saves "the persist floor then keeps the disk from
    falling behind". Before: the floor read each save's write into the tmpfs as the disk's
    time, and the persists to disk (``stats.memory.persist``) were never read: a 50 s persist
    every 10 saves did not bound a 3 s interval."""
    rule = IntervalRule(AutoInterval(mtbf_s=10.0), tmp_path)  # Daly: ~2.9 s for a 0.5 s save
    memory = MemoryStats()
    memory.persist_every = 10  # as MemoryTier sets it from MemoryOptions(persist_every=10)
    stats = SimpleNamespace(last_save=None, remote=None, memory=memory)
    assert rule.should_save(0, stats, now=0.0)
    stats.last_save = SaveStats(0, blocked_s=0.5, write_s=0.01, durable_s=1.0)
    memory.persist.persisted, memory.persist.last_s = 1, 50.0
    rule.should_save(1, stats, now=1.5)  # a 1 s step
    report = rule.report()
    assert report.persist_s == {"memory": 0.01, "disk": 5.0}, report
    assert report.bound == "persist floor (disk tier)" and report.steps == 5, report


def test_a_manager_with_a_memory_tier_reports_both_tiers_persist_times(tmp_path: Path) -> None:
    m = CheckpointManager(
        tmp_path / "run",
        save_interval_steps=AutoInterval(mtbf_s=3600, max_steps=2),
        memory=MemoryOptions(root=tmp_path / "shm", persist_every=2),
    )
    for step in range(8):
        if m.should_save(step):
            m.save(step, {"x": torch.zeros(3)}).result()
            m.wait()
    report = m.interval()
    assert report is not None and set(report.persist_s) == {"memory", "disk"}, report
    m.close()


def test_a_root_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    """There anyone may rename the tier away and put theirs in its place after any check."""
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o777)
    m = CheckpointManager(tmp_path / "run", memory=_opts(shm))
    with pytest.raises(CheckpointError, match="without the sticky bit"):
        m.save(1, {"x": torch.ones(3)}).result()
    m.close()
    os.chmod(shm, 0o1777)  # /dev/shm's mode: fine
    with CheckpointManager(tmp_path / "run", memory=_opts(shm)) as m:
        m.save(1, {"x": torch.ones(3)}).result()
