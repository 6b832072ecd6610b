"""A process for the kill-between-every-operation harness: re-saves a step that exists (and saves
one more, so retention evicts), or re-saves a ``ckpt.save`` path, under the fault environment
that SIGKILLs it right after its k-th filesystem operation."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def state(step: int, tag: str) -> dict:
    """What a run saves at ``step``; ``tag`` tells an old copy from a new one."""
    value = float(step) + (0.5 if tag == "new" else 0.0)
    return {
        "w": torch.full((4096,), value),
        "b": torch.arange(100) + step,
        "tag": tag,
        "step": step,
    }


def run(  # noqa: PLR0917 - multiprocessing passes positional args
    root: str, mode: str, kill_after: int, no_exchange: bool, trace: str, steps: int
) -> None:
    """The process body (``mode``: ``manager``, ``simple`` or ``dcp``)."""
    os.environ["CKPT_TEST_KILL_AFTER"] = str(kill_after)
    os.environ["CKPT_TEST_OP_TRACE"] = trace
    if no_exchange:
        os.environ["CKPT_TEST_NO_EXCHANGE"] = "1"
    if mode == "dcp":
        import warnings

        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", "torch.distributed is disabled")

        from ckpt.dcp import CkptStorageWriter

        for _ in range(steps):
            dcp.save(state(5, "new"), storage_writer=CkptStorageWriter(root, 5), no_dist=True)
        return
    if mode == "simple":
        import ckpt

        for _ in range(steps):
            ckpt.save(Path(root) / "model", state(5, "new"))
        return
    from ckpt.manager import CheckpointManager

    with CheckpointManager(root, keep_last=2) as manager:
        for i in range(steps):  # re-save 5, then 6 (evicts 4), 7 (evicts 5) ...
            manager.save(5 + i, state(5 + i, "new")).result(30)
