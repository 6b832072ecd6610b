"""Attack: a feedpipe DataLoader iterated in a child forked while another thread of the parent
held its stall meter's lock (a batch being recorded, ``stats()`` read by a reporting thread).
The lock is a :class:`feedpipe.io.forks.ForkLock`'s: the child finds it free."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from _fork_probe import fork_while_held

import feedpipe


def test_loader_iterated_in_a_child_forked_while_its_meter_lock_was_held(tmp_path: Path) -> None:
    with feedpipe.MemmapWriter(tmp_path / "ds", shape=(4,), dtype="int32") as w:
        w.append_batch(np.arange(64 * 4, dtype=np.int32).reshape(64, 4))
    ds = feedpipe.MemmapDataset(tmp_path / "ds")
    loader = feedpipe.DataLoader(ds, batch_size=8, num_workers=0)
    assert sum(len(b) for b in loader) == 64
    lock = loader.meter._counters.lock
    got = fork_while_held(lambda: lock, lambda: sum(len(b) for b in loader), 15)
    ds.close()
    assert got == ("ok", 64), f"the child's pass: {got}"
