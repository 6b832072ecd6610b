"""ShardCache: lazy fetch, prefetch, LRU eviction under a limit, pins, processes, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _faultproxy import FaultProxy
from _helpers import relocate_dataset as _relocate
from _procs import python_child, read_marker, stop
from test_stage import make_dataset, upload

from feedpipe.errors import DatasetError
from feedpipe.remote import transfer as _remote
from feedpipe.remote.cache import ShardCache

HERE = Path(__file__).resolve().parent
DATA = [f"shard-{i:05d}.data" for i in range(4)]


@pytest.fixture
def remote(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    bucket, opts = s3_bucket
    contents = make_dataset(tmp_path / "src", shards=4, nbytes=40_000)
    return upload(tmp_path / "src", bucket, opts), opts, contents


def data_files(cache: ShardCache) -> list[str]:
    return sorted(p.name for p in Path(cache.dir).glob("shard-*.data"))


def test_local_dataset_is_read_in_place(tmp_path: Path) -> None:
    contents = make_dataset(tmp_path / "ds", shards=2)
    for url in (str(tmp_path / "ds"), f"file://{tmp_path / 'ds'}"):
        with ShardCache(url, tmp_path / "cache", limit_bytes=1) as cache:
            assert cache.is_local
            path = cache.acquire("shard-00000.data")
            assert path == str(tmp_path / "ds" / "shard-00000.data")
            assert Path(path).read_bytes() == contents["shard-00000.data"]
            assert cache.prefetch(["shard-00001.data"]) == []
            cache.release("shard-00000.data")
    assert not (tmp_path / "cache").exists()  # nothing copied, nothing to evict
    assert all((tmp_path / "ds" / rel).exists() for rel in contents)


def test_lazy_fetch_once_then_hit(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    url, opts, contents = remote
    with ShardCache(url, tmp_path / "cache", None, opts) as cache:
        assert data_files(cache) == []
        with cache.leased("shard-00001.data") as path:
            assert Path(path).read_bytes() == contents["shard-00001.data"]
        with cache.leased("shard-00001.data") as path2:
            assert path2 == path
        assert (cache.stats.downloads, cache.stats.hits) == (1, 1)
        with pytest.raises(DatasetError, match=r"shard-00009\.data: not listed in the index"):
            cache.acquire("shard-00009.data")
        with pytest.raises(ValueError, match="not acquired"):
            cache.release("shard-00001.data")
    # a second cache object on the same directory finds the file
    with ShardCache(url, tmp_path / "cache", None, opts) as again:
        again.acquire("shard-00001.data")
        assert again.stats.downloads == 0 and again.stats.hits == 1


def test_prefetch(tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]) -> None:
    url, opts, contents = remote
    with ShardCache(url, tmp_path / "cache", None, opts, prefetch_workers=2) as cache:
        futures = cache.prefetch(DATA[1:])
        for f in futures:
            f.result(timeout=60)
        assert data_files(cache) == DATA[1:]
        assert cache.stats.downloads == 3 and cache.leased_files() == []
        for rel in DATA[1:]:
            with cache.leased(rel) as p:
                assert Path(p).read_bytes() == contents[rel]
        assert cache.stats.downloads == 3
        with pytest.raises(DatasetError, match="not listed"):
            cache.prefetch(["nope"])


def test_lru_eviction_respects_limit_and_pins(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    url, opts, contents = remote
    sizes = {rel: len(contents[rel]) for rel in DATA}
    limit = sizes[DATA[0]] + sizes[DATA[1]] + sizes[DATA[2]] // 2  # room for two .data files
    with ShardCache(url, tmp_path / "cache", limit, opts, room_timeout_s=0.5) as cache:
        for rel in DATA[:2]:
            with cache.leased(rel):
                pass
        time.sleep(0.02)
        with cache.leased(DATA[0]):  # DATA[0] is now the most recently used
            pass
        with cache.leased(DATA[2]):
            pass
        assert data_files(cache) == [DATA[0], DATA[2]]  # DATA[1] was least recently used
        assert cache.stats.evictions == 1
        # pin both: a third file cannot fit, and the pinned ones are not evicted
        p0, p2 = cache.acquire(DATA[0]), cache.acquire(DATA[2])
        with pytest.raises(DatasetError, match="leased by readers"):
            cache.acquire(DATA[3])
        assert data_files(cache) == [DATA[0], DATA[2]]
        assert not [p for p in Path(cache.dir).iterdir() if _remote.is_temp(p.name)]
        cache.release(DATA[0])
        with cache.leased(DATA[3]) as p3:
            assert Path(p3).read_bytes() == contents[DATA[3]]
        assert data_files(cache) == [DATA[2], DATA[3]]
        assert Path(p2).read_bytes() == contents[DATA[2]] and not Path(p0).exists()
        total = sum(p.stat().st_size for p in Path(cache.dir).glob("shard-*"))
        assert total <= limit
        with pytest.raises(DatasetError, match="does not fit the cache limit"):
            ShardCache(url, tmp_path / "c2", 1000, opts).acquire(DATA[0])


def test_cache_dir_holding_user_files_is_refused_and_never_evicted_from(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    """Issue 25 item 3: eviction deleted any file under cache_dir, a user's included."""
    url, opts, contents = remote
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(DatasetError, match=r"did not write \('thesis\.tex'\)"):
        ShardCache(url, user, None, opts)
    assert sorted(p.name for p in user.iterdir()) == ["thesis.tex"]
    cache_dir = tmp_path / "cache"
    limit = len(contents[DATA[0]]) + len(contents[DATA[1]]) // 2  # room for one .data file
    with ShardCache(url, cache_dir, limit, opts, room_timeout_s=0.5) as cache:
        (cache_dir / "later").mkdir()  # added after the claim: still never evicted
        (cache_dir / "later" / "notes.txt").write_text("keep")
        for rel in DATA[:2]:
            with cache.leased(rel):
                pass
        assert cache.stats.evictions == 1
    assert (cache_dir / "later" / "notes.txt").read_text() == "keep"
    (tmp_path / "link").symlink_to(cache_dir, target_is_directory=True)
    again = ShardCache(url, tmp_path / "link", None, opts)  # a linked cache_dir works
    with again, again.leased(DATA[0]) as p0:
        assert Path(p0).read_bytes() == contents[DATA[0]]


def test_a_user_folder_named_like_a_version_is_not_the_caches(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    """A version folder was known by its name alone (16 hex digits): a user's folder of that
    name (a commit hash, a run id) in cache_dir was adopted at the claim and evicted from."""
    url, opts, contents = remote
    cache_dir = tmp_path / "cache"
    (cache_dir / "0123456789abcdef").mkdir(parents=True)
    (cache_dir / "0123456789abcdef" / "weights.bin").write_bytes(b"x" * 50_000)
    with pytest.raises(DatasetError, match=r"did not write \('0123456789abcdef'\)"):
        ShardCache(url, cache_dir, None, opts)
    cache_dir2 = tmp_path / "cache2"
    limit = len(contents[DATA[0]]) + len(contents[DATA[1]]) // 2
    with ShardCache(url, cache_dir2, limit, opts, room_timeout_s=0.5) as cache:
        (cache_dir2 / "fedcba9876543210").mkdir()  # added after the claim
        (cache_dir2 / "fedcba9876543210" / "weights.bin").write_bytes(b"y" * 50_000)
        for rel in DATA[:2]:
            with cache.leased(rel):
                pass
    assert (cache_dir2 / "fedcba9876543210" / "weights.bin").stat().st_size == 50_000


_WORKER = """
import json, random, sys
from feedpipe.remote.cache import ShardCache
url, cache_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[5])
opts, files = json.loads(sys.argv[3]), json.loads(sys.argv[4])
random.Random(seed).shuffle(files)
with ShardCache(url, cache_dir, None, opts, timeout_s=60) as cache:
    for rel in files:
        with cache.leased(rel) as p:
            open(p, "rb").read()
    print(json.dumps({"downloads": cache.stats.downloads, "hits": cache.stats.hits}))
"""


def test_processes_share_one_cache_and_download_once(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    url, opts, contents = remote
    files = sorted(contents)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                url,
                str(tmp_path / "cache"),
                json.dumps(opts),
                json.dumps(files),
                str(i),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(json.loads(out))
    assert sum(r["downloads"] for r in results) == len(files)  # each file downloaded exactly once
    assert sum(r["hits"] for r in results) == 2 * len(files)
    with ShardCache(url, tmp_path / "cache", None, opts) as cache:
        for rel, data in contents.items():
            assert Path(cache.path(rel)).read_bytes() == data


_KILLED = """
import sys, json
from feedpipe.remote.cache import ShardCache
cache = ShardCache(sys.argv[1], sys.argv[2], None, json.loads(sys.argv[3]), timeout_s=60)
print("ready", flush=True)
cache.acquire("shard-00002.data")
"""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_sigkilled_downloader_leaves_nothing_complete(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]], s3_server: str
) -> None:
    url, opts, contents = remote
    cache_dir = tmp_path / "cache"
    with FaultProxy(s3_server) as proxy:
        proxy.inject("stall", match="shard-00002.data", method="GET")
        popts = dict(opts, client_kwargs=dict(opts["client_kwargs"], endpoint_url=proxy.url))
        with python_child(url, str(cache_dir), json.dumps(popts), code=_KILLED) as child:
            read_marker(child, "ready")
            deadline = time.monotonic() + 60
            parts: list[Path] = []
            while time.monotonic() < deadline and not any(_size(p) > 0 for p in parts):
                parts = list(cache_dir.glob("*/.feedpipe-tmp.*.shard-00002.data"))
                time.sleep(0.02)
            parts = [p for p in parts if _size(p) > 0]  # a retried attempt may remove its temp
            assert parts, "download never started"
            stop(child, signal.SIGKILL)
    (ds_dir,) = [p for p in cache_dir.iterdir() if p.is_dir()]
    assert not (ds_dir / "shard-00002.data").exists()  # nothing that looks complete
    assert 0 < parts[0].stat().st_size < len(contents["shard-00002.data"])
    with ShardCache(url, cache_dir, None, opts) as cache:  # the next user cleans up and refetches
        assert cache.stats.stale_temps_removed == 1
        assert not parts[0].exists()
        with cache.leased("shard-00002.data") as p:
            assert Path(p).read_bytes() == contents["shard-00002.data"]


def test_readahead_and_eager_small_files(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    url, opts, contents = remote
    labels = sorted(rel for rel in contents if rel.endswith(".label"))
    with ShardCache(url, tmp_path / "cache", None, opts, readahead=1, eager_bytes=1000) as cache:
        deadline = time.monotonic() + 60
        while cache.stats.downloads < len(labels) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(p.name for p in Path(cache.dir).glob("*.label")) == labels
        assert data_files(cache) == []  # small side files only
        with cache.leased("shard-00003.label"):  # a side file does not trigger readahead
            pass
        with cache.leased(DATA[1]):  # the main file of shard 1 -> shard 2 is fetched ahead
            pass
        for f in cache.prefetch([DATA[2]]):
            f.result(timeout=60)
        assert data_files(cache) == [DATA[1], DATA[2]]
        assert cache.stats.downloads == len(labels) + 2


def test_caches_opened_at_once_never_delete_each_others_index_temp(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]]
) -> None:
    """Broke (examples/s3_staging.py, thread workers): one cache's scan took another's unlocked
    index temp for a dead download's and deleted it, so the other's rename failed."""
    import threading

    url, opts, _ = remote
    raw = _remote.read_remote_index(*_remote.resolve(url, opts), url, opts)[0]
    for attempt in range(15):
        cache_dir = tmp_path / f"cache{attempt}"
        errors: list[BaseException] = []
        go = threading.Barrier(6)

        def open_one(
            cache_dir: Path = cache_dir,
            go: threading.Barrier = go,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                go.wait()
                ShardCache(url, cache_dir, storage_options=opts, index_bytes=raw).close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=open_one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors


def test_a_version_folder_whose_locks_appear_during_the_look_is_the_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broke (CI, one run in many of the test above): another cache made the version folder's
    ``.locks`` between this scan's look for it and its look inside; the folder, no longer
    empty, was called foreign and the cache refused its own directory. The race is made here
    on purpose: ``.locks`` appears right after the first look finds none."""
    from feedpipe.remote import cache_space

    version = tmp_path / "9937353f3d1be497"
    version.mkdir()
    real = cache_space._mode
    looked: list[Path] = []

    def mode(path: Path) -> int | None:
        got = real(path)
        if path.name == cache_space.LOCKS and not looked:
            looked.append(path)
            os.mkdir(path)  # the other cache, just after this look
            (version / "index.json.tmp").write_bytes(b"{}")  # and what it writes next
        return got

    monkeypatch.setattr(cache_space, "_mode", mode)
    assert cache_space.is_version_dir(version)
    assert looked == [version / cache_space.LOCKS]
    # a non-empty folder without .locks is still not the cache's
    other = tmp_path / "0123456789abcdef"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert not cache_space.is_version_dir(other)


def test_close_reports_a_prefetch_stuck_in_a_read(
    tmp_path: Path, remote: tuple[str, dict[str, Any], dict[str, bytes]], s3_server: str
) -> None:
    """A prefetch thread stuck in a stalled download: close() returns after ``deadline_s`` and
    names the thread (threads cannot be killed: the bound is "close returns and reports")."""
    from feedpipe.io.reaper import StuckWorkerWarning

    url, opts, _ = remote
    with FaultProxy(s3_server) as proxy:
        proxy.inject("stall", match="shard-00002.data", method="GET")
        popts = dict(opts, client_kwargs=dict(opts["client_kwargs"], endpoint_url=proxy.url))
        cache = ShardCache(url, tmp_path / "cache", None, popts, deadline_s=1.0)
        cache.prefetch(["shard-00002.data"])
        deadline = time.monotonic() + 30
        while (
            not any("shard-00002.data" in path for _, path, _ in proxy.requests)
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        with pytest.warns(StuckWorkerWarning, match=r"ShardCache prefetch thread feedpipe-"):
            cache.close()


def test_cache_never_takes_a_part_named_shard_for_a_temp(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    from feedpipe.remote.cache import ShardCache

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    odd = "img.part.4194303.data"
    _relocate(tmp_path / "src", {"shard-00001.data": odd})
    url = upload(tmp_path / "src", bucket, opts)
    with ShardCache(url, tmp_path / "cache", 10**6, opts) as cache, cache.leased(odd):
        pass
    with ShardCache(url, tmp_path / "cache", 10**6, opts) as cache:  # rescans the directory
        with cache.leased(odd) as path:
            assert os.path.getsize(path) == 5000
        assert cache.stats.downloads == 0 and cache.stats.hits == 1


def test_cache_refuses_an_index_listing_its_lock_directory(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    from feedpipe.remote.cache import ShardCache

    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=1, nbytes=5000)
    _relocate(tmp_path / "src", {"shard-00000.data": ".locks/shard-00000.data.lock"})
    url = upload(tmp_path / "src", bucket, opts)
    with pytest.raises(DatasetError, match="reserved"):
        ShardCache(url, tmp_path / "cache", None, opts)
