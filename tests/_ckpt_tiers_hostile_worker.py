"""Processes for the crash tests of tests/test_ckpt_tiers_hostile.py: a run that saves five
steps into the memory tier (every 2nd persisted, so the newest is in memory only), then either
closes its manager or dies; and a ``ckpt gc``. ``kill_after`` > 0 SIGKILLs the process after
that many filesystem operations of the close or the gc (``ckpt._faults``); ``trace`` names a
file that learns each operation."""

from __future__ import annotations

import contextlib
import io
import os
import signal
from pathlib import Path
from typing import Any

import torch

NEWEST = 4


def state(step: int) -> dict[str, Any]:
    """The state a run saves at ``step``."""
    return {"w": torch.full((1000,), float(step)), "s": step}


def options(root: Path) -> Any:
    from ckpt.tiers.memory_options import MemoryOptions

    return MemoryOptions(root=root / "shm", persist_every=2, keep=2)


def _arm(kill_after: int, trace: str | None) -> None:
    os.environ["CKPT_TEST_KILL_AFTER"] = str(kill_after)
    if trace:
        os.environ["CKPT_TEST_OP_TRACE"] = trace


def run(root: str, close: bool, kill_after: int, trace: str | None) -> None:
    """Save steps 0..NEWEST; then ``close()`` (armed) or die by SIGKILL (a stale tier)."""
    from ckpt.manager import CheckpointManager

    m = CheckpointManager(Path(root) / "disk", memory=options(Path(root)))
    for step in range(NEWEST + 1):
        m.save(step, state(step)).result(60)
    m.wait(60)
    if not close:
        os.kill(os.getpid(), signal.SIGKILL)
    _arm(kill_after, trace)
    m.close()


def gc(root: str, kill_after: int, trace: str | None) -> None:
    """``ckpt gc DIR --keep-last 2`` on the run's directory and memory root (armed)."""
    from ckpt import cli

    _arm(kill_after, trace)
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["gc", f"{root}/disk", "--keep-last", "2", "--memory-root", f"{root}/shm"])
