"""One shard-access rule for every layout (``feedpipe.datasets._shard_guard``, issue 25 items 7,
8 and 12): the same rewrite/truncation detection, corruption default and descriptor budget for
fixed records, bytes records, ``str``/``json``/ragged columns and ``TokenWindows``.

A new layout joins by adding one entry to ``LAYOUTS``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import fixed_int32_dataset as _fixed

from feedpipe import DatasetError, MemmapDataset, MemmapWriter, TokenWindows
from feedpipe.format import Index, Shard, read_index, write_index

ROOT = Path(__file__).resolve().parent.parent
N = 24  # records per dataset; shard_bytes makes 2+ shards of each layout


def _canon(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Layout:
    """How to write one layout, which file holds shard 0's records, how to read them."""

    writer: dict[str, Any]
    record: Callable[[int], dict[str, Any]]
    role: str  # the file of shard 0 that is tampered with
    windows: bool = False  # read through TokenWindows (block 4) instead of the dataset

    def write(self, path: Path) -> None:
        with MemmapWriter(path, shard_bytes=64, **self.writer) as w:
            for i in range(N):
                w.append(**self.record(i))

    def open(self, path: Path, **kw: Any) -> Any:
        ds = MemmapDataset(path, **kw)
        return TokenWindows(ds, block_size=4) if self.windows else ds

    def first(self, ds: Any) -> list[int]:
        """Indices of samples read only from shard 0."""
        if self.windows:  # the whole windows inside shard 0 (4 tokens of 4 bytes each)
            return list(range(max(1, ds.dataset.index.shards[0].files[self.role].bytes // 16)))
        return list(range(ds.index.shards[0].records))

    def read(self, ds: Any, idx: list[int]) -> list[Any]:
        return [_canon(ds[i]) for i in idx]


def _ints(i: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) + 1000 * i + 7) % 250


LAYOUTS = {
    "fixed": Layout({"shape": (4,), "dtype": "int32"}, lambda i: {"record": _ints(i, 4)}, "data"),
    "bytes": Layout(
        {"shape": None}, lambda i: {"record": bytes(_ints(i, 3 + i % 5).astype(np.uint8))}, "data"
    ),
    "str": Layout(
        {"records": False, "fields": {"f": "str"}},
        lambda i: {"f": f"text {i} " * (1 + i % 3)},
        "field.f",
    ),
    "json": Layout(
        {"records": False, "fields": {"f": "json"}},
        lambda i: {"f": {"i": i, "xs": list(range(i % 4))}},
        "field.f",
    ),
    "ragged": Layout(
        {"shape": (None,), "dtype": "int32"}, lambda i: {"record": _ints(i, 1 + i % 4)}, "data"
    ),
    "tokens": Layout(
        {"records": False, "fields": {"tokens": ("int32", (None,))}},
        lambda i: {"tokens": _ints(i, 2 + i % 3)},
        "field.tokens",
        windows=True,
    ),
}


def _target(path: Path, layout: Layout) -> Path:
    return path / read_index(str(path)).shards[0].files[layout.role].path


def _flip(file: Path) -> None:
    """Four bytes changed in place, same size; the mtime moved on (coarse-mtime filesystems)."""
    data = bytearray(file.read_bytes())
    assert len(data) >= 4
    st = file.stat()
    at = len(data) // 2 - 2
    for k in range(at, at + 4):
        data[k] ^= 0x01
    with open(file, "r+b") as f:
        f.write(bytes(data))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def _swap(file: Path) -> None:
    """Another file of the same size renamed over the shard (how a restager replaces it)."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    new = file.with_name(file.name + ".new")
    new.write_bytes(bytes(data))
    os.replace(new, file)


CHANGES = {"rewrite": _flip, "truncate": _truncate, "swap": _swap}


def _read_in_child(ds: Any, layout: Layout, idx: list[int], q: Any) -> None:
    try:
        q.put(("ok", layout.read(ds, idx)))
    except DatasetError as exc:
        q.put(("error", str(exc)))
    except BaseException as exc:  # anything else is a failure of the test, reported
        q.put(("other", f"{type(exc).__name__}: {exc}"))


def _forked_read(ds: Any, layout: Layout, idx: list[int]) -> tuple[str, Any]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(ds, layout, idx, q))
    child.start()
    try:
        got = q.get(timeout=60)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return got


@pytest.mark.parametrize("where", ["main", "forked"])
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_shard_changed_while_open_is_never_served(
    tmp_path: Path, name: str, change: str, where: str
) -> None:
    """Found (item 7): typed columns, bytes-layout and TokenWindows shards rewritten in place
    were served with no error, and forked workers re-mapping a shard checked only its size.
    Now every layout, in the main process and in a forked worker: a shard rewritten in place,
    truncated or swapped by rename after the dataset was opened and read is an error naming
    it, or (a swap, where this process still maps the old file) the original records; never
    the new bytes."""
    layout = LAYOUTS[name]
    path = tmp_path / name
    layout.write(path)
    ds = layout.open(path)
    idx = layout.first(ds)
    want = layout.read(ds, idx)  # opened, mapped and verified
    assert len(read_index(str(path)).shards) >= 2
    file = _target(path, layout)
    CHANGES[change](file)
    named = re.escape(str(file)) + r": shard 0 file"
    if where == "forked":
        kind, got = _forked_read(ds, layout, idx)
        assert kind == "error", got
        assert re.search(named, got), got
        return
    try:
        got = layout.read(ds, idx)
    except DatasetError as exc:
        assert re.search(named, str(exc)), str(exc)
    else:  # only a swap may be served: from the old file, still mapped here
        assert change == "swap" and got == want
    ds.close()  # reopened: the new file itself is checked
    with pytest.raises(DatasetError, match=named):
        layout.read(ds, idx)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_flipped_bytes_are_an_error_naming_the_shard_by_default(tmp_path: Path, name: str) -> None:
    """Found (item 8): four flipped bytes were read silently unless verify=True. Now every file
    is checked against its CRC32C before its first record is served (verify="first-use", the
    default): an error naming the file; other shards are served; verify=False reads as is."""
    layout = LAYOUTS[name]
    path = tmp_path / name
    layout.write(path)
    clean = layout.read(layout.open(path), layout.first(layout.open(path)))
    file = _target(path, layout)
    _flip(file)
    ds = layout.open(path)
    last = len(ds) - 1
    layout.read(ds, [last])  # another shard: served
    with pytest.raises(DatasetError, match=re.escape(str(file)) + r": shard 0 file is corrupt"):
        layout.read(ds, layout.first(ds))
    with pytest.raises(DatasetError, match=r"shard 0 file is corrupt"):  # every time
        layout.read(ds, layout.first(ds)[:1])
    unchecked = layout.open(path, verify=False)
    try:
        got = layout.read(unchecked, layout.first(unchecked))
    except DatasetError as exc:  # a decoding error (str/json) may still catch it
        assert "is corrupt" not in str(exc)
    else:
        assert got != clean


def test_verify_option_is_checked(tmp_path: Path) -> None:
    LAYOUTS["fixed"].write(tmp_path / "d")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="verify must be one of"):
            MemmapDataset(tmp_path / "d", verify=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ descriptor budget (item 12)
def _replicate(src: Path, dst: Path, shards: int) -> None:
    """``dst``: ``shards`` copies of ``src``'s one shard (tiny files; no fsync per file)."""
    index = read_index(str(src))
    assert len(index.shards) == 1
    one = index.shards[0]
    dst.mkdir()
    entries = []
    for s in range(shards):
        files = {}
        for role, info in one.files.items():
            rel = f"s{s:05d}-{info.path}"
            shutil.copyfile(src / info.path, dst / rel)
            files[role] = type(info)(rel, info.bytes, info.crc32c)
        entries.append(Shard(one.records, files))
    write_index(str(dst), Index(index.layout, index.fields, entries, index.extra))


_UNDER_LIMIT = """
import resource, sys
import numpy as np
from feedpipe import MemmapDataset, TokenWindows
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
for path in sys.argv[1:]:
    ds = MemmapDataset(path)
    for a in range(0, len(ds), 97):
        ds.read_batch(np.arange(a, min(a + 97, len(ds))))
    ds.read_batch(np.random.default_rng(0).permutation(len(ds)))
    if "tokens" in ds.fields:
        tw = TokenWindows(ds, block_size=3)
        tw.read_batch(np.arange(len(tw)))
print("read", len(sys.argv) - 1)
"""


def test_hundreds_of_shards_of_every_layout_fit_a_256_descriptor_limit(tmp_path: Path) -> None:
    """Found (item 12): 400 typed-column shards or 2,000 bytes-layout shards hit EMFILE under a
    1,024 limit (one descriptor per shard file kept open). Now files are mapped and their
    descriptors closed: 640 shards of each layout read whole under a limit of 256."""
    typed = tmp_path / "typed1"
    with MemmapWriter(
        typed,
        shape=(2,),
        dtype="int16",
        fields={"s": "str", "j": "json", "tokens": ("int32", (None,))},
    ) as w:
        for i in range(3):
            w.append(np.array([i, -i], np.int16), s=f"x{i}", j=[i], tokens=_ints(i, 2 + i))
    raw = tmp_path / "bytes1"
    with MemmapWriter(raw, shape=None) as w:
        for i in range(3):
            w.append(bytes([i]) * (i + 1))
    _replicate(typed, tmp_path / "typed", 640)
    _replicate(raw, tmp_path / "bytes", 640)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_UNDER_LIMIT),
            str(tmp_path / "typed"),
            str(tmp_path / "bytes"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "read 2"


def test_first_use_checks_are_shared_with_forked_workers(tmp_path: Path) -> None:
    """A file verified in the parent is not verified again by a forked worker (one process
    tree checks each file once), while a file the parent never read is verified by the worker
    that reads it first."""
    layout = LAYOUTS["str"]
    layout.write(tmp_path / "d")
    ds = layout.open(tmp_path / "d")
    layout.read(ds, layout.first(ds))
    flags = ds._verified["field.f"]
    assert flags[0] and not flags[1]
    kind, got = _forked_read(ds, layout, [len(ds) - 1])
    assert kind == "ok", got
    assert flags[len(ds.index.shards) - 1]  # set by the child, seen here
    assert json.dumps(got)


@pytest.mark.parametrize("change", ["rewrite", "truncate"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_without_inotify_a_changed_shard_is_found_by_stat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, change: str
) -> None:
    """Out of inotify watches (or none to be had): every layout's open files are stat'ed per
    read instead, and a truncation or an in-place rewrite (new mtime, CRC32C differs) is still
    an error naming the file."""
    from feedpipe.datasets import _shard_guard

    monkeypatch.setattr(_shard_guard.watcher(), "add", lambda *a: -1)
    layout = LAYOUTS[name]
    path = tmp_path / name
    layout.write(path)
    ds = layout.open(path)
    idx = layout.first(ds)
    layout.read(ds, idx)
    file = _target(path, layout)
    CHANGES[change](file)
    with pytest.raises(DatasetError, match=re.escape(str(file)) + r": shard 0 file"):
        layout.read(ds, idx)


# ------------------------------------------------------------------------------ ShardSpace
def _no_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ShardSpace checks with stat per batch, as when out of inotify watches."""
    from feedpipe.datasets._gather import ShardSpace

    real = ShardSpace.create.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        ShardSpace, "create", classmethod(lambda cls, *a: real(cls, *a, watch=False))
    )


@pytest.mark.parametrize("watch", [True, False])
def test_mapped_shard_rewritten_in_place_with_the_same_size_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch: bool
) -> None:
    """Found: only sizes were checked, so a mapped shard overwritten in place with other bytes
    of the same size (``cp`` over it), or truncated and extended back (a hole of zeros), was
    read silently: wrong records. Now a change seen on a mapped shard whose size still matches
    is checked against the index's CRC32C; a restore of the indexed bytes reads again."""
    if not watch:
        _no_watch(monkeypatch)
    x = _fixed(tmp_path / "d")
    ds = MemmapDataset(tmp_path / "d")
    assert ds._shard_space() is not None
    assert torch.equal(ds.read_batch([0, 3, 19]), torch.from_numpy(x[[0, 3, 19]]))
    shard = tmp_path / "d" / "shard-00000.data"
    good = shard.read_bytes()
    st = shard.stat()
    with open(shard, "r+b") as f:  # other bytes, same size
        f.write(np.full(2048, 77, np.int32).tobytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse-mtime filesystems
    with pytest.raises(DatasetError, match=r"shard-00000\.data: shard 0 file was rewritten"):
        ds.read_batch([5, 1])
    assert torch.equal(ds.read_batch([5, 19]), torch.from_numpy(x[[5, 19]]))  # other shards
    shard.write_bytes(good)  # restored: accepted again
    assert torch.equal(ds.read_batch([1, 0]), torch.from_numpy(x[[1, 0]]))
    with open(shard, "ab") as f:  # extended (a writer appending): the index no longer holds
        f.write(b"\0" * 4096)
    with pytest.raises(DatasetError, match=r"shard-00000\.data: shard 0 file is now 12288"):
        ds[1]
    os.truncate(shard, len(good))
    assert torch.equal(ds.read_batch([1, 0]), torch.from_numpy(x[[1, 0]]))
    os.truncate(shard, 0)  # truncated, then extended back: zeros where the records were
    os.truncate(shard, len(good))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    with pytest.raises(DatasetError, match=r"shard-00000\.data: shard 0 file was rewritten"):
        ds[0]


@pytest.mark.parametrize("watch", [True, False])
def test_mapped_shard_renamed_over_keeps_reading_the_old_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch: bool
) -> None:
    """docs/concepts/staging.md: a shard replaced by rename leaves a running reader on the old
    file's bytes until it reopens the dataset. Found: without inotify (out of watches), the
    stat per batch looked at the new file and refused every batch of that shard."""
    if not watch:
        _no_watch(monkeypatch)
    x = _fixed(tmp_path / "d")
    ds = MemmapDataset(tmp_path / "d")
    assert torch.equal(ds.read_batch([2, 3]), torch.from_numpy(x[[2, 3]]))
    shard = tmp_path / "d" / "shard-00001.data"
    new = tmp_path / "d" / "new"
    new.write_bytes(b"\1" * 100)
    os.replace(new, shard)
    assert torch.equal(ds.read_batch([3, 2, 0]), torch.from_numpy(x[[3, 2, 0]]))
    ds.close()  # reopened: the new file is seen, and refused by size
    with pytest.raises(DatasetError, match=r"shard-00001\.data: shard 1 file is 100 bytes"):
        ds.read_batch([2])


def test_at_the_inotify_watch_limit_the_rest_are_checked_by_stat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of inotify watches (``inotify_add_watch`` fails, ENOSPC) part way through the shards:
    the watched ones and the rest (stat per batch) both name a truncated shard."""
    from feedpipe.datasets import _shard_guard

    x = _fixed(tmp_path / "d")
    watcher = _shard_guard.watcher()
    real = watcher.add
    left = [2]

    def add(path: str, dirty: list[int], sid: int) -> int:
        left[0] -= 1
        return real(path, dirty, sid) if left[0] >= 0 else -1

    monkeypatch.setattr(watcher, "add", add)
    ds = MemmapDataset(tmp_path / "d")
    assert torch.equal(ds.read_batch(np.arange(20)), torch.from_numpy(x))  # 10 shards mapped
    space = ds._shard_space()
    guard = space.guard if space is not None else None
    assert guard is not None and guard._unwatched.sum() == 8 and len(guard._wds) == 2
    for sid in (0, 9):  # the first shard mapped is watched, the last is not
        os.truncate(tmp_path / "d" / f"shard-{sid:05d}.data", 4096)
        with pytest.raises(DatasetError, match=rf"shard-{sid:05d}\.data: shard {sid} file is now"):
            ds.read_batch([2 * sid + 1])
    assert torch.equal(ds.read_batch([5, 7]), torch.from_numpy(x[[5, 7]]))


def _swap_then_truncate_old(root: str, q: Any) -> None:
    ds = MemmapDataset(root)
    ds.read_batch([2, 3])  # shard 1 mapped (and watched)
    shard = os.path.join(root, "shard-00001.data")
    os.rename(shard, shard + ".old")
    with open(shard + ".new", "wb") as f:
        f.write(b"\0" * os.path.getsize(shard + ".old"))  # same size as the index says
    os.rename(shard + ".new", shard)
    os.truncate(shard + ".old", 0)  # the file still mapped loses its pages
    try:
        ds.read_batch([2, 3])
        q.put("read")
    except DatasetError as exc:
        q.put(str(exc))


def test_mapped_file_truncated_after_its_path_was_swapped_is_an_error_not_sigbus(
    tmp_path: Path,
) -> None:
    """Found: the watch's event led to a stat of the path, which named a new file of the right
    size, so the truncated file still mapped was read: SIGBUS killed the process. Now the
    watch is on the mapped file itself and a change to it that cannot be checked is an error."""
    _fixed(tmp_path / "d")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_swap_then_truncate_old, args=(str(tmp_path / "d"), q))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, f"the reader died (exit code {child.exitcode}; -7 is SIGBUS)"
    got = q.get(timeout=10)
    assert "shard-00001.data: shard 1 file was modified while mapped" in got


def _version(path: Path, base: int, n: int, overwrite: bool) -> None:
    """A dataset of ``n`` records (1024 int32 of ``base + i``, and a str field), 2 per shard."""
    with MemmapWriter(
        path,
        shape=(1024,),
        dtype="int32",
        shard_bytes=8192,
        fields={"s": "str"},
        overwrite=overwrite,
    ) as w:
        for i in range(n):
            w.append(np.full(1024, base + i, np.int32), s=f"r{base + i:04d}")


@pytest.mark.parametrize("read", ["auto", "pread"])
def test_a_dataset_rewritten_under_an_open_reader_is_never_mixed_with_the_old_index(
    tmp_path: Path, read: str
) -> None:
    """Found: a dataset rewritten in place (``MemmapWriter(overwrite=True)``, shards of the same
    sizes) under an open MemmapDataset: the shards it had not opened yet were the new version's,
    read with the old index: new records under old indices, silently. Now opening a shard
    checks that ``index.json`` is still the file the dataset was opened with; the shards it
    already holds keep their old bytes (the writer unlinks them), and reopening reads the new
    version."""
    root = tmp_path / "d"
    _version(root, 0, 20, overwrite=False)
    old = MemmapDataset(root, read=read)
    first = old.read_batch([0, 1])
    assert first["data"][:, 0].tolist() == [0, 1] and first["s"] == ["r0000", "r0001"]
    _version(root, 100, 30, overwrite=True)
    got = old.read_batch([1, 0])
    assert got["data"][:, 0].tolist() == [1, 0] and got["s"] == ["r0001", "r0000"]
    with pytest.raises(DatasetError, match=r"rewritten since it was opened.*shard 5 cannot"):
        old.read_batch([5])
    with pytest.raises(DatasetError, match=r"rewritten since it was opened"):
        old[7]
    new = MemmapDataset(root, read=read)
    assert new.read_batch([5])["s"] == ["r0105"] and len(new) == 30
