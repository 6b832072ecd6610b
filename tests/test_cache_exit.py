"""Interpreter exit is prompt with a remote dataset's prefetches in flight (issue 16: nothing
hangs), and leaves the shard cache whole. Real subprocesses against the moto S3 server."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import python_child
from test_stage import make_dataset, upload

from feedpipe import MemmapDataset
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.remote import transfer as _remote
from feedpipe.remote.cache import ShardCache

EXIT_BOUND_S = 10.0  # generous: the old behaviour waited timeout_s (60 s below) at exit
CHILD_LIMIT_S = 45.0

_MEMMAP_CHILD = textwrap.dedent(
    """
    import json, sys
    from feedpipe import MemmapDataset
    url, cache, opts, close = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    ds = MemmapDataset(url, cache_dir=cache, storage_options=opts)
    for i in range(0, 40, 8):  # readahead and eager prefetches are queued or running now
        ds.__getitems__(list(range(i, i + 8)))
    if close == "1":
        ds.close()
    print("EXITING", flush=True)
    """
)

# Prefetches queued behind one blocked on a lock held by this very process (a pinned file's
# lock, here held by hand), then exit without close().
_BLOCKED_CHILD = textwrap.dedent(
    """
    import fcntl, json, os, sys
    from feedpipe.remote.cache import ShardCache
    url, cache, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    c = ShardCache(url, cache, storage_options=opts, prefetch_workers=1, timeout_s=60)
    rels = sorted(c._entries)
    os.makedirs(os.path.dirname(c._lock_path(rels[0])), exist_ok=True)
    fd = os.open(c._lock_path(rels[0]), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as if this process were downloading rels[0]
    c.prefetch(rels)
    print("EXITING", flush=True)
    """
)


def _run_child(code: str, *args: str) -> float:
    """Run ``code`` in a fresh interpreter; return seconds from its last line to its exit."""
    with python_child(*args, code=code, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        mark = time.monotonic()
        proc.wait(timeout=CHILD_LIMIT_S)
        took = time.monotonic() - mark
        err = proc.stderr.read()
    assert line.strip() == "EXITING", err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    return took


def _assert_cache_whole(url: str, cache_dir: Path, opts: dict[str, Any]) -> ShardCache:
    """A later open finds no temp, and every cached file matches the index's size and CRC."""
    cache = ShardCache(url, cache_dir, storage_options=opts)
    # a download cut off by exit may leave a temp: the open's scan removes it
    assert not [p for p in cache_dir.rglob("*") if _remote.is_temp(p.name)]
    for rel, entry in cache._entries.items():
        path = Path(cache.path(rel))
        if path.exists():
            data = path.read_bytes()
            assert len(data) == entry.nbytes and to_hex(crc32c(data)) == entry.crc32c, rel
    return cache


@pytest.mark.parametrize("close", [False, True], ids=["no-close", "close"])
@pytest.mark.serial
def test_memmap_exit_is_prompt_and_cache_reusable(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], close: bool
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=12, nbytes=40_000)
    url = upload(tmp_path / "src", bucket, opts)
    cache_dir = tmp_path / "cache"
    took = _run_child(_MEMMAP_CHILD, url, str(cache_dir), json.dumps(opts), "1" if close else "0")
    assert took < EXIT_BOUND_S
    _assert_cache_whole(url, cache_dir, opts).close()
    # a later open reads every record right, downloading only what the first run had not
    local = MemmapDataset(tmp_path / "src")
    ds = MemmapDataset(url, cache_dir=cache_dir, storage_options=opts)
    try:
        got = ds.__getitems__(list(range(len(ds))))
        want = local.__getitems__(list(range(len(local))))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a["data"], b["data"]) and int(a["label"]) == int(b["label"])
        assert ds._cache.stats.hits > 0
    finally:
        ds.close()


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_exit_does_not_wait_on_a_lock_its_own_process_holds(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """The old prefetch thread waited timeout_s (60 s) at exit, then drained its queue."""
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=6, nbytes=20_000)
    url = upload(tmp_path / "src", bucket, opts)
    cache_dir = tmp_path / "cache"
    took = _run_child(_BLOCKED_CHILD, url, str(cache_dir), json.dumps(opts))
    assert took < EXIT_BOUND_S
    _assert_cache_whole(url, cache_dir, opts).close()


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_prefetch_stops_waiting_once_another_reader_has_the_file(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A prefetch that found the file missing, then saw another reader download and pin it,
    must not wait for that pin to go (it used to wait timeout_s behind it)."""
    bucket, opts = s3_bucket
    contents = make_dataset(tmp_path / "src", shards=2, nbytes=20_000)
    url = upload(tmp_path / "src", bucket, opts)
    cache = ShardCache(url, tmp_path / "cache", storage_options=opts, timeout_s=30)
    rel = "shard-00000.data"
    pin = os.open(cache._lock_path(rel), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(pin, fcntl.LOCK_SH)  # another reader, about to have the file and keep it
        (fut,) = cache.prefetch([rel])
        time.sleep(0.3)  # the prefetch found it missing and waits for the exclusive lock
        tmp = cache.path(rel) + ".x"
        Path(tmp).write_bytes(contents[rel])
        os.replace(tmp, cache.path(rel))  # the other reader's download lands (and stays pinned)
        start = time.monotonic()
        fut.result(timeout=20)
        assert time.monotonic() - start < 5
        assert cache.stats.downloads == 0
    finally:
        os.close(pin)
        cache.close()


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_pinned_but_deleted_copy_fails_at_once(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A cached file deleted under this object's own pin: a clear error, not timeout_s."""
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=2, nbytes=20_000)
    url = upload(tmp_path / "src", bucket, opts)
    cache = ShardCache(url, tmp_path / "cache", storage_options=opts, timeout_s=30)
    rel = "shard-00000.data"
    try:
        cache.acquire(rel)
        os.unlink(cache.path(rel))
        start = time.monotonic()
        with pytest.raises(Exception, match="leased"):
            cache.acquire(rel)
        (fut,) = cache.prefetch([rel])
        with pytest.raises(Exception, match="leased"):
            fut.result(timeout=20)
        assert time.monotonic() - start < 5
    finally:
        cache.close()


def test_memmap_close_stops_prefetch_threads_and_reopens(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=4, nbytes=20_000)
    url = upload(tmp_path / "src", bucket, opts)
    before = set(threading.enumerate())
    ds = MemmapDataset(url, cache_dir=tmp_path / "cache", storage_options=opts)
    first = ds[0]["data"]
    ds.close()

    def prefetchers() -> list[threading.Thread]:
        return [
            t for t in set(threading.enumerate()) - before if t.name.startswith("feedpipe-prefetch")
        ]

    deadline = time.monotonic() + 5
    while prefetchers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not prefetchers()
    assert torch.equal(ds[0]["data"], first)  # reads again after close()
    ds.close()
