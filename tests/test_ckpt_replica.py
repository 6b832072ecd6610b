"""The peer replica (``MemoryOptions(replica=True)``, ``ckpt.tiers.replica``) with real gloo
processes, each given its own directory as its node-local memory: after a rank is SIGKILLed and
its whole directory (memory tier and disk) deleted, a new set of processes restores every rank's
newest step, the lost one from its left neighbour's replica, verified."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.tiers.memory_options import MemoryOptions, tier_dir

WORLD = 3
LOST = 1


def _state(rank: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(10_000, generator=gen), "rank": rank, "step": step}


def _manager(root: Path, rank: int) -> CheckpointManager:
    node = root / f"node{rank}"
    opts = MemoryOptions(root=node / "shm", keep=1, persist_every=100, replica=True)
    return CheckpointManager(node / "disk", memory=opts)


def _train(rank: int, world: int, root: Path) -> int:
    import torch.distributed as dist

    m = _manager(root, rank)
    for step in range(1, 5):
        m.save(step, _state(rank, step)).result(60)
    dist.barrier()
    if rank == LOST:
        os.kill(os.getpid(), signal.SIGKILL)  # the node is lost: no close, no persist
    return 0  # the others exit without close() too: their tiers stay, as after a crash


def _restore(rank: int, world: int, root: Path) -> tuple[int, str, bool]:
    m = _manager(root, rank)
    state = m.restore()  # collective with replica=True
    assert m.stats.last_restore is not None
    ok = torch.equal(state["w"], _state(rank, state["step"])["w"]) and state["rank"] == rank
    where = str(m.stats.last_restore.path)
    m.save(5, _state(rank, 5)).result(60)  # training goes on (the replica exchange too)
    m.close()  # a clean end: persisted to disk, tier and replica freed
    return state["step"], where, ok


def test_a_lost_node_restores_from_its_peer_replica(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=rf"ranks \[{LOST}\].*{LOST}: -9"):
        run_ranks(_train, WORLD, tmp_path, timeout=60)
    lost = tmp_path / f"node{LOST}"
    peer = tier_dir(tmp_path / f"node{LOST - 1}" / "disk", lost.parent / f"node{LOST - 1}" / "shm")
    assert (peer.with_name(peer.name + "-peer") / "step-4").is_dir()  # rank 0 holds rank 1's
    for path in sorted(lost.rglob("*"), reverse=True):  # the node and its memory are gone
        path.rmdir() if path.is_dir() else path.unlink()
    results = run_ranks(_restore, WORLD, tmp_path, timeout=60)
    for rank, (step, where, ok) in enumerate(results):
        assert step == 4 and ok, (rank, step, where)
        assert where.startswith(str(tmp_path / f"node{rank}" / "shm")), where
    for rank in range(WORLD):
        node = tmp_path / f"node{rank}"
        assert sorted(os.listdir(node / "shm")) == [], rank  # tier and replica freed at close
        assert (node / "disk" / "step-5").is_dir()


def test_replica_needs_torch_distributed(tmp_path: Path) -> None:
    opts = MemoryOptions(root=tmp_path / "shm", replica=True)
    with pytest.raises(CheckpointError, match="init_process_group"):
        CheckpointManager(tmp_path / "d", memory=opts)
