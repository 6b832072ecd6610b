"""A training-like process for the memory tier's crash test: restores the newest step (memory
tier, then disk), then saves every step into the memory tier (every ``PERSIST_EVERY``-th
persisted to disk in the background) until SIGKILLed. It records its phase and the newest step
whose save was acknowledged (``SaveHandle.result`` returned) into shared values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _ckpt_crash_worker
import numpy as np
import torch

PAUSES = "stage:0.01,write:0.02,fsync:0.02,rename:0.02,latest:0.02,retention:0.02,persist:0.03"
KEEP = 2
PERSIST_EVERY = 3


def expected(step: int) -> dict[str, Any]:
    """The state a run saves at ``step`` (a pure function of the step)."""
    gen = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(200_000, generator=gen),
        "arr": np.full(5000, step, dtype=np.int64),
        "meta": {"step": step},
    }


def options(root: Path) -> Any:
    """The memory tier options of the run (the harness's reader uses the same)."""
    from ckpt.tiers.memory_options import MemoryOptions

    return MemoryOptions(root=root / "shm", keep=KEEP, persist_every=PERSIST_EVERY)


def run(root: str, phase: Any, acked: Any, kill_after: int) -> None:
    """The process body: ``phase`` is a shared char array, ``acked`` a shared int (-1: none);
    ``kill_after`` > 0 SIGKILLs the process after that many filesystem operations."""
    from ckpt.manager import CheckpointManager, WriteOptions

    os.environ["CKPT_TEST_PAUSE"] = PAUSES
    if kill_after:
        os.environ["CKPT_TEST_KILL_AFTER"] = str(kill_after)
    mark = _ckpt_crash_worker.trace_phases(phase)
    manager = CheckpointManager(
        Path(root) / "disk",
        keep_last=KEEP,
        write=WriteOptions(chunk_bytes=128 << 10),
        memory=options(Path(root)),
    )
    mark("restore")  # the first mark tells the harness we are running
    step = manager.restore()["meta"]["step"] + 1 if manager.steps() else 0
    while True:
        mark("save")
        manager.save(step, expected(step)).result(60)
        acked.value = step
        if step % 4 == 3:  # a restore in the middle of a run: kills land inside it too
            mark("restore")
            manager.restore()
        mark("train")
        step += 1
