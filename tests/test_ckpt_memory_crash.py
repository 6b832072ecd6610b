"""Crash consistency of the memory tier with real processes: a run that saves every step into the
memory tier (every 3rd persisted to disk in the background, restoring now and then) is SIGKILLed
inside each phase of a save, a persist and a restore, and after the k-th filesystem operation for
a spread of k; every time a new process restores a complete, verified step equal to one saved
and never older than the newest step whose save was acknowledged."""

from __future__ import annotations

import collections
import multiprocessing as mp
import random
import time
from pathlib import Path

import _ckpt_memory_crash_worker as worker
import numpy as np
import torch

from ckpt.manager import CheckpointManager
from ckpt.saving import commit
from ckpt.tiers.memory_options import tier_dir

TARGETS = ("stage", "write", "fsync", "rename", "latest", "retention", "persist", "restore", None)
KILL_AFTER = (1, 3, 6, 9, 14, 20, 27, 35, 44, 55)  # the k-th filesystem operation
# the last run lives until a persist reached the disk: the kills above land too early for that
# on a fast or a loaded machine alike (a persist is every 3rd save of a run)
PERSISTED = "persisted"


def _same(state: dict, ref: dict) -> bool:
    return (
        torch.equal(state["w"], ref["w"])
        and np.array_equal(state["arr"], ref["arr"])
        and state["meta"] == ref["meta"]
    )


def _one_run(
    ctx: mp.context.BaseContext, root: Path, target: object, rng: random.Random
) -> tuple[str, int]:
    """Start the worker, kill it (in the ``target`` phase, or after the k-th operation when
    ``target`` is an int); returns (its phase, its acknowledged step)."""
    phase, acked = ctx.Array("c", 16), ctx.Value("q", -1)
    kill_after = target if isinstance(target, int) else 0
    proc = ctx.Process(target=worker.run, args=(str(root), phase, acked, kill_after), daemon=True)
    proc.start()
    if target == PERSISTED:  # the run goes on until a step is on the disk (a kill after it)
        deadline = time.monotonic() + 60  # a deadlock guard: the kill lands anyway after it
        while proc.is_alive() and time.monotonic() < deadline and not commit.steps(root / "disk"):
            time.sleep(0.01)
        assert proc.is_alive(), f"worker died on its own (exit code {proc.exitcode})"
        proc.kill()
    elif not kill_after:
        deadline = time.monotonic() + 60  # a deadlock guard: the kill lands anyway after it
        while proc.is_alive() and time.monotonic() < deadline:
            now = phase.value.decode()
            if now and (target is None or now == target):
                break
            time.sleep(0.001)
        proc.join(rng.uniform(0.0, 0.01) if target else rng.uniform(0.05, 0.3))
        assert proc.is_alive(), f"worker died on its own (exit code {proc.exitcode})"
        proc.kill()
    proc.join(60)
    assert proc.exitcode == -9, f"worker exit code {proc.exitcode} (target {target})"
    return phase.value.decode(), int(acked.value)


def _check(root: Path, reader: CheckpointManager, acked: int, last: int, i: int) -> int:
    memory = tier_dir(root / "disk", worker.options(root).root)
    # the newest KEEP, one committed whose retention pass the kill cut, one held by a persist
    assert len(commit.steps(memory)) <= worker.KEEP + 2, f"kill {i}: {commit.steps(memory)}"
    if not reader.steps():
        assert acked < 0, f"kill {i}: step {acked} was acknowledged, none is listed"
        return last
    state = reader.restore()
    step = state["meta"]["step"]
    stats = reader.stats.last_restore
    assert stats is not None and stats.verified and not stats.skipped, stats
    assert _same(state, worker.expected(step)), f"kill {i}: step {step} differs from saved"
    assert step >= max(acked, last), f"kill {i}: restored {step}, acknowledged {acked}"
    for s in commit.steps(root / "disk"):  # every persisted step is whole too
        assert _same(reader.restore(s), worker.expected(s)), f"kill {i}: disk step {s}"
    return step


def test_memory_tier_survives_sigkill_in_every_phase(tmp_path: Path) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "ckpt.manager", "_ckpt_memory_crash_worker"])
    rng = random.Random(3)
    reader = CheckpointManager(tmp_path / "disk", memory=worker.options(tmp_path))  # never saves
    phases: collections.Counter[str] = collections.Counter()
    last = -1
    plan: list[object] = [*TARGETS, *KILL_AFTER, PERSISTED]
    for i, target in enumerate(plan):
        phase, acked = _one_run(ctx, tmp_path, target, rng)
        if target != PERSISTED:
            phases[phase if not isinstance(target, int) else f"op{target}"] += 1
        last = _check(tmp_path, reader, acked, last, i)
    assert last > 0, "no step was ever saved"
    assert commit.steps(tmp_path / "disk"), "no step was ever persisted"
    reached = {"stage", "write", "fsync", "rename", "latest", "retention", "persist", "restore"}
    assert len(set(phases) & reached) >= 5, phases
    print(f"\n{len(plan)} SIGKILLs: {dict(sorted(phases.items()))}")
