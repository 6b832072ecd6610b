"""Worker slots turned on and off (``FEEDPIPE_WORKER_SLOTS``) and grown: the slots grow at the
next safe point, a bounded number of times, never share bytes with their flags, and batches
that grow, shrink or change shape equal torch's."""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import Squares as _Squares

import feedpipe


def _slot_loader() -> feedpipe.DataLoader:
    return feedpipe.DataLoader(_Squares(), batch_size=4, num_workers=2)


@pytest.mark.parametrize("word", ["0", "false", "No", "OFF", " off "])
def test_worker_slots_off_words(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", word)
    assert _slot_loader().worker_slots is None


@pytest.mark.parametrize("word", ["1", "true", "Yes", "ON"])
def test_worker_slots_on_words(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", word)
    info = _slot_loader().worker_slots
    assert info is not None and info["slots_per_worker"] > 0


@pytest.mark.parametrize("word", ["", "2", "disable", "of", "nope"])
def test_worker_slots_refuses_other_values(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", word)
    loader = _slot_loader()
    with pytest.raises(ValueError, match=f"FEEDPIPE_WORKER_SLOTS={word!r}"):
        iter(loader)


@pytest.fixture
def _fresh_worker_slots() -> Any:
    from feedpipe.loader import slots as slots_mod

    slots_mod._WORKER.clear()
    yield slots_mod
    slots_mod._WORKER.clear()


def _rows(n: int, start: int = 0) -> list[torch.Tensor]:
    return [torch.full((64,), float(start + i)) for i in range(n)]


def _received(ref: Any) -> Any:
    assert ref is not None
    ref.received = True  # as if it had come through the queue
    return ref


def test_slots_grow_at_the_next_safe_point(_fresh_worker_slots: Any) -> None:
    """A batch larger than the slots goes torch's way while the old buffer has a slot taken;
    the next batch after every slot is free gets a larger buffer, and the main process drops
    the old one."""
    mod = _fresh_worker_slots
    main = mod.Slots(pin=False)
    first, _ = main.resolve(_received(mod.collate_into(_rows(1), k=3, rows=None)))
    old = mod.worker_slots()
    assert mod.collate_into(_rows(8), k=3, rows=None) is None  # slot 0 still viewed: no growth
    assert mod.worker_slots() is old and old.wanted > old.slot_bytes
    del first  # the last view goes: the old buffer is idle
    gc.collect()
    # a small batch at the safe point: the buffer grows anyway, for the big batches to come
    small, _ = main.resolve(_received(mod.collate_into(_rows(1, 5), k=3, rows=None)))
    new = mod.worker_slots()
    assert new is not old and new.slot_bytes >= 8 * 64 * 4 and new.grown == 1
    assert list(main.buffers) == [new.token]  # the old buffer was dropped
    big, _ = main.resolve(_received(mod.collate_into(_rows(8, 10), k=3, rows=None)))
    assert torch.equal(big, torch.stack(_rows(8, 10))) and torch.equal(small[0], _rows(1, 5)[0])
    assert mod.worker_slots() is new


def test_slots_growth_is_bounded(_fresh_worker_slots: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _fresh_worker_slots
    assert mod.MAX_GROWTHS == 8  # docs/concepts/workers.md says so
    monkeypatch.setattr(mod, "MAX_GROWTHS", 1)
    main = mod.Slots(pin=False)
    for n in (1, 4, 16, 16):
        ref = mod.collate_into(_rows(n), k=2, rows=None)
        if n < 16:
            batch, _ = main.resolve(_received(ref))
            del batch
            gc.collect()
        else:  # one growth (to 4 rows) was allowed: 16 rows go torch's way, every time
            assert ref is None
    assert mod.worker_slots().grown == 1


class _Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256,), float(i))


def test_custom_batch_sampler_with_a_small_first_batch_uses_slots(
    _fresh_worker_slots: Any,
) -> None:
    """The first batch has 1 row, every later one 8: later batches use slots after growing."""
    batches = [[0], *[list(range(1 + 8 * b, 9 + 8 * b)) for b in range(30)]]
    loader = feedpipe.DataLoader(_Rows(), batch_sampler=batches, num_workers=1)
    for want, got in zip(batches, loader, strict=True):
        assert got[:, 0].tolist() == [float(i) for i in want]
        del got
    info = loader.worker_slots
    assert info is not None
    # torch's prefetch lets a few large batches start before the first one's view is gone
    assert info["batches_fallback"] <= 4, info
    assert info["batches_in_slots"] == len(batches) - info["batches_fallback"]


# ---------------------------------------------------------------------- 3: worker slots
@pytest.fixture
def fresh_slots() -> Any:
    from feedpipe.loader import slots as slots_mod

    slots_mod._WORKER.clear()
    yield slots_mod
    slots_mod._WORKER.clear()


@pytest.mark.parametrize("k", [4095, 4096, 4200])
def test_many_slots_never_share_bytes_with_the_flags(fresh_slots: Any, k: int) -> None:
    """``prefetch_factor + 2`` slots: with 4094 or more, the flags and the seen byte ran into
    slot 0, and the main process marking the buffer seen overwrote the batch's first bytes."""
    mod = fresh_slots
    main = mod.Slots(pin=False)
    held = []
    for b in range(3):
        ref = mod.collate_into([torch.zeros(4, dtype=torch.int64)] * 8, k=k, rows=None)
        assert ref is not None
        ref.received = True
        batch, _ = main.resolve(ref)
        held.append(batch)
        assert not any(h.any() for h in held), (b, held)


def test_loader_with_a_huge_prefetch_factor_delivers_torchs_batches() -> None:
    data = [torch.zeros(4, dtype=torch.int64) for _ in range(32)]
    loader = feedpipe.DataLoader(data, batch_size=8, num_workers=1, worker_type="process",
                                 prefetch_factor=4095)  # fmt: skip
    assert [b.tolist() for b in loader] == [[[0] * 4] * 8] * 4
    assert loader.worker_slots is not None and loader.worker_slots["batches_in_slots"] == 4


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_eq, a, b))
    return bool(a == b)


_SIZES = [1, 2, 40, 3, 100, 1, 120, 5, 2, 200, 1]


_BATCHES = [list(range(sum(_SIZES[:k]), sum(_SIZES[: k + 1]))) for k in range(len(_SIZES))]


_BLOCK = {i: k for k, b in enumerate(_BATCHES) for i in b}


class _Shifting(torch.utils.data.Dataset[Any]):
    """Samples whose shape and dtype change from batch to batch (equal within one)."""

    def __len__(self) -> int:
        return sum(_SIZES)

    def __getitem__(self, i: int) -> Any:
        k = _BLOCK[i]
        dtype = [torch.float32, torch.int64, torch.uint8, torch.float64][k % 4]
        x = torch.full((1 + k % 3, 8), i % 250).to(dtype)
        return {"x": x, "i": i, "a": np.full(3, i, dtype=np.int16)}


def test_batches_that_grow_shrink_and_change_shape_equal_torchs() -> None:
    """Growing and shrinking batches of changing shapes and dtypes, every batch held while
    the slots grow, persistent workers over two epochs and two iterators at once: the batches
    equal torch's, and still do after the pass."""
    ds = _Shifting()
    want = list(torch.utils.data.DataLoader(ds, batch_sampler=_BATCHES, num_workers=0))
    loader = feedpipe.DataLoader(ds, batch_sampler=_BATCHES, num_workers=2,
                                 worker_type="process", persistent_workers=True)  # fmt: skip
    for _ in range(2):
        held = list(loader)
        assert len(held) == len(want) and all(map(_eq, want, held))
        del held
        gc.collect()
    info = loader.worker_slots
    assert info is not None and info["batches_in_slots"] > 0, info
    loader = feedpipe.DataLoader(ds, batch_sampler=_BATCHES, num_workers=2, worker_type="process")
    a, b = [], []
    for x, y in itertools.zip_longest(iter(loader), iter(loader)):
        a.append(x)
        b.append(y)
    assert all(map(_eq, want, a)) and all(map(_eq, want, b)) and len(a) == len(b) == len(want)


class _KillOnce(torch.utils.data.Dataset[torch.Tensor]):
    """SIGKILLs its worker at sample 50 (in the batch after the first big one) once."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return sum(_SIZES)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 50 and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), 9)
        return torch.full((16,), float(i))


def test_worker_killed_while_its_slots_grow_then_a_new_pass(tmp_path: Path) -> None:
    """A process worker dies by SIGKILL while batches grow: the pass fails naming the worker,
    the batches already delivered stay intact, and the next pass equals torch's."""
    from feedpipe.errors import WorkerError

    marker = tmp_path / "killed"
    ds = _KillOnce(marker)
    marker.touch()
    want = list(torch.utils.data.DataLoader(ds, batch_sampler=_BATCHES[:8]))
    marker.unlink()
    loader = feedpipe.DataLoader(ds, batch_sampler=_BATCHES[:8], num_workers=2,
                                 worker_type="process", timeout=30)  # fmt: skip
    got = []
    with pytest.raises(WorkerError, match="died with exit code -9"):
        for batch in loader:
            got.append(batch)
    again = list(loader)
    assert len(again) == len(want) and all(map(torch.equal, want, again))
    assert all(map(torch.equal, want, got))
