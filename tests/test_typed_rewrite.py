"""Every file a typed :class:`~feedpipe.MemmapDataset` reads has the rewrite check of the fixed
records' data file (:mod:`feedpipe.datasets._shard_guard`): rewritten in place (same size,
other bytes) or truncated after the dataset has read it, the next read is a
:class:`DatasetError` naming the file, through ``read_batch``, ``__getitem__`` and a
:class:`~feedpipe.MixedDataset` of typed members; a restore of the indexed bytes reads again.

Found (atk7): side fields (``.label``) and offsets (``.tokens.offsets``) are read whole once and
kept in memory, and were never checked again: their rewrite went unseen."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.errors import DatasetError

FIELDS: dict[str, Any] = {"tokens": ("int32", (None,)), "label": "int64", "text": "str"}
N = 6
# (layout, file suffix): every file kind each layout reads
KINDS = [
    ("fixed", "data"),
    ("fixed", "label"),
    ("fixed", "tokens"),
    ("fixed", "tokens.offsets"),
    ("fixed", "text"),
    ("fixed", "text.offsets"),
    ("bytes", "data"),
    ("bytes", "offsets"),
    ("bytes", "label"),
    ("bytes", "tokens.offsets"),
]


def _write(path: Path, layout: str) -> MemmapDataset:
    kw: dict[str, Any] = {"shape": (4,), "dtype": "int32"} if layout == "fixed" else {}
    with MemmapWriter(path, fields=FIELDS, shard_bytes=1 << 20, **kw) as w:
        for i in range(N):
            rec = np.arange(4, dtype=np.int32) + i
            data = rec if layout == "fixed" else rec.tobytes()[: 4 + 4 * (i % 3)]
            w.append(data, tokens=np.arange(i % 3 + 1, dtype=np.int32), label=i, text=f"t{i}")
    return MemmapDataset(path)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape"):
        return bool(a.shape == b.shape and (a == b).all())
    return bool(a == b)


def _change(path: Path, how: str) -> None:
    st = path.stat()
    if how == "truncated":
        os.truncate(path, st.st_size - 1)
        return
    with open(path, "r+b") as f:  # other bytes, the same size
        head = f.read(8)
        f.seek(0)
        f.write(bytes(255 - b for b in head))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse-mtime filesystems


def _reader(tmp_path: Path, layout: str, via: str) -> tuple[Any, Any, Path, list[Any]]:
    """``(read, close, the changed member's directory, what read returns before)``."""
    one = _write(tmp_path / "one", layout)
    idx = np.arange(N, dtype=np.int64)
    if via == "read_batch":

        def read() -> Any:
            return one.read_batch(idx)

        return read, one.close, tmp_path / "one", [read()]
    if via == "getitem":

        def read_items() -> Any:
            return [one[i] for i in range(N)]

        return read_items, one.close, tmp_path / "one", [read_items()]
    other = _write(tmp_path / "other", layout)
    mix = MixedDataset({"other": other, "one": one}, epoch_samples=2 * N, seed=3)
    member, _ = mix.locate(np.arange(2 * N, dtype=np.int64))
    assert (member == 1).any() and (member == 0).any()
    mine = np.flatnonzero(member == 1).astype(np.int64)

    def read_mix() -> Any:
        return mix.read_batch(mine)

    def close() -> None:
        one.close()
        other.close()

    return read_mix, close, tmp_path / "one", [read_mix()]


@pytest.mark.parametrize("how", ["same-size", "truncated"])
@pytest.mark.parametrize("via", ["read_batch", "getitem", "mixed", "no-inotify"])
@pytest.mark.parametrize("kind", KINDS, ids=["-".join(k) for k in KINDS])
def test_every_file_rewritten_after_a_read_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: tuple[str, str], via: str, how: str
) -> None:
    layout, suffix = kind
    if via == "no-inotify":  # out of watches (or none to be had): stat per read finds it
        from feedpipe.datasets import _shard_guard

        monkeypatch.setattr(_shard_guard.watcher(), "add", lambda *a: -1)
        via = "read_batch"
    read, close, where, before = _reader(tmp_path, layout, via)
    try:
        path = where / f"shard-00000.{suffix}"
        good = path.read_bytes()
        _change(path, how)
        name = re.escape(f"shard-00000.{suffix}: shard 0 file")
        with pytest.raises(DatasetError, match=name):
            read()
        with pytest.raises(DatasetError, match=name):  # and again: never served
            read()
        path.write_bytes(good)  # the indexed bytes restored: read again, as before
        assert _same(read(), before[0])
    finally:
        close()


def _read_in_child(ds: MemmapDataset, out: Any) -> None:
    try:
        ds.read_batch(np.arange(N, dtype=np.int64))
        out.put("served")
    except DatasetError as exc:
        out.put(f"refused: {exc}")


@pytest.mark.parametrize("suffix", ["label", "tokens.offsets"])
def test_a_forked_worker_checks_the_files_its_parent_read_whole(
    tmp_path: Path, suffix: str
) -> None:
    """A forked worker inherits its parent's side fields and offsets in memory; the file
    rewritten since the dataset was opened is refused in the child too (it checks every
    file it uses for itself: stamp, then CRC32C), naming the file."""
    ds = _write(tmp_path / "d", "fixed")
    ds.read_batch(np.arange(N, dtype=np.int64))  # read whole and kept, here
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    path = tmp_path / "d" / f"shard-00000.{suffix}"
    _change(path, "same-size")
    child = ctx.Process(target=_read_in_child, args=(ds, out))
    child.start()
    try:
        got = out.get(timeout=60)
    finally:
        child.join(timeout=60)
    assert got.startswith("refused: ") and f"shard-00000.{suffix}: shard 0 file" in got, got
    ds.close()


def test_a_shard_closed_under_its_reader_is_a_dataset_error_naming_it(tmp_path: Path) -> None:
    """A reader that pinned a shard while the dataset's ``close()`` closed it (atk7's racing
    closes) gets a :class:`DatasetError` naming the file when it maps it, never an ``OSError``
    (EBADF from mapping the closed descriptor)."""
    ds = _write(tmp_path / "d", "bytes")
    reader = ds.column_reader()
    assert reader is not None
    files = reader.files.files("data")
    with files.use(0) as shard:
        files.close()  # what the dataset's close() does to every open shard
        with pytest.raises(DatasetError, match=r"shard-00000\.data: shard 0 file was closed"):
            files.rows(shard, 0)
    assert ds.read_batch(np.arange(N, dtype=np.int64))["label"].tolist() == list(range(N))
    ds.close()
