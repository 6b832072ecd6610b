"""A MixedDataset of ragged members drains the process's inotify watcher once per batch (the
first member's shard check); every member's guard still sees its own file rewritten."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.errors import DatasetError

SIZES = {"web": 30, "code": 5, "books": 9}


def _member(path: Path, base: int, n: int) -> MemmapDataset:
    with MemmapWriter(path, shape=(None,), dtype="int32", fields={"label": "int64"}) as w:
        for i in range(n):
            w.append(base + np.arange(i % 7 + 1, dtype=np.int32), label=base + i)
    return MemmapDataset(path)


@pytest.mark.parametrize("name", ["web", "books"])
def test_first_and_last_members_rewrite_is_refused(tmp_path: Path, name: str) -> None:
    members = {
        k: _member(tmp_path / k, 1000 * (j + 1), n) for j, (k, n) in enumerate(SIZES.items())
    }
    ds = MixedDataset(members, weights={"web": 0.5, "code": 0.3, "books": 0.2}, epoch_samples=40)
    everything = np.arange(40)
    first = ds.read_batch(everything)  # every shard mapped and watched
    assert ds.read_batch(everything)["label"].equal(first["label"])
    shard = tmp_path / name / "shard-00000.data"
    st = shard.stat()
    with open(shard, "r+b") as f:  # other bytes, same size
        f.write(b"\x55" * 16)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(
        DatasetError, match=rf"{name}.shard-00000\.data: shard 0 file was rewritten"
    ):
        ds.read_batch(everything)
    for d in members.values():
        d.close()
