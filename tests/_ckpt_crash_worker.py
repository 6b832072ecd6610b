"""A training-like process for the ckpt crash tests: restores the newest checkpoint, then saves
step after step forever (until SIGKILLed), recording the phase it is in into a shared array."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

PAUSES = "stage:0.01,write:0.03,fsync:0.03,rename:0.02,latest:0.02,retention:0.02"
KEEP_LAST = 2


def expected(step: int) -> dict[str, Any]:
    """The state a run saves at ``step`` (a pure function of the step)."""
    gen = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(300_000, generator=gen),
        "b": torch.full((1000, 64), float(step), dtype=torch.bfloat16),
        "arr": np.full(5000, step, dtype=np.int64),
        "meta": {"step": step, "name": f"step{step}", "lr": 0.1 / (step + 1)},
    }


def trace_phases(phase: Any) -> Any:
    """Record each fault-injection point ckpt passes into ``phase`` (a shared char array);
    returns the function that records a phase name of the caller's own."""
    from ckpt import _faults

    original = _faults.pause

    def mark(name: str) -> None:
        phase.value = name.encode()[:15]

    def traced(point: str) -> None:
        mark(point)
        original(point)

    _faults.pause = traced
    return mark


def run(directory: str, phase: Any) -> None:
    """The process body; ``phase`` is a shared char array holding the current phase name."""
    from ckpt.manager import CheckpointManager, WriteOptions

    os.environ["CKPT_TEST_PAUSE"] = PAUSES
    mark = trace_phases(phase)
    manager = CheckpointManager(
        directory, keep_last=KEEP_LAST, write=WriteOptions(chunk_bytes=256 << 10)
    )
    mark("restore")  # the first mark tells the harness we are running
    step = 0
    if manager.steps():
        step = manager.restore()["meta"]["step"] + 1
    while True:
        mark("save")
        manager.save(step, expected(step))
        mark("train")
        step += 1
