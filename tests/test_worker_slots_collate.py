"""Worker slots (feedpipe.loader.slots) collate as torch's ``default_collate`` does: empty
containers, numpy leaves torch refuses, views and in-place ops keep their slot, and a batch
shared through a queue is never overwritten."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import default_collate

from feedpipe import DataLoader
from feedpipe.loader import slots as slots_mod


# ------------------------------------------------------------------------------ worker slots
class Empty(tud.Dataset):  # type: ignore[type-arg]
    """Samples that are empty containers (e.g. "no boxes" as an empty list, no extras)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return {"boxes": [], "extra": {}}


@pytest.mark.parametrize("sample", [[], {}, (), {"a": [], "b": ()}])
def test_empty_containers_collate_like_torch(sample: Any) -> None:
    """Found: a batch whose samples hold no leaves at all crashed ``Slots.resolve`` with an
    IndexError in the training process (and sized the worker's slots at 0 bytes)."""
    samples = [sample, sample]
    ref = slots_mod.collate_into(samples, 4, 2)
    got = default_collate(samples) if ref is None else slots_mod.Slots(False).resolve(ref)[0]
    assert got == default_collate(samples)
    assert slots_mod.worker_slots() is None  # no zero-byte slots were laid out


def test_loader_with_empty_container_samples_matches_torch() -> None:
    kw: dict[str, Any] = {"batch_size": 4, "num_workers": 1}
    assert list(DataLoader(Empty(), **kw)) == list(tud.DataLoader(Empty(), **kw))


def _neg_strides() -> list[Any]:
    return [np.arange(6)[::-2], np.arange(6)[::-2]]


def _odd_strides() -> list[Any]:
    rec = np.zeros(4, dtype=[("a", np.int32), ("b", np.int8)])
    return [rec["a"], rec["a"]]


@pytest.mark.parametrize(
    "make",
    [
        _neg_strides,
        _odd_strides,
        lambda: [np.uint64(3), np.uint64(4)],
        lambda: [np.ones(2, np.longdouble)] * 2,
    ],
    ids=["negative strides", "strides not a multiple of itemsize", "np.uint64", "longdouble"],
)
def test_numpy_leaves_torch_refuses_go_torchs_way(make: Any) -> None:
    """Found: the slots stacked what ``default_collate`` refuses (negative strides, np.uint64
    scalars), so one dataset gave a batch from a slot but torch's error whenever no slot was
    free; a longdouble raised from ``collate_into`` outside the collate stage's error handling."""
    samples = make()
    with pytest.raises((TypeError, ValueError)):
        default_collate(samples)
    assert slots_mod.collate_into(samples, 4, 2) is None


class Rows(tud.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64) -> None:
        self.data = np.arange(n * 4, dtype=np.float32).reshape(n, 4)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return {"x": self.data[i], "i": i}


def test_numpy_of_a_batch_shared_through_a_queue_is_never_overwritten() -> None:
    loader = DataLoader(Rows(), batch_size=8, num_workers=2)
    kept = []
    for batch in loader:
        arr = batch["x"].numpy()
        batch["x"].share_memory_()  # torch.multiprocessing.Queue.put does this
        kept.append((arr, arr.copy()))
        del batch
    assert all(np.array_equal(a, snap) for a, snap in kept)


def test_slices_and_in_place_ops_keep_their_slot() -> None:
    """Guard: a slice kept after its batch is dropped, and in-place writes to a batch."""
    ds = Rows()
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    kept = []
    for batch in loader:
        batch["x"].mul_(2)
        kept.append((batch["i"][2:5], batch["x"][2:5].numpy()[:, 1:]))
        del batch
    for idx, x in kept:
        assert np.array_equal(x, ds.data[idx.numpy()][:, 1:] * 2)
    assert loader.worker_slots["batches_in_slots"] > 0


def test_an_older_iterator_keeps_working_after_a_new_pass_starts() -> None:
    """Found: ``iter(loader)`` while an older iterator of the same (non-persistent) loader was
    still in use dropped the older workers' buffers; its next batch raised "worker slot buffer
    ... was never received". torch allows several live iterators."""
    ds = Rows(128)
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    it1 = iter(loader)
    got = [next(it1)["i"].clone() for _ in range(6)]  # the workers have seen their buffers
    it2 = iter(loader)
    got2 = [next(it2)["i"].clone()]
    got += [b["i"].clone() for b in it1]
    got2 += [b["i"].clone() for b in it2]
    for batches in (got, got2):
        assert torch.equal(torch.cat(batches), torch.arange(128))


def test_worker_slots_reports_on_or_off_before_and_after_the_first_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found: ``loader.worker_slots`` was None before the first pass even when slots were on,
    so a check like ``DataLoader(..., collate_fn=f).worker_slots is None`` proved nothing."""
    on = DataLoader(Rows(16), batch_size=4, num_workers=1)
    assert on.worker_slots is not None and on.worker_slots["batches_in_slots"] == 0
    off = [
        DataLoader(Rows(16), batch_size=4, num_workers=1, collate_fn=_first),
        DataLoader(Rows(16), batch_size=4, num_workers=2, worker_type="thread"),
    ]
    for loader in off:
        assert loader.worker_slots is None
        assert len(list(loader)) == 4 and loader.worker_slots is None
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", "0")
    assert on.worker_slots is None


def _first(batch: list[Any]) -> Any:
    return batch[0]
