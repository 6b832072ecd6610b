"""BatchPool (``feedpipe.datasets._batch_pool``): a pooled batch is never reused while anything
refers to it, and the pool turns itself off where reference counts cannot tell (from the issue 28
attack: each test failed before its fix)."""

from __future__ import annotations

import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import MemmapDataset, MemmapWriter
from feedpipe.datasets import _batch_pool


def _write(path: Path, n: int, width: int = 4096) -> np.ndarray:
    x = np.arange(n * width, dtype=np.int32).reshape(n, width) * 3 - 5
    with MemmapWriter(path, shape=(width,), dtype="int32") as w:
        w.append_batch(x)
    return x


def _interpreter(monkeypatch: pytest.MonkeyPatch, count: Any) -> None:
    """Make the pool see reference counts as ``count(real)`` (another interpreter's)."""

    def getrefcount(obj: object) -> int:
        return int(count(sys.getrefcount(obj) - 1))  # less this frame's reference

    monkeypatch.setattr(_batch_pool, "sys", types.SimpleNamespace(getrefcount=getrefcount))


def _held_view_survives(tmp_path: Path) -> tuple[bool, bool]:
    """(a view of a dropped batch is intact after 8 more batches, any memory was reused)."""
    x = _write(tmp_path / "d", 64)  # 16 KiB records: 64 of them are 1 MiB
    ds = MemmapDataset(tmp_path / "d")
    every = np.arange(64)
    batch = ds.read_batch(every)
    view = batch[10:20]
    del batch
    newer = [ds.read_batch(np.roll(every, j)) for j in range(1, 9)]
    intact = torch.equal(view, torch.from_numpy(x[10:20]))
    where = newer[-1].data_ptr()
    del newer
    reused = ds.read_batch(every[::-1].copy()).data_ptr() == where  # released: served again
    return intact and torch.equal(view, torch.from_numpy(x[10:20])), reused


def test_pool_counts_are_measured_not_assumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.14 borrows the stack reference ``sys.getrefcount`` used to count: an array with
    one view alive then shows the count a released one showed on 3.11. The pool assumed 3
    (slot, local, argument) and overwrote a batch a user still held a view of."""
    _interpreter(monkeypatch, lambda real: real - 1)  # one reference fewer, as on 3.14
    intact, reused = _held_view_survives(tmp_path)
    assert intact
    assert reused  # released batches are still reused: the pool is not simply off


@pytest.mark.parametrize("count", [lambda real: 5, lambda real: real + 7])
def test_pool_is_off_where_counts_cannot_tell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: Any
) -> None:
    """Counts that do not rise with a reference (constant): no reuse at all; counts offset by a
    constant: measured, so still correct."""
    _interpreter(monkeypatch, count)
    intact, _reused = _held_view_survives(tmp_path)
    assert intact


def test_pool_is_off_on_a_free_threaded_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else real(name)
    )
    intact, reused = _held_view_survives(tmp_path)
    assert intact and not reused
