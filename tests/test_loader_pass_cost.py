"""What a pass no longer pays for, without a change of behaviour (issue 28: ~400 us a pass).

- an epoch's RNG states are copied raw at the sampler's first draw and encoded only when
  ``state_dict()`` writes them (``rng_state.RngStates``): the state is still that of the epoch's
  start, not of the moment it is written;
- the dataset's runtime-protocol checks are made once, by the plan; its ``takes_index_arrays``
  is still read at every pass.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from feedpipe import DataLoader
from feedpipe.loader.rng_state import RngChain, RngStates, encode


def _ints(n: int) -> list[torch.Tensor]:
    return [torch.tensor([i]) for i in range(n)]


def test_captured_states_encode_as_they_were_at_the_capture() -> None:
    gen = torch.Generator().manual_seed(3)
    sampler = torch.utils.data.RandomSampler(range(10), generator=torch.Generator().manual_seed(5))
    loader = DataLoader(_ints(10), batch_size=2, sampler=sampler, generator=gen)
    chain = RngChain.of(loader)
    before = {name: encode(g) for name, g in chain.generators.items()}
    states = RngStates.capture(chain)
    torch.randn(4, generator=gen)  # every RNG moves on after the capture
    torch.randn(4, generator=sampler.generator)
    assert set(before) == {"loader", "sampler"}
    assert states.text() == before
    assert states.text() is states.text()  # encoded once
    states.put("sampler", "lent")
    assert states.text() == {**before, "sampler": "lent"}
    unseeded = RngChain.of(DataLoader(_ints(10), batch_size=2, shuffle=True))
    start, states = encode(None), RngStates.capture(unseeded)
    torch.randn(4)  # the global RNG moves on
    assert states.text() == {"loader": start}


def test_state_dict_holds_the_epoch_start_not_the_moment_it_is_written() -> None:
    """The raw copy is taken before the sampler draws; encoding it later changes nothing."""
    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(_ints(12), batch_size=3, shuffle=True, generator=gen)
    for _ in range(2):  # the second pass too (a fresh capture per pass)
        it = iter(loader)  # draws the workers' base seed
        start = encode(gen)  # the state the sampler's first draw starts from
        first = next(it)
        assert encode(gen) != start  # the epoch drew from it
        state = loader.state_dict()
        assert state["rng"] == {"loader": start} and state["in_epoch"]
        json.dumps(state)
        rest = list(it)
        again = DataLoader(_ints(12), batch_size=3, shuffle=True, generator=torch.Generator())
        again.load_state_dict(json.loads(json.dumps(state)))
        assert [b.tolist() for b in again] == [b.tolist() for b in rest]
        assert len(rest) == 3 and first.numel() == 3


def test_global_rng_epoch_start_is_saved_as_it_was() -> None:
    torch.manual_seed(11)
    loader = DataLoader(_ints(8), batch_size=2, shuffle=True)
    it = iter(loader)
    start = encode(None)
    next(it)
    torch.randn(3)  # the user's own draws after the sampler's
    assert loader.state_dict()["rng"] == {"loader": start}
    del it


class _Arrays(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A ``read_batch`` dataset whose ``takes_index_arrays`` a test flips between passes."""

    def __init__(self) -> None:
        self.takes_index_arrays = True
        self.seen: list[type] = []

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i])

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        self.seen.append(type(indices))
        return torch.as_tensor(np.asarray(indices)).view(-1, 1)


def test_protocols_are_checked_once_and_takes_index_arrays_each_pass() -> None:
    ds = _Arrays()
    loader = DataLoader(ds, batch_size=3, num_workers=0)
    assert loader.plan.index_arrays and not loader.plan.plans_access
    assert [b.tolist() for b in loader] == [[[0], [1], [2]], [[3], [4], [5]]]
    assert set(ds.seen) == {np.ndarray}
    ds.seen.clear()
    ds.takes_index_arrays = False  # read at the next iter(): lists again
    assert len(list(loader)) == 2 and set(ds.seen) == {list}
    plain = DataLoader(_ints(4), batch_size=2)
    assert not plain.plan.index_arrays and not plain.plan.plans_access


def test_a_copy_or_pickle_mid_epoch_writes_the_same_state() -> None:
    """The raw states travel with the loader's epoch (``__getstate__`` keeps it)."""
    import copy
    import pickle

    loader = DataLoader(_ints(10), batch_size=2, shuffle=True, generator=torch.Generator())
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    for twin in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert twin.state_dict() == state
    del it
