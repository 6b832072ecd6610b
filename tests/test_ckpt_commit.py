"""The commit protocol survives a kill between any two of its filesystem operations, and recovery
of a killed writer's directory is idempotent and never deletes the only complete copy."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _ckpt_commit_worker as worker
import pytest
import torch

import ckpt
from ckpt.manager import CheckpointManager
from ckpt.saving import commit


def _ctx() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "ckpt.manager", "ckpt.simple", "ckpt.dcp", "_ckpt_commit_worker"]
    )
    return ctx


def _same(got: dict, step: int) -> str:
    """The tag of ``got`` if it equals what was saved for ``step`` under that tag."""
    ref = worker.state(step, got["tag"])
    assert torch.equal(got["w"], ref["w"]) and torch.equal(got["b"], ref["b"]), step
    assert got["step"] == step
    return str(got["tag"])


def _check_manager(root: Path, k: int, steps: int) -> dict[int, str]:
    reader = CheckpointManager(root)  # restore() recovers: the killed writer holds no lock
    found: dict[int, str] = {}
    for s in reader.steps():
        found[s] = _same(reader.restore(s), s)
        assert reader.stats.last_restore is not None and reader.stats.last_restore.verified
    newest = max(found)
    # 4 and 5 were committed before the worker ran; retention may delete a step only once
    # keep_last=2 newer ones are committed
    for s in (4, 5):
        if s not in found:
            assert len([t for t in found if t > s]) >= 2, f"k={k}: step {s} lost: {found}"
    latest = commit.read_latest(root)
    assert latest in found, f"k={k}: latest={latest} is not a committed step {sorted(found)}"
    assert latest == newest or latest == newest - 1, (k, latest, found)
    assert reader.restore()["step"] == newest
    return found


def _dcp_load(root: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageReader

    got = {"w": torch.zeros(4096), "b": torch.zeros(100, dtype=torch.long), "tag": "", "step": 0}
    dcp.load(got, storage_reader=CkptStorageReader(root, 5), no_dist=True)
    return got


def _prepare(base: Path, mode: str) -> None:
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp

        from ckpt.dcp import CkptStorageWriter

        state = worker.state(5, "old")
        dcp.save(state, storage_writer=CkptStorageWriter(base, 5), no_dist=True)
        return
    if mode == "simple":
        ckpt.save(base / "model", worker.state(5, "old"))
        return
    with CheckpointManager(base, keep_last=None) as m:
        for s in (4, 5):
            m.save(s, worker.state(s, "old")).result(30)


def _harness(tmp_path: Path, mode: str, no_exchange: bool, steps: int) -> dict[str, int]:
    ctx = _ctx()
    base = tmp_path / "base"
    _prepare(base, mode)
    seen = {"kills": 0, "old": 0, "new": 0, "cut": 0}
    k = 0
    while True:
        k += 1
        assert k < 500, "the worker never finished"
        root = tmp_path / f"k{k}"
        shutil.copytree(base, root)
        trace = tmp_path / f"trace{k}"
        proc = ctx.Process(
            target=worker.run, args=(str(root), mode, k, no_exchange, str(trace), steps)
        )
        proc.start()
        proc.join(60)
        assert proc.exitcode in (0, -9), f"k={k}: worker exit code {proc.exitcode}"
        if proc.exitcode == 0:
            break
        seen["kills"] += 1
        if mode == "dcp":  # no writer lock: the reader's listing recovers
            seen["cut"] += not (root / "step-5").exists()
            seen[_same(_dcp_load(root), 5)] += 1
            assert commit.read_latest(root) == 5 and commit.steps(root) == [5], k
        elif mode == "simple":
            seen["cut"] += not (root / "model").exists()
            got = ckpt.load(root / "model")
            tag = _same(got, 5)
            seen[tag] += 1
            ckpt.save(root / "model", worker.state(5, "new"))  # the next save recovers
            assert sorted(p.name for p in root.iterdir()) == ["model"], k
            assert _same(ckpt.load(root / "model"), 5) == "new"
        else:
            seen["cut"] += not (root / "step-5").exists() and (4 in commit.steps(root))
            before = _check_manager(root, k, steps)
            if 5 in before:
                seen[before[5]] += 1
            with CheckpointManager(root, keep_last=None) as writer:
                writer.gc()  # takes the writer lock: recovery and leftover removal
            assert commit.leftovers(root) == [], f"k={k}: {commit.leftovers(root)}"
            assert _check_manager(root, k, steps) == before, f"k={k}: recovery changed steps"
        shutil.rmtree(root)
    return seen


_CASES = [
    pytest.param(mode, no_exchange, id=f"{mode}-{'fallback' if no_exchange else 'exchange'}")
    for mode in ("manager", "simple", "dcp")
    for no_exchange in (False, True)
    if not (mode == "dcp" and not no_exchange)  # same publish as the manager's: slow run only
]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "no_exchange"), _CASES)
def test_kill_after_every_fs_operation(tmp_path: Path, mode: str, no_exchange: bool) -> None:
    seen = _harness(tmp_path, mode, no_exchange, steps=2 if mode == "manager" else 1)
    if mode == "dcp":
        assert seen["kills"] >= 5 and seen["new"], seen
    print(f"\n{mode} {'fallback' if no_exchange else 'exchange'}: {seen}")
    assert seen["kills"] >= 5 and seen["old"] and seen["new"], seen
    if no_exchange:  # the window between the two renames was hit, and recovered
        assert seen["cut"] >= 1, seen
    else:
        assert seen["cut"] == 0, seen  # the exchange has no such window


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("no_exchange", [False, True], ids=["exchange", "fallback"])
@pytest.mark.parametrize("mode", ["manager", "simple", "dcp"])
def test_kill_after_every_fs_operation_long(tmp_path: Path, mode: str, no_exchange: bool) -> None:
    seen = _harness(tmp_path, mode, no_exchange, steps=5 if mode == "manager" else 3)
    assert seen["kills"] >= 15 and seen["new"], seen


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_recovery_never_deletes_the_only_complete_copy(tmp_path: Path) -> None:
    """The state a two-rename re-save leaves when killed between its renames: ``step-5`` gone,
    the old copy under ``step-5.del-*``, the new one under ``step-5.tmp-*``. Readers still see
    step 5, and the next writer puts it back instead of deleting both copies as leftovers."""
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(4, worker.state(4, "old")).result(30)
        m.save(5, worker.state(5, "old")).result(30)
        m.save(9, worker.state(9, "old")).result(30)  # a scratch step to play the new copy
    (tmp_path / "step-9").rename(tmp_path / "step-5.tmp-1-abcd")
    (tmp_path / "step-5").rename(tmp_path / "step-5.del-abcd")
    assert CheckpointManager(tmp_path).latest_step() == 5
    (tmp_path / "step-5").rename(tmp_path / "step-5.del-abcd")  # cut again, for the writer
    with CheckpointManager(tmp_path, keep_last=None) as writer:
        writer.save(6, worker.state(6, "new")).result(30)
        assert writer.steps() == [4, 5, 6]
        assert _same(writer.restore(5), 5) == "old"
    assert commit.leftovers(tmp_path) == []
    # the same for ckpt.save(path): load and the next save put the old copy back
    model = tmp_path / "model"
    ckpt.save(model, worker.state(5, "old"))
    model.rename(tmp_path / "model.del-abcd")
    assert _same(ckpt.load(model), 5) == "old"
    model.rename(tmp_path / "model.del-abcd")
    ckpt.save(tmp_path / "other", worker.state(5, "new"))
    assert (tmp_path / "model.del-abcd").is_dir()  # another path's save leaves it alone
    ckpt.save(model, worker.state(5, "new"))
    assert not (tmp_path / "model.del-abcd").exists()
    assert _same(ckpt.load(model), 5) == "new"


def _cut_run(base: Path) -> None:
    """A directory as crashed writers leave it: step 5 only under a complete ``.del-`` name, a
    half-deleted ``.del-`` copy, a dead save's temporary directory, an eviction cut after its
    manifest went, and a stray ``latest.tmp-``."""
    import shutil

    from _ckpt_commit_worker import state

    with CheckpointManager(base, keep_last=None) as m:
        for s in (4, 5, 6):
            m.save(s, state(s, "old")).result(30)
    shutil.copytree(base / "step-5", base / "step-5.tmp-1-abcd")
    shutil.copytree(base / "step-5", base / "step-5.del-bbbb")
    (base / "step-5.del-bbbb" / "manifest.json").unlink()
    (base / "step-5").rename(base / "step-5.del-aaaa")
    (base / "step-6" / "manifest.json").unlink()
    (base / "latest.tmp-1-abcd").write_text("step-6\n")


def _recover_manager(root: str) -> None:
    with CheckpointManager(root, keep_last=None) as m:
        m.gc()  # takes the writer lock: recovery and leftover removal


def _recover_reader(root: str) -> None:
    from ckpt.saving import commit

    commit.steps(Path(root))


def _recover_simple(root: str) -> None:
    ckpt.load(Path(root) / "model")


def _killed(fn: Callable[[str], None], root: Path, k: int) -> int | None:
    import multiprocessing as mp

    def body() -> None:
        os.environ["CKPT_TEST_KILL_AFTER"] = str(k)
        fn(str(root))

    proc = mp.get_context("fork").Process(target=body)
    proc.start()
    proc.join(30)
    return proc.exitcode


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("mode", ["manager", "reader", "simple"])
def test_recovery_is_idempotent_under_kills(tmp_path: Path, mode: str) -> None:
    """Recovery itself killed after its k-th operation, then killed again after its first, then
    run to the end: the only complete copy of step 5 is never lost."""
    import shutil

    from _ckpt_commit_worker import state

    base = tmp_path / "base"
    if mode == "simple":
        base.mkdir()
        ckpt.save(base / "model", state(5, "old"))
        shutil.copytree(base / "model", base / "model.del-bbbb")
        (base / "model.del-bbbb" / "manifest.json").unlink()
        (base / "model").rename(base / "model.del-aaaa")
    else:
        _cut_run(base)
    fn = {"manager": _recover_manager, "reader": _recover_reader, "simple": _recover_simple}[mode]
    for kills, k in enumerate(range(1, 40)):
        root = tmp_path / f"k{k}"
        shutil.copytree(base, root)
        code = _killed(fn, root, k)
        assert code in (0, -9), code
        assert _killed(fn, root, 1) in (0, -9)
        if mode == "simple":
            got = ckpt.load(root / "model")
        else:
            _recover_manager(str(root))
            with CheckpointManager(root) as m:
                assert m.steps() == [4, 5], k
                got = m.restore(5)
        assert got["tag"] == "old" and torch.equal(got["w"], state(5, "old")["w"]), k
        shutil.rmtree(root)
        if code == 0:
            assert kills >= (1 if mode == "reader" else 3), kills  # the harness did kill it
            return
    pytest.fail("recovery never finished")
