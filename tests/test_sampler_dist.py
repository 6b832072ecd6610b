"""feedpipe.DistributedSampler on real torch.distributed gloo process groups (spawned ranks).

One 8-rank job runs every scenario (process start-up dominates the cost): rank and world size
read from the default process group, torch equality, coverage, equal batch counts with a real
collective per batch, and elastic resume from N to M ranks through sub-groups, with the saved
state sent from one rank to all by ``broadcast_object_list``. The parent process checks results.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from _dist import run_ranks

WORLD = 8
N = 997  # a prime: no world size divides it


def _elastic_cases(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    pairs = [(8, 3), (3, 8), (5, 2), (2, 7), (4, 4), (6, 6), (7, 1), (1, 5)]
    options = [
        {"pad": False},
        {},
        {"pad": False, "equal_batches": True},
        {"drop_last": True},
        {"pad": False, "shuffle_mode": "block", "block_size": 32},
    ]
    cases = []
    for i, (old, new) in enumerate(pairs):
        batch = rng.randint(1, 8)
        opts = {**options[i % len(options)], "batch_size": batch}
        max_steps = math.ceil(math.ceil(N / old) / batch)
        steps = rng.randint(0, max_steps)
        cases.append(
            {"old": old, "new": new, "steps": steps, "opts": opts, "seed": rng.randint(0, 99)}
        )
    return cases


def _worker(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.utils.data

    from feedpipe import DistributedSampler

    out: dict[str, Any] = {}
    data = range(N)
    # rank and world size come from the default process group; indices equal torch's
    same = []
    for seed, epoch, drop_last in ((0, 0, False), (7, 3, True), (123, 1, False)):
        ours = DistributedSampler(data, seed=seed, drop_last=drop_last)
        ref = torch.utils.data.DistributedSampler(data, seed=seed, drop_last=drop_last)
        ours.set_epoch(epoch)
        ref.set_epoch(epoch)
        same.append((ours.rank, ours.num_replicas, list(ours) == list(ref)))
    out["torch"] = same

    # pad=False: this rank's share, for the coverage check
    s = DistributedSampler(data, pad=False, seed=5)
    s.set_epoch(2)
    out["no_pad"] = list(s)

    # equal_batches: one all_reduce per batch; unequal counts would hang (the timeout would fire)
    batch = 31  # 997 // 8 = 124 = 4 * 31: without dropping, rank 0..4 would need a 5th batch
    s = DistributedSampler(data, pad=False, equal_batches=True, batch_size=batch)
    indices = list(s)
    steps = 0
    for start in range(0, len(indices), batch):
        t = torch.tensor([len(indices[start : start + batch])])
        dist.all_reduce(t)
        steps += 1
    out["equal_batches"] = (steps, indices)

    # elastic resume N -> M through sub-groups
    groups = {k: dist.new_group(list(range(k))) for k in range(1, world + 1)}
    results = []
    for case in cases:
        old, new, opts = case["old"], case["new"], case["opts"]
        steps, batch = case["steps"], opts["batch_size"]
        taken: list[int] | None = None
        state: list[Any] = [None]
        saver = case["seed"] % old
        if -(-len(DistributedSampler(data, old, saver, **opts)) // batch) < steps:
            saver = 0  # that rank ran out of batches first (not lockstep): rank 0's state is right
        if rank < old:
            s = DistributedSampler(data, old, rank, seed=case["seed"], **opts)
            s.set_epoch(1)
            full = list(s)  # the loader prefetches: the sampler runs ahead
            used = min(steps * batch, len(full))
            taken = full[:used]
            st = s.state_dict()
            st["consumed"] = used  # what the loader delivered
            state = [st]
        dist.broadcast_object_list(state, src=saver)  # one rank's state resumes every rank
        resumed = reference = None
        if rank < new:
            s = DistributedSampler(data, new, rank, seed=case["seed"], **opts)
            s.load_state_dict(state[0])
            s.set_epoch(1)
            resumed = list(s)
            if new == old:
                ref_s = DistributedSampler(data, new, rank, seed=case["seed"], **opts)
                ref_s.set_epoch(1)
                reference = list(ref_s)
        dist.barrier(groups[world])
        results.append({"taken": taken, "resumed": resumed, "reference": reference})
    out["elastic"] = results
    return out


@pytest.fixture(scope="module")
def job() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cases = _elastic_cases(seed=2026)
    return cases, run_ranks(_worker, WORLD, cases, timeout=120)


def test_defaults_from_process_group_equal_torch(job: Any) -> None:
    _, outs = job
    for rank, out in enumerate(outs):
        for got_rank, got_world, same in out["torch"]:
            assert (got_rank, got_world) == (rank, WORLD)
            assert same


def test_no_pad_exact_coverage(job: Any) -> None:
    _, outs = job
    flat = [i for out in outs for i in out["no_pad"]]
    assert sorted(flat) == list(range(N))
    lens = [len(out["no_pad"]) for out in outs]
    assert max(lens) - min(lens) == 1


def test_equal_batches_across_ranks(job: Any) -> None:
    _, outs = job
    steps = {out["equal_batches"][0] for out in outs}
    assert steps == {4}
    flat = [i for out in outs for i in out["equal_batches"][1]]
    assert len(flat) == len(set(flat)) == N - N % WORLD


def test_elastic_resume(job: Any) -> None:
    cases, outs = job
    for c, case in enumerate(cases):
        old, new, opts = case["old"], case["new"], case["opts"]
        res = [out["elastic"][c] for out in outs]
        taken = Counter(i for r in res[:old] for i in r["taken"])
        resumed = [r["resumed"] for r in res[:new]]
        flat = [i for r in resumed for i in r]
        where = f"case {case}"
        if old == new:  # exact continuation of the uninterrupted run
            for r in res[:new]:
                assert r["taken"] + r["resumed"] == r["reference"], where
            continue
        rest = set(range(N)) - set(taken)
        assert not set(flat) & set(taken), f"{where}: a consumed sample was repeated"
        if opts.get("drop_last") or opts.get("equal_batches"):
            assert set(flat) <= rest and len(rest) - len(set(flat)) < new, where
        else:
            assert set(flat) == rest, where
        if opts.get("pad", True):
            assert len({len(r) for r in resumed}) == 1, where
        else:
            assert len(flat) == len(set(flat)), where
        if opts.get("equal_batches"):
            b = opts["batch_size"]
            assert len({-(-len(r) // b) for r in resumed}) == 1, where


def _fail_on_rank_1(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever for rank 1: the helper must not hang


def test_helper_reports_a_failing_rank_and_does_not_hang() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed:[\s\S]*boom on purpose"):
        run_ranks(_fail_on_rank_1, 2, timeout=60)
