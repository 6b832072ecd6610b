"""What ``feedpipe stage`` does to its destination: it never writes through symlinks (present or
swapped in during the stage; nor does the shard cache: the write-path matrix), never deletes a
dataset file whose name looks like a temp, never rewrites a file a reader may have mapped, and
odd entries are clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _helpers import relocate_dataset as _relocate
from _procs import child_env as _env
from test_stage import make_dataset, upload

from feedpipe import MemmapDataset
from feedpipe.errors import DatasetError
from feedpipe.io import ownership
from feedpipe.io.dirfd import Dir, TempFile
from feedpipe.io.ownership import claim, owns
from feedpipe.remote import cache_space
from feedpipe.remote import stage as stage_mod
from feedpipe.remote import transfer as _remote
from feedpipe.remote.cache import ShardCache
from feedpipe.remote.stage import stage


def test_symlinked_directory_in_destination_is_refused(tmp_path: Path) -> None:
    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    _relocate(tmp_path / "src", {"shard-00001.data": "sub/shard-00001.data"})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "mine.txt").write_text("keep")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DatasetError, match="symlink"):
        stage(tmp_path / "src", dst, progress=False)
    assert sorted(p.name for p in outside.iterdir()) == ["mine.txt"]
    assert (outside / "mine.txt").read_text() == "keep"


def test_symlinked_files_in_destination_are_refused_not_written_through(tmp_path: Path) -> None:
    """Issue 25 item 3 changed this: links stage did not make are refused by name (they were
    replaced); either way nothing is written through them."""
    contents = make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    outside = tmp_path / "outside"
    outside.mkdir()
    same = outside / "same.data"  # identical bytes: must still not be served through the link
    same.write_bytes(contents["shard-00000.data"])
    other = outside / "other.data"
    other.write_bytes(b"x" * len(contents["shard-00001.data"]))
    index = outside / "index.json"
    index.write_text("users file")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "shard-00000.data").symlink_to(same)
    (dst / "shard-00001.data").symlink_to(other)
    (dst / "index.json").symlink_to(index)
    with pytest.raises(DatasetError, match=r"shard-00000\.data \(a symlink\)"):
        stage(tmp_path / "src", dst, progress=False)
    for name in ("shard-00000.data", "shard-00001.data", "index.json"):
        assert (dst / name).is_symlink(), name
    assert same.read_bytes() == contents["shard-00000.data"]
    assert other.read_bytes() == b"x" * len(contents["shard-00001.data"])
    assert index.read_text() == "users file"


def test_a_shard_named_like_a_part_file_is_never_deleted(tmp_path: Path) -> None:
    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    odd = "img.part.4194303.data"  # looked like a temp of a dead pid to the old naming
    _relocate(tmp_path / "src", {"shard-00001.data": odd, "shard-00000.data": ".x.part.1.2.data"})
    dst = tmp_path / "dst"
    assert stage(tmp_path / "src", dst, progress=False).copied == 4
    again = stage(tmp_path / "src", dst, progress=False)
    assert again.copied == 0, "a dataset file was taken for a temp and deleted"
    assert (dst / odd).exists()


_READER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from feedpipe import MemmapDataset
    from feedpipe.errors import DatasetError
    ds = MemmapDataset(sys.argv[1], read=sys.argv[2])
    n = len(ds)
    def everything():
        rows = [ds[i]["data"].numpy() for i in range(n)]  # __getitem__ ...
        batch = ds.read_batch(list(range(n)))["data"].numpy()  # ... and the batched gather
        assert np.array_equal(np.stack(rows), batch)
        return batch.copy()
    first = everything()
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        again = everything()
    except DatasetError as exc:
        print("error", exc, flush=True)
        sys.exit(3)
    print("same" if np.array_equal(first, again) else "changed", flush=True)
    """
)


def _reader(dst: Path, read: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _READER, str(dst), read],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if line != "ready":
        child.kill()
        raise AssertionError(f"reader did not start: {line} {child.communicate(timeout=30)}")
    return child


def _finish(child: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = child.communicate("go\n", timeout=60)
    return child.returncode, out + err


@pytest.mark.parametrize("source", ["local", "s3"])
def test_restage_under_a_mapped_reader_keeps_its_old_bytes(
    tmp_path: Path, source: str, request: pytest.FixtureRequest
) -> None:
    """A reader process maps v1's shards; v2 (smaller shards, other bytes) is staged over them.
    Truncating in place would kill the reader with SIGBUS; it must read v1's bytes unharmed."""
    make_dataset(tmp_path / "v1", shards=2, nbytes=20_000, seed=1)
    v2 = make_dataset(tmp_path / "v2", shards=2, nbytes=10_000, seed=2)
    src: str = str(tmp_path / "v2")
    opts = None
    if source == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        src = upload(tmp_path / "v2", bucket, opts)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    child = _reader(dst, "mmap")
    try:
        stage(src, dst, storage_options=opts, progress=False)
    finally:
        rc, out = _finish(child)
    assert rc == 0 and out.strip() == "same", (rc, out)  # -7 would be SIGBUS
    assert (dst / "shard-00000.data").read_bytes() == v2["shard-00000.data"]
    assert len(MemmapDataset(dst, verify=True)) == 20


def _truncate_in_place(path: Path) -> None:
    """What `cp new old` does to a mapped file: same inode, shorter, other bytes."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(b"\x07" * 4000)


def test_a_user_truncating_in_place_is_caught_by_a_pread_reader(tmp_path: Path) -> None:
    """The documented escape hatch: read="pread" turns a shard rewritten in place under a
    running reader into a DatasetError, never a SIGBUS."""
    make_dataset(tmp_path / "ds", shards=2, nbytes=20_000)
    child = _reader(tmp_path / "ds", "pread")
    try:
        _truncate_in_place(tmp_path / "ds" / "shard-00001.data")
    finally:
        rc, out = _finish(child)
    assert rc == 3 and "shard-00001.data" in out, (rc, out)


# ---------------------------------------------------------------- the write-path matrix
# Every path that writes into a stage destination or a shard cache, attacked the same way: a
# directory on the way is swapped for a symlink to ``outside`` at the worst moment (a hook on the
# write itself, real filesystem). The invariant: nothing lands outside, and an error is a
# DatasetError naming the path. (feedpipe.io.dirfd's own attacks: tests/test_dirfd.py.)


def _aside(path: Path, outside: Path, *, remove: bool = False) -> Path:
    """The attacker: remove (or move aside) the directory ``path`` and link it to ``outside``."""
    aside = path.with_name(path.name + ".aside")
    if remove:
        shutil.rmtree(path)
    else:
        os.rename(path, aside)
    path.symlink_to(outside, target_is_directory=True)
    return aside


def _hook(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, attack: Any) -> None:
    """Run ``attack()`` once, just before the first call of ``owner.name``."""
    real = getattr(owner, name)
    done: list[bool] = []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            attack()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, hooked)


def _src_with_sub(tmp_path: Path) -> Path:
    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    _relocate(tmp_path / "src", {"shard-00001.data": "sub/shard-00001.data"})
    return tmp_path / "src"


def _in_memory(src: Path) -> str:
    """The dataset at ``src`` on fsspec's in-memory filesystem (a remote for the cache)."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://stagefd-{uuid.uuid4().hex}/ds"
    for p in sorted(src.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{url}/{p.relative_to(src).as_posix()}", p.read_bytes())
    return url


def _stage_shard_dir(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"  # sub/ is removed while its file downloads: no new entry lands
    _hook(mp, _remote, "fetch_verified", lambda: _aside(dst / "sub", outside, remove=True))
    with pytest.raises(DatasetError, match=r"dst/sub.*removed or replaced"):
        stage(_src_with_sub(tmp_path), dst, progress=False, workers=1)


def _stage_destination(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"  # the destination itself moved aside: the stage finishes there
    moved: list[Path] = []
    _hook(mp, _remote, "fetch_verified", lambda: moved.append(_aside(dst, outside)))
    stage(_src_with_sub(tmp_path), dst, progress=False, workers=1)
    assert len(MemmapDataset(moved[0], verify=True)) > 0


def _stage_index(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"  # swapped right before index.json is written
    moved: list[Path] = []
    _hook(mp, Dir, "write_atomic", lambda: moved.append(_aside(dst, outside)))
    stage(_src_with_sub(tmp_path), dst, progress=False, workers=1)
    assert (moved[0] / "index.json").exists()


def _cache_fill(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    with ShardCache(_in_memory(_src_with_sub(tmp_path)), tmp_path / "cache") as cache:
        version = Path(cache.dir)
        cache.acquire("shard-00000.data")
        cache.release("shard-00000.data")
        _hook(mp, _remote, "fetch_verified", lambda: _aside(version / "sub", outside, remove=True))
        with pytest.raises(DatasetError, match=r"sub.*removed or replaced"):
            cache.acquire("sub/shard-00001.data")


def _cache_index(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    moved: list[Path] = []

    def attack() -> None:  # the one version folder there, swapped before its index is written
        (version,) = (p for p in (tmp_path / "cache").iterdir() if p.is_dir())
        moved.append(_aside(version, outside))

    _hook(mp, Dir, "write_atomic", attack)
    ShardCache(_in_memory(_src_with_sub(tmp_path)), tmp_path / "cache").close()
    assert (moved[0] / "index.json").exists()


def _cache_locks(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    with ShardCache(_in_memory(_src_with_sub(tmp_path)), tmp_path / "cache") as cache:
        aside = _aside(Path(cache.dir) / ".locks", outside)  # before any file's lock is made
        with cache.leased("sub/shard-00001.data") as path:
            assert Path(path).stat().st_size == 5000
    assert (aside / "sub" / "shard-00001.data.lock").exists()


def _cache_evict(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    (outside / "shard-00001.data").write_bytes(b"users")  # what the eviction would unlink
    with ShardCache(
        _in_memory(_src_with_sub(tmp_path)), tmp_path / "c", 9000, room_timeout_s=0.0
    ) as cache:
        with cache.leased("sub/shard-00001.data"):
            pass
        # the scan finds the only file to evict; then, before the unlink, its folder is swapped
        _hook(mp, cache_space, "version_tree", lambda: _aside(Path(cache.dir) / "sub", outside))
        with pytest.raises(DatasetError, match="cannot make room"):
            cache.acquire("shard-00000.data")
        assert cache.stats.evictions == 0
    assert (outside / "shard-00001.data").read_bytes() == b"users"
    (outside / "shard-00001.data").unlink()


def _stage_claim(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"  # swapped after the stage opened it, before it claims (marks) it
    real = stage_mod._claim

    def hooked(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("at") is not None:
            _aside(dst, outside)
        real(*args, **kwargs)

    mp.setattr(stage_mod, "_claim", hooked)
    with pytest.raises(DatasetError, match=r"outside: was replaced while stage claimed it"):
        stage(_src_with_sub(tmp_path), dst, progress=False, workers=1)


def _cache_claim(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"  # swapped right before its ownership marker is written
    _hook(mp, TempFile, "commit", lambda: _aside(cache, outside))
    with pytest.raises(DatasetError, match=r"cache: was replaced while cache claimed it"):
        ShardCache(_in_memory(_src_with_sub(tmp_path)), cache)


def _claim_marker(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"  # feedpipe.io.ownership.claim itself, at its marker write
    root.mkdir()
    moved: list[Path] = []
    _hook(mp, TempFile, "commit", lambda: moved.append(_aside(root, outside)))
    with pytest.raises(NotADirectoryError, match=r"root: was replaced while stage claimed it"):
        claim(root, "stage", lambda p: False)
    assert owns(moved[0], "stage")  # through the fd: into the directory that was opened


def _claim_checked(tmp_path: Path, outside: Path, mp: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"  # claim itself, swapped once checked, before the marker is made
    root.mkdir()
    moved: list[Path] = []

    def dumps(*args: Any, **kwargs: Any) -> str:  # the marker's body, made right before its write
        moved.append(_aside(root, outside))
        return json.dumps(*args, **kwargs)

    mp.setattr(ownership, "json", SimpleNamespace(dumps=dumps, loads=json.loads))
    with pytest.raises(NotADirectoryError, match=r"root: was replaced while stage claimed it"):
        claim(root, "stage", lambda p: False)
    assert list(moved[0].iterdir()) == []  # refused before the write: nothing anywhere


_WRITE_PATHS = {
    "ownership: after the checks, before the marker write": _claim_checked,
    "ownership: the marker write": _claim_marker,
    "stage: the destination, before its claim": _stage_claim,
    "cache: the cache folder's claim": _cache_claim,
    "stage: a shard's directory": _stage_shard_dir,
    "stage: the destination": _stage_destination,
    "stage: the index write": _stage_index,
    "cache: a shard's directory (fill)": _cache_fill,
    "cache: the version folder (index write)": _cache_index,
    "cache: the lock folder": _cache_locks,
    "cache: eviction": _cache_evict,
}


@pytest.mark.parametrize("path", list(_WRITE_PATHS))
def test_a_directory_swapped_for_a_symlink_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    _WRITE_PATHS[path](tmp_path, outside, monkeypatch)
    assert list(outside.iterdir()) == []


def test_a_link_in_the_cache_is_replaced_never_served(tmp_path: Path) -> None:
    """A link planted where a cached copy goes (the right size, other bytes) is not taken for
    the copy: the file is downloaded and renamed over the link; the link's target is left."""
    contents = make_dataset(tmp_path / "src", shards=1, nbytes=5000)
    planted = tmp_path / "planted.data"
    planted.write_bytes(b"p" * len(contents["shard-00000.data"]))
    with ShardCache(_in_memory(tmp_path / "src"), tmp_path / "cache") as cache:
        Path(cache.path("shard-00000.data")).symlink_to(planted)
        with cache.leased("shard-00000.data") as path:
            assert not Path(path).is_symlink()
            assert Path(path).read_bytes() == contents["shard-00000.data"]
        assert cache.stats.downloads == 1
    assert planted.read_bytes() == b"p" * len(contents["shard-00000.data"])


def test_files_and_directories_are_fsynced_before_the_index_vouches_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Module docstring, rule 3: each file is fsynced before its rename, and every directory a
    file was renamed into before ``index.json`` is (a power loss never leaves an index over
    files that are not on disk). Recorded on a real stage by hooks on os.fsync/os.replace."""
    src = _src_with_sub(tmp_path)
    events: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def replace(a: str, b: str, *, src_dir_fd: int | None = None, **kw: Any) -> None:
        st = os.stat(a, dir_fd=src_dir_fd, follow_symlinks=False)
        events.append(("replace", (b, (st.st_dev, st.st_ino))))
        real_replace(a, b, src_dir_fd=src_dir_fd, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dst = tmp_path / "dst"
    stage(src, dst, progress=False, workers=2)
    monkeypatch.undo()

    def ident(p: Path) -> tuple[int, int]:
        st = p.stat()
        return st.st_dev, st.st_ino

    renames = [(i, v) for i, (kind, v) in enumerate(events) if kind == "replace"]
    synced = [(i, v) for i, (kind, v) in enumerate(events) if kind == "fsync"]
    (at_index,) = [i for i, (name, _) in renames if name == "index.json"]
    files = [(i, node) for i, (name, node) in renames if name.startswith("shard-")]
    assert len(files) == 4
    for i, node in files:  # the file itself, before its rename
        assert any(j < i and v == node for j, v in synced), events
    last_file = max(i for i, _ in files)
    for folder in (dst, dst / "sub"):  # each directory, after the last rename, before the index
        assert any(last_file < j < at_index and v == ident(folder) for j, v in synced), folder


@pytest.mark.parametrize("what", ["index-dir", "lock-link"])
def test_odd_entries_in_the_destination_are_clear_errors(tmp_path: Path, what: str) -> None:
    """A directory named index.json raised a bare IsADirectoryError (a CLI traceback)."""
    make_dataset(tmp_path / "src", shards=1, nbytes=3000)
    dst = tmp_path / "dst"
    dst.mkdir()
    (tmp_path / "out").mkdir()
    if what == "index-dir":
        (dst / "index.json").mkdir()
    else:
        (dst / ".feedpipe-tmp.stage.lock").symlink_to(tmp_path / "out" / "x")
    with pytest.raises(DatasetError, match=r"index\.json|lock"):
        stage(tmp_path / "src", dst, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_fifo_in_place_of_the_index_is_no_hang(tmp_path: Path) -> None:
    """Restaging into a folder stage made, whose index.json someone replaced with a FIFO: the
    stage ends (staged anew, or refused naming the entry), never waits for a writer."""
    import threading

    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    dst = tmp_path / "dst"
    stage(tmp_path / "src", dst, progress=False)
    (dst / "index.json").unlink()
    os.mkfifo(dst / "index.json")
    got: dict[str, Any] = {}

    def body() -> None:
        try:
            got["value"] = stage(tmp_path / "src", dst, progress=False)
        except DatasetError as exc:
            got["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(20)
    hung = t.is_alive()
    if hung:  # unblock the open waiting for a writer, so the test ends either way
        os.close(os.open(dst / "index.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
    assert not hung, "stage blocked on a FIFO planted at index.json"
    if "error" in got:
        assert "index.json" in str(got["error"])
    else:
        assert (dst / "index.json").is_file()
        assert len(MemmapDataset(dst)) > 0


def test_a_fifo_swapped_in_before_pressure_is_created_is_no_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache signals pressure by touching ``.pressure``, or creating it when it is missing.
    A FIFO planted between the two (hooked: the touch finds no file, then the FIFO appears)
    must not hold the download waiting for room on an open with no reader."""
    import threading

    space = cache_space.CacheSpace(str(tmp_path), None, 1.0, 1.0, lambda _name: None)
    target = tmp_path / cache_space.PRESSURE
    real_utime = os.utime

    def utime_then_swap(path: Any, *args: Any, **kwargs: Any) -> None:
        try:
            real_utime(path, *args, **kwargs)
        except FileNotFoundError:
            if os.fspath(path) == str(target) and not target.exists():
                os.mkfifo(target)  # the attacker, between the touch and the create
            raise

    monkeypatch.setattr(os, "utime", utime_then_swap)
    t = threading.Thread(target=space.signal_pressure, daemon=True)
    t.start()
    t.join(20)
    hung = t.is_alive()
    if hung:  # a reader: the open for writing returns, so the test ends either way
        os.close(os.open(target, os.O_RDONLY | os.O_NONBLOCK))
        t.join(20)
    assert not hung, "signal_pressure blocked opening a FIFO planted at .pressure"


def test_a_marker_swapped_for_a_fifo_after_its_check_is_no_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restaging reads stage's ownership marker after checking it is a regular file. A FIFO
    swapped in between (hooked: right after the check) is refused, never waited on."""
    import threading

    from feedpipe.io import ownership

    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    dst = tmp_path / "dst"
    stage(tmp_path / "src", dst, progress=False)
    marker = dst / ownership.marker_name("stage")
    assert marker.is_file()
    real_lstat = os.lstat

    def lstat_then_swap(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        st = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == str(marker) and marker.is_file() and not marker.is_symlink():
            marker.unlink()
            os.mkfifo(marker)  # the attacker, between the check and the read
        return st

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    got: dict[str, Any] = {}

    def body() -> None:
        try:
            got["value"] = ownership.owner_record(dst, "stage")
        except ValueError as exc:
            got["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(20)
    hung = t.is_alive()
    if hung:  # a writer: the open for reading returns, so the test ends either way
        os.close(os.open(marker, os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
    assert not hung, "reading the ownership marker blocked on a FIFO swapped in"
    assert "error" in got and "marker" in str(got["error"])
