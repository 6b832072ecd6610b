"""Attacks on MixedDataset's typed-member read (feedpipe/datasets/_mixed_columns.py): more maps
in a batch than ``HELD_MAX`` (one member of hundreds of shards beside one of one shard), ragged
rows of length 0, members padding with other values, a new epoch, batches of one; then a shard
rewritten in place: every batch equals the per-sample reads, padded, or is refused as the
member's own read is."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets._mixed_columns import HELD_MAX
from feedpipe.errors import DatasetError

FIELDS: dict[str, Any] = {"tokens": ("int32", (None,)), "label": "int64", "text": "str"}
PADS = {"many": -1, "one": -7}


def _write(path: Path, base: int, n: int, shard_bytes: int) -> MemmapDataset:
    """Rows of ``i % 3`` tokens (a third of them empty), a label and a text."""
    with MemmapWriter(path, fields=FIELDS, shard_bytes=shard_bytes, records=False) as w:
        for i in range(n):
            tokens = base + np.arange(i % 3, dtype=np.int32)
            w.append(tokens=tokens, label=base + i, text=f"{base}:{i}")
    return MemmapDataset(path, pad_value=PADS[path.name])


def _check(mix: MixedDataset, idx: np.ndarray) -> None:
    got = mix.read_batch(idx)
    member, _ = mix.locate(idx)
    samples = [mix[int(i)] for i in idx.tolist()]
    assert got["text"] == [s["text"] for s in samples]
    assert got["label"].tolist() == [int(s["label"]) for s in samples]
    lengths = [len(s["tokens"]) for s in samples]
    assert got["tokens_lengths"].tolist() == lengths
    width = max(lengths)
    assert tuple(got["tokens"].shape) == (len(idx), width)
    for j, (s, k) in enumerate(zip(samples, member.tolist(), strict=True)):
        pad = PADS[mix.names[k]]
        row = got["tokens"][j]
        assert torch.equal(row[: lengths[j]], s["tokens"]), j
        assert bool((row[lengths[j] :] == pad).all()), j


def test_more_maps_than_held_max_and_empty_rows(tmp_path: Path) -> None:
    many = _write(tmp_path / "many", 1000, 150, shard_bytes=16)
    one = _write(tmp_path / "one", 2000, 5, shard_bytes=1 << 20)
    shards = len(list((tmp_path / "many").glob("*.label")))
    assert shards > HELD_MAX
    mix = MixedDataset({"many": many, "one": one}, epoch_samples=300, seed=5)
    rng = np.random.default_rng(0)
    for epoch in (0, 3):
        mix.set_epoch(epoch)
        for size in (1, 2, 40, 300):
            _check(mix, rng.permutation(300)[:size].astype(np.int64))
    only_empty = np.array([i for i in range(300) if len(mix[i]["tokens"]) == 0][:4], np.int64)
    _check(mix, only_empty)  # a batch of empty rows only: width 0
    many.close()
    one.close()


@pytest.mark.parametrize("column", ["tokens", "tokens.offsets", "text", "label"])
def test_a_column_rewritten_in_place_as_the_member_sees_it(tmp_path: Path, column: str) -> None:
    """A column file of the one-shard member rewritten in place: the member's own read refuses
    it naming the file (whatever its kind: data, offsets, side field), every mixed batch
    touching the member is refused, and a batch of the other member only is read."""
    many = _write(tmp_path / "many", 1000, 150, shard_bytes=16)
    one = _write(tmp_path / "one", 2000, 5, shard_bytes=1 << 20)
    mix = MixedDataset({"many": many, "one": one}, epoch_samples=300, seed=5)
    idx = np.arange(300, dtype=np.int64)
    _check(mix, idx)
    with open(tmp_path / "one" / f"shard-00000.{column}", "r+b") as f:
        head = f.read(4)
        f.seek(0)
        f.write(bytes(255 - b for b in head))
    name = f"shard-00000.{column}: shard 0 file"  # every file kind is checked (typedguard)
    with pytest.raises(DatasetError, match=re.escape(name)):
        one.read_batch(np.arange(5, dtype=np.int64))
    member, _ = mix.locate(idx)
    with pytest.raises(DatasetError, match=re.escape(name)):
        mix.read_batch(idx)
    with pytest.raises(DatasetError, match=re.escape(name)):
        mix.read_batch(idx[member == 1][:1])
    _check(mix, idx[member == 0][:20])  # a batch of the other member only is read
    many.close()
    one.close()


def test_typed_readers_racing_close(tmp_path: Path) -> None:
    """Thread readers of typed members (more maps than HELD_MAX) while the main thread closes
    them again and again: every batch is the first one's equal or a DatasetError, no reader
    stuck, no other error."""
    many = _write(tmp_path / "many", 1000, 150, shard_bytes=16)
    one = _write(tmp_path / "one", 2000, 5, shard_bytes=1 << 20)
    mix = MixedDataset({"many": many, "one": one}, epoch_samples=300, seed=5)
    idx = np.random.default_rng(0).permutation(300)[:40].astype(np.int64)
    _check(mix, idx)
    want = mix.read_batch(idx)
    bad: list[object] = []
    started = threading.Barrier(3, timeout=60)

    def read() -> None:
        started.wait()
        for _ in range(150):
            try:
                got = mix.read_batch(idx)
            except DatasetError:
                continue
            except Exception as exc:
                bad.append(exc)
                return
            same = got["text"] == want["text"] and torch.equal(got["tokens"], want["tokens"])
            if not same or not torch.equal(got["label"], want["label"]):
                bad.append(got)

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    for _ in range(100):
        many.close()
        one.close()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not bad
    many.close()
    one.close()
