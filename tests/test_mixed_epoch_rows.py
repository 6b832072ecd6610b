"""The one-gather read of fixed members looks a batch's rows up in tables of the epoch's
positions (``_mixed_take._Spans.read``, ``EpochLayout.derived``): made per epoch and per set of
member maps, so mixes sharing members, epochs read alternately, members reopened after
``close()`` and members of one shard each checked all at once (or, past ``ENTER_ALL_MAX``, only
those touched) all give the per-sample reference. Typed members' rows, copied in one gather over
their maps held at once or map by map (past ``HELD_MAX``), give it too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _mix_reference import reference

import feedpipe.datasets._mixed_columns as columns_module
import feedpipe.datasets._mixed_take as take_module
from feedpipe import MemmapDataset, MemmapWriter, MixedDataset

SIZES = {"web": 70, "code": 9, "books": 20}
TOTAL = 90


def _members(tmp: Path, shard_bytes: int) -> dict[str, MemmapDataset]:
    out = {}
    for k, (name, n) in enumerate(SIZES.items()):
        x = (1000 * (k + 1) + np.arange(n, dtype=np.int32))[:, None] * np.ones((1, 4), np.int32)
        with MemmapWriter(tmp / name, shape=(4,), dtype="int32", shard_bytes=shard_bytes) as w:
            w.append_batch(x)
        out[name] = MemmapDataset(tmp / name)
    return out


def _check(
    ds: MixedDataset,
    members: dict[str, MemmapDataset],
    weights: dict[str, float],
    seed: int,
    batch: np.ndarray,
) -> None:
    want = reference(SIZES, weights, seed, ds.epoch, TOTAL)
    rows = [members[name][s] for name, s in (want[i] for i in batch)]
    assert torch.equal(ds.read_batch(batch), torch.stack(rows))


@pytest.mark.parametrize("shard_bytes", [1 << 20, 320])  # one shard each, several
@pytest.mark.parametrize("enter_all", [8, 0])
def test_mixes_sharing_members_read_alternately_give_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_bytes: int, enter_all: int
) -> None:
    monkeypatch.setattr(take_module, "ENTER_ALL_MAX", enter_all)
    members = _members(tmp_path, shard_bytes)
    w1 = {"web": 0.6, "code": 0.25, "books": 0.15}
    w2 = {"web": 0.2, "code": 0.5, "books": 0.3}
    one = MixedDataset(members, weights=w1, seed=1, epoch_samples=TOTAL)
    two = MixedDataset(members, weights=w2, seed=2, epoch_samples=TOTAL)
    rng = np.random.default_rng(0)
    for epoch in (0, 1, 0, 5):
        one.set_epoch(epoch)
        two.set_epoch(epoch + 1)
        for _ in range(3):
            for ds, weights, seed in ((one, w1, 1), (two, w2, 2)):
                _check(ds, members, weights, seed, rng.permutation(TOTAL)[:17])
                _check(ds, members, weights, seed, np.array([3, 80, 3], np.int64))
    for member in members.values():
        member.close()  # reopened on the next read: other maps, other tables
    _check(one, members, w1, 1, np.arange(TOTAL))
    _check(two, members, w2, 2, rng.permutation(TOTAL))


def _typed(tmp: Path, shard_bytes: int) -> dict[str, MemmapDataset]:
    out = {}
    fields = {"tokens": ("int32", (None,)), "text": "str", "label": "int64"}
    for k, (name, n) in enumerate(SIZES.items()):
        base = 1000 * (k + 1)
        with MemmapWriter(tmp / name, records=False, fields=fields, shard_bytes=shard_bytes) as w:
            for i in range(n):
                tokens = base + np.arange(i % 7, dtype=np.int32)
                w.append(tokens=tokens, text=f"{base}:{i}" * (i % 3), label=base + i)
        out[name] = MemmapDataset(tmp / name, pad_value=-1, ragged="nested")
    return out


@pytest.mark.parametrize("shard_bytes", [1 << 20, 96])  # one shard each, many
@pytest.mark.parametrize("held", [64, 1, 0])  # one gather over the maps held, or one per map
def test_typed_rows_copied_at_once_or_map_by_map_give_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_bytes: int, held: int
) -> None:
    monkeypatch.setattr(columns_module, "HELD_MAX", held)
    members = _typed(tmp_path, shard_bytes)
    weights = {"web": 0.6, "code": 0.25, "books": 0.15}
    ds = MixedDataset(members, weights=weights, seed=3, epoch_samples=TOTAL)
    rng = np.random.default_rng(1)
    for epoch in (0, 2):
        ds.set_epoch(epoch)
        want = reference(SIZES, weights, 3, epoch, TOTAL)
        for batch in (rng.permutation(TOTAL)[:33], np.arange(TOTAL), np.array([5, 5, 89])):
            got = ds.read_batch(batch)
            samples = [members[name][s] for name, s in (want[i] for i in batch)]
            assert got["text"] == [s["text"] for s in samples]
            assert got["label"].tolist() == [int(s["label"]) for s in samples]
            rows = got["tokens"].unbind()
            assert all(torch.equal(r, s["tokens"]) for r, s in zip(rows, samples, strict=True))
