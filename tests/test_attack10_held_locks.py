"""Attack: a fork while another thread holds one of the locks a forked child then uses (the
dataset's open files, its one-range map, its side-field watch, the inotify watcher, a mixed
dataset's member, the RNG reader, a remote dataset's cache). The child must read (or close)
correctly, never hang: a hang is reported as one (the child is killed after a timeout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fork_probe import HANG, fork_during, fork_while_held

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets import _shard_guard
from feedpipe.datasets._gather import ShardSpace
from feedpipe.io import rng_reader


def _typed(root: Path) -> tuple[MemmapDataset, np.ndarray, np.ndarray]:
    data = np.arange(40 * 8, dtype=np.int32).reshape(40, 8)
    label = np.arange(40, dtype=np.int64) * 3
    with MemmapWriter(
        root, shape=(8,), dtype="int32", fields={"label": "int64"}, shard_bytes=320
    ) as w:
        w.append_batch(data, label=label)
    return MemmapDataset(root), data, label


def _space(ds: MemmapDataset) -> ShardSpace:
    space = ds._files.space()
    assert space is not None
    return space


def _listed(batch: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: v.tolist() for k, v in batch.items()}


_IDX = np.array([0, 9, 10, 31, 39])


def _sum(ds: MemmapDataset) -> int:
    batch = ds.read_batch(_IDX)
    return int(batch["data"].sum()) + int(batch["label"].sum())


def test_child_closes_a_dataset_whose_open_files_lock_was_held(tmp_path: Path) -> None:
    """A thread inside the open files' lock (a read mapping a shard, a close) at the fork: the
    child's close of its copy must not wait for that thread (it does not exist there)."""
    ds, data, label = _typed(tmp_path / "ds")
    ds._files.one_range = False  # the per-shard open files, as a remote or pread dataset has
    want = int(data[_IDX].sum()) + int(label[_IDX].sum())
    assert _sum(ds) == want
    files = ds._files.files()

    def close_then_read() -> int:
        ds.close()
        return _sum(ds)

    got = fork_while_held(lambda: files._lock, close_then_read, 30)
    assert got != (HANG, None), "the child's close() hung on the open files' lock held at the fork"
    assert got == ("ok", want)
    ds.close()


@pytest.mark.parametrize("lock", ["space", "whole", "watcher", "mutex"])
def test_typed_read_in_a_child_forked_while_a_lock_is_held(tmp_path: Path, lock: str) -> None:
    ds, data, label = _typed(tmp_path / "ds")
    first = ds.__getitems__(_IDX.tolist())  # maps, watches and side fields made in the parent
    assert [int(r["label"]) for r in first] == label[_IDX].tolist()
    held: dict[str, Any] = {
        "space": lambda: _space(ds)._lock,
        "whole": lambda: ds._files._whole["field.label"]._lock,
        "watcher": lambda: _shard_guard.watcher()._lock,
        "mutex": lambda: ds._files._mutex.lock,
    }

    def read() -> tuple[int, list[int]]:
        rows = ds.__getitems__(_IDX.tolist())
        out = (int(ds.read_batch(_IDX)["data"].sum()), [int(r["label"]) for r in rows])
        ds.close()
        return out

    got = fork_while_held(held[lock], read, 30)
    assert got != (HANG, None), f"the child hung on the {lock} lock held at the fork"
    assert got == ("ok", (int(data[_IDX].sum()), label[_IDX].tolist()))
    ds.close()


def test_mixed_read_in_a_child_forked_while_a_members_map_lock_is_held(tmp_path: Path) -> None:
    members = {"a": _typed(tmp_path / "a")[0], "b": _typed(tmp_path / "b")[0]}
    mix = MixedDataset(members, weights={"a": 1, "b": 2}, epoch_samples=30, seed=4)
    idx = np.random.default_rng(1).permutation(30).astype(np.int64)
    want = _listed(mix.read_batch(idx))
    space = members["b"]._files.space()
    assert space is not None
    got = fork_while_held(lambda: space._lock, lambda: _listed(mix.read_batch(idx)), 30)
    assert got != (HANG, None), "the child's mixed read hung on a member's map lock"
    assert got == ("ok", want)
    for m in members.values():
        m.close()


def test_rng_reader_in_a_child_forked_while_another_thread_reads_the_rngs() -> None:
    """A thread worker reading the global RNGs (``one_reader``) at the fork: the child's own
    reads (a loader's RNG watch, a checkpoint's RNG capture) must not wait for it."""
    got = fork_during(rng_reader.one_reader, lambda: rng_reader.one_reader(lambda: 7), 20)
    assert got == ("ok", 7), "one_reader hung in a child forked while another thread read"


def test_torch_dataloader_fork_workers_while_a_first_read_holds_the_lock(tmp_path: Path) -> None:
    """torch's DataLoader process workers (fork, the default here) started while another thread
    is in the dataset's first read: every batch arrives (``timeout``: a hang is an error)."""
    import threading

    import torch.utils.data as tud

    ds, data, _ = _typed(tmp_path / "ds")
    got, release = threading.Event(), threading.Event()

    def first_read() -> None:
        with ds._files._mutex.lock:
            got.set()
            release.wait(120)
        _sum(ds)

    t = threading.Thread(target=first_read, daemon=True)
    t.start()
    assert got.wait(30)
    try:
        loader = tud.DataLoader(
            ds, batch_size=8, num_workers=2, timeout=60, collate_fn=lambda rows: rows
        )
        it = iter(loader)  # the workers are forked here, the lock held
        release.set()
        seen = [int(r["data"].sum()) for batch in it for r in batch]
    finally:
        release.set()
        t.join(30)
    assert sorted(seen) == sorted(int(r.sum()) for r in data)
    ds.close()


def test_remote_read_in_a_child_forked_while_the_cache_is_being_made(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    from test_stage import make_dataset, upload

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=3, nbytes=4_000)
    url = upload(tmp_path / "src", bucket, opts)
    local = MemmapDataset(tmp_path / "src")
    remote = MemmapDataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
    want = _listed(local.read_batch(np.array([0, 5, 11])))
    source = remote._files.source  # the lock a first read holds while it makes the cache
    got = fork_while_held(
        lambda: source._mutex.lock, lambda: _listed(remote.read_batch(np.array([0, 5, 11]))), 60
    )
    assert got != (HANG, None), "the child's first remote read hung on the cache lock"
    assert got == ("ok", want)
    # and forked while a parent thread counts a download (the cache's own lock)
    pair = np.array([1, 2])
    assert _listed(remote.read_batch(pair)) == _listed(local.read_batch(pair))
    cache = source.cache()
    got = fork_while_held(
        lambda: cache._lock, lambda: _listed(remote.read_batch(np.array([0, 5, 11]))), 60
    )
    assert got == ("ok", want), got
    remote.close()
    local.close()


def test_remote_read_in_a_child_forked_during_a_parent_threads_download(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent thread in the middle of downloading a shard (after the request, before the file
    is in place) at the fork; it then goes on. The child reads that shard and another."""
    import os

    from test_stage import make_dataset, upload

    from feedpipe.remote import transfer

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=3, nbytes=4_000)
    url = upload(tmp_path / "src", bucket, opts)
    local = MemmapDataset(tmp_path / "src")
    remote = MemmapDataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
    idx = np.array([0, 5, 11])
    want = _listed(local.read_batch(idx))
    parent, real = os.getpid(), transfer.fetch_verified
    pauses: list[Any] = []

    def fetch(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)  # the bytes are in the temporary file, not yet in place
        if os.getpid() == parent and pauses:
            pauses.pop()()
        return got

    monkeypatch.setattr(transfer, "fetch_verified", fetch)

    def hold(pause: Any) -> None:
        pauses.append(pause)
        remote.read_batch(np.array([0]))

    got = fork_during(hold, lambda: _listed(remote.read_batch(idx)), 60, go_on_at_fork=True)
    assert got != (HANG, None), "the child's remote read hung on the parent's download"
    assert got == ("ok", want)
    assert _listed(remote.read_batch(idx)) == want
    remote.close()
    local.close()


def test_trace_recorder_decided_in_a_child_forked_while_another_thread_decided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The NVTX recorder is decided once, under a lock, on first use: a child forked while
    another thread held that lock (deciding) decides on its own."""
    from feedpipe.io import trace
    from feedpipe.io.forks import first_lock

    monkeypatch.setenv(trace.ENV, "0")
    trace.reset()  # undecided: the next recorder() decides under the lock
    got = fork_while_held(lambda: first_lock(trace._LOCK).lock, trace.recorder, 20)
    trace.reset()
    assert got == ("ok", None), f"the child's first recorder(): {got}"
