"""``ShardFiles`` (feedpipe/datasets/_memmap_open.py) tells whether its open files are this
process's by a :class:`~feedpipe.io.forks.ForkStamp`, not ``os.getpid()`` (a system call): a
batch read once the files are open makes no ``getpid`` call, on the typed path (side fields and
offsets checked before every use: ``check_whole``) and the per-shard path (``read="pread"``);
a forked child still opens its own files (tests/test_typed_rewrite.py's fork test, and the one
here for the per-shard path)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import MemmapDataset, MemmapWriter
from feedpipe.datasets._memmap_open import OpenShards, ShardFiles

FIELDS: dict[str, Any] = {"tokens": ("int32", (None,)), "label": "int64", "text": "str"}


def _typed(path: Path) -> MemmapDataset:
    with MemmapWriter(path, fields=FIELDS, shard_bytes=256, records=False) as w:
        for i in range(60):
            w.append(tokens=np.arange(i % 4, dtype=np.int32), label=i, text=f"row {i}")
    return MemmapDataset(path, pad_value=-1)


def _fixed(path: Path, read: str) -> MemmapDataset:
    x = (np.arange(100)[:, None] + np.arange(16)[None, :]).astype(np.uint8)
    with MemmapWriter(path, shape=(16,), dtype="uint8", shard_bytes=160) as w:
        w.append_batch(x)
    return MemmapDataset(path, read=read)


def _getpids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``os.getpid()`` call from here on appends one entry."""
    real = os.getpid
    calls: list[int] = []

    def counted() -> int:
        calls.append(1)
        return real()

    monkeypatch.setattr(os, "getpid", counted)
    return calls


def test_typed_batches_make_no_getpid_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typed dataset's batch (its side fields checked before each use) asks no process id
    once its files are open (it asked 5 times a batch before the ForkStamp)."""
    ds = _typed(tmp_path / "d")
    idx = np.random.default_rng(0).integers(0, 60, 64).astype(np.int64)
    want = ds.read_batch(idx)  # opened and watched here
    calls = _getpids(monkeypatch)
    for _ in range(3):
        got = ds.read_batch(idx)
        assert got["label"].tolist() == want["label"].tolist()
        assert got["text"] == want["text"]
    assert calls == []
    monkeypatch.undo()
    ds.close()


def test_per_shard_batches_make_no_getpid_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read="pread"`` (the open files looked up per batch): no process id asked per batch
    (2 a batch before)."""
    ds = _fixed(tmp_path / "d", "pread")
    idx = np.arange(0, 100, 3, dtype=np.int64)
    want = ds.read_batch(idx)
    calls = _getpids(monkeypatch)
    assert torch.equal(ds.read_batch(idx), want)
    assert calls == []
    monkeypatch.undo()
    ds.close()


def _shard_files(ds: MemmapDataset) -> ShardFiles:
    reader = ds.column_reader()
    assert reader is not None
    return reader.files


def _read_in_child(ds: MemmapDataset, idx: np.ndarray, parents: OpenShards, out: Any) -> None:
    try:
        got = ds.read_batch(idx).numpy().tobytes()
        out.put((got, _shard_files(ds).files("data") is parents))
    except BaseException as exc:  # reported to the parent, which fails the test naming it
        out.put(repr(exc))


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_reads_through_its_own_files(tmp_path: Path) -> None:
    """The parent's per-shard files open, a forked child reads the same batch through open
    files of its own (not the copy of the parent's it inherited): the parent's bytes; the
    parent reads on through its own after the child is gone."""
    ds = _fixed(tmp_path / "d", "pread")
    idx = np.arange(99, -1, -7, dtype=np.int64)
    want = ds.read_batch(idx)
    parents = _shard_files(ds).files("data")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(ds, idx, parents, out))
    child.start()
    try:
        got = out.get(timeout=60)
    finally:
        child.join(timeout=60)
    assert isinstance(got, tuple), got
    assert got[0] == want.numpy().tobytes()
    assert got[1] is False, "the child read through its parent's open files"
    assert child.exitcode == 0
    assert torch.equal(ds.read_batch(idx), want)
    assert _shard_files(ds).files("data") is parents
    ds.close()
