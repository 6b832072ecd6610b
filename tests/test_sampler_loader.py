"""feedpipe.DistributedSampler through feedpipe.DataLoader: the loader's state resumes the sampler.

The loader prefetches (so the sampler runs ahead) and writes the samples it actually delivered
into the sampler state's ``consumed``; resuming that state at the same or another world size
must neither lose nor repeat a sample. Ranks are simulated in-process here; the arithmetic is
the same on real ranks (tests/test_sampler_dist.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import feedpipe
from feedpipe import DistributedSampler

N = 503


def _rank_loader(world: int, rank: int, batch: int, opts: dict[str, Any]) -> Any:
    data = list(range(N))
    sampler = DistributedSampler(data, world, rank, seed=11, batch_size=batch, **opts)
    return feedpipe.DataLoader(
        data,
        batch_size=batch,
        sampler=sampler,
        num_workers=2,
        worker_type="thread",
        prefetch_factor=4,
    )


@pytest.mark.parametrize(
    "old,new,steps,batch,opts",
    [
        (4, 4, 7, 8, {}),
        (4, 3, 5, 8, {"pad": False}),
        (2, 5, 11, 6, {"pad": False, "equal_batches": True}),
        (3, 2, 4, 5, {"pad": False, "shuffle_mode": "block", "block_size": 16}),
    ],
)
def test_loader_state_resumes_sampler(
    old: int, new: int, steps: int, batch: int, opts: dict[str, Any]
) -> None:
    taken: list[list[int]] = []
    full: list[list[int]] = []
    states = []
    for rank in range(old):
        loader = _rank_loader(old, rank, batch, opts)
        loader.sampler.set_epoch(1)
        it = iter(loader)
        taken.append([i for _ in range(steps) for i in next(it).tolist()])
        ahead = loader.sampler.state_dict()["consumed"]
        state = json.loads(json.dumps(loader.state_dict()))
        assert ahead > steps * batch  # the workers prefetched: the sampler's own count ran ahead
        assert state["sampler"]["consumed"] == steps * batch  # delivered, not prefetched
        states.append(state)
        del it
        ref = _rank_loader(old, rank, batch, opts)
        ref.sampler.set_epoch(1)
        full.append([i for b in ref for i in b.tolist()])
    resumed = []
    for rank in range(new):
        loader = _rank_loader(new, rank, batch, opts)
        loader.load_state_dict(states[-1])  # the last rank's state resumes everyone
        loader.sampler.set_epoch(1)
        resumed.append([i for b in loader for i in b.tolist()])
        loader.sampler.set_epoch(2)  # and the next epoch is a whole one
        assert sum(len(b) for b in loader) == len(loader.sampler)
    if old == new:
        assert [t + r for t, r in zip(taken, resumed, strict=True)] == full
        return
    consumed = {i for t in taken for i in t}
    flat = [i for r in resumed for i in r]
    assert not set(flat) & consumed
    rest = set(range(N)) - consumed
    if opts.get("equal_batches"):
        assert set(flat) <= rest and len(rest) - len(set(flat)) < new
        assert len({-(-len(r) // batch) for r in resumed}) == 1
    else:
        assert set(flat) == rest
    if not opts.get("pad", True):
        assert len(flat) == len(set(flat))
