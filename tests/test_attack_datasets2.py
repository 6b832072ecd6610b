"""Adversarial review (attackd) of the newest dataset features: ShardSpace gathers, typed columns,
TokenWindows and TarDataset. Every finding is a test here, with its fix in the owning module."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import (
    DataLoader,
    DatasetError,
    DistributedSampler,
    MemmapDataset,
    MemmapWriter,
    TarDataset,
    TokenWindows,
)
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.testing import DatasetContractTests


# ------------------------------------------------------------------------------ TarDataset
def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _fields(batch: list[dict[str, Any]]) -> list[bytes]:
    return [s["txt"] for s in batch]


def test_s3_tar_shard_replaced_after_indexing_is_an_error_naming_the_url(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    """Found (known open bug): an S3 shard replaced under the same key (same size, other bytes)
    after indexing was read at the old offsets: silently wrong samples. Now the ETag indexed is
    checked when a reader opens the shard, and every read is conditional on it (If-Match)."""
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    url = f"s3://{bucket}/wds/s.tar"
    old = _tar_bytes([("a.txt", b"A" * 100), ("b.txt", b"B" * 50)])
    new = _tar_bytes([("a.txt", b"X" * 50), ("b.txt", b"Y" * 100)])
    assert len(old) == len(new)
    # replaced between indexing and the first read
    fs.pipe(url, old)
    ds = TarDataset(url, storage_options=opts)
    fs.pipe(url, new)
    with pytest.raises(DatasetError, match=rf"{url} changed after it was indexed"):
        ds[1]
    # replaced between two reads of the same open shard
    fs.pipe(url, old)
    ds = TarDataset(url, storage_options=opts)
    assert ds[0]["txt"] == b"A" * 100
    fs.pipe(url, new)
    with pytest.raises(DatasetError, match=rf"{url} changed after it was indexed"):
        ds[1]
    # in a worker process (the dataset is pickled; the worker opens the shard afresh)
    fs.pipe(url, old)
    ds = TarDataset(url, storage_options=opts)
    fs.pipe(url, new)
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=_fields)
    with pytest.raises(DatasetError, match=rf"{url} changed after it was indexed"):
        list(loader)


def test_indexing_a_remote_shard_skips_the_data_of_large_members(
    s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found: the module promised an index "from the tar headers only", but a remote shard was
    opened with s3fs's 50 MiB read-ahead: indexing downloaded whole shards. Now the index reads
    in ``INDEX_BLOCK`` blocks, and members larger than that are skipped, not downloaded."""
    import fsspec
    import s3fs.core

    from feedpipe.datasets import tar as tar_module

    bucket, opts = s3_bucket
    members = [(f"{i:03d}.bin", bytes([i]) * (1 << 20)) for i in range(8)]
    raw = _tar_bytes(members)
    fsspec.filesystem("s3", **opts).pipe(f"{bucket}/big.tar", raw)
    fetched: list[int] = []
    real = s3fs.core.S3File._fetch_range

    def counted(self: Any, start: int, end: int) -> bytes:
        fetched.append(end - start)
        return real(self, start, end)  # type: ignore[no-any-return]

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counted)
    monkeypatch.setattr(tar_module, "INDEX_BLOCK", 64 << 10)
    ds = TarDataset(f"s3://{bucket}/big.tar", storage_options=opts)
    assert len(ds) == 8 and sum(fetched) < len(raw) // 8, (sum(fetched), len(raw))
    assert ds[5]["bin"] == members[5][1]


def _tar_file(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
    return str(path)


def _special(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def test_tar_samples_are_grouped_exactly_as_webdataset_groups_them(tmp_path: Path) -> None:
    """The module promise "as WebDataset groups them", side by side with webdataset itself:
    dotted folders, upper-case and multi-dot extensions, dot files, names without extension,
    ``..`` and absolute member names (never extracted: only keys), links and devices (skipped),
    non-adjacent repeated keys, and a key whose members are split across two shards (two
    samples: WebDataset ends a sample at the end of each shard)."""
    wds = pytest.importorskip("webdataset")
    a = _tar_file(
        tmp_path / "a.tar",
        [
            ("a/b.c/d.e.jpg", b"1"),
            ("a/b.c/d.CLS", b"2"),
            ("X.JPG", b"3"),
            ("._x.jpg", b"4"),
            ("noext", b"5"),
            ("dir/.hidden.jpg", b"6"),
            ("../up.jpg", b"7"),
            ("/abs/x.jpg", b"8"),
            _special("hard.jpg", tarfile.LNKTYPE, "X.JPG"),
            _special("soft.jpg", tarfile.SYMTYPE, "/etc/passwd"),
            _special("dev.jpg", tarfile.CHRTYPE),
            _special("fifo.jpg", tarfile.FIFOTYPE),
            ("k.txt", b"a"),
            ("k.cls", b"b"),
            ("m.txt", b""),
            ("k.txt", b"c"),
            ("split.txt", b"d"),
        ],
    )
    b = _tar_file(tmp_path / "b.tar", [("split.cls", b"e"), ("y.a.b", b"f"), ("z.", b"g")])

    def fields(sample: dict[str, Any]) -> tuple[str, list[tuple[str, bytes]]]:
        return sample["__key__"], sorted((k, v) for k, v in sample.items() if k[:2] != "__")

    want = [fields(s) for s in wds.WebDataset([a, b], shardshuffle=False)]
    ds = TarDataset([a, b])
    assert [fields(ds[i]) for i in range(len(ds))] == want
    assert ("split", [("txt", b"d")]) in want and ("split", [("cls", b"e")]) in want


@pytest.mark.parametrize("size", [2**45, 2**62])
def test_tar_header_claiming_a_huge_long_name_names_the_shard(tmp_path: Path, size: int) -> None:
    """Found: a GNU long-name (or pax) header claiming terabytes made tarfile allocate a buffer
    of that size: a bare MemoryError (or the OOM killer), no shard named."""
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, size
    path = tmp_path / "long.tar"
    path.write_bytes(info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 2048)
    with pytest.raises(DatasetError, match=r"long\.tar"):
        TarDataset(str(path))


def test_local_tar_shard_rewritten_in_place_after_the_first_read_is_an_error(
    tmp_path: Path,
) -> None:
    """Found: the (size, mtime) check ran only when a reader first opened the shard; a shard
    rewritten in place (same size, other member layout) after that was read at the old offsets:
    another member's bytes, silently. A shard renamed over stays readable as it was."""
    path = tmp_path / "s.tar"
    path.write_bytes(_tar_bytes([("a.txt", b"A" * 100), ("b.txt", b"B" * 50)]))
    ds = TarDataset(str(path))
    assert ds[0]["txt"] == b"A" * 100
    new = _tar_bytes([("a.txt", b"X" * 50), ("b.txt", b"Y" * 100)])
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match=r"s\.tar changed after it was indexed"):
        ds[1]
    path.write_bytes(_tar_bytes([("a.txt", b"A" * 100), ("b.txt", b"B" * 50)]))
    ds = TarDataset(str(path))
    assert ds[0]["txt"] == b"A" * 100  # this thread's reader holds the file now
    (tmp_path / "t.tar").write_bytes(new)
    os.replace(tmp_path / "t.tar", path)
    assert ds[1]["txt"] == b"B" * 50


# ------------------------------------------------------------------------------ batch indices
def _fixed(path: Path, n: int = 20, shard_bytes: int = 8192) -> np.ndarray:
    """A fixed-layout dataset of ``n`` records of 1024 int32 (2 records per shard)."""
    x = np.repeat(np.arange(n, dtype=np.int32)[:, None], 1024, axis=1)
    with MemmapWriter(path, shape=(1024,), dtype="int32", shard_bytes=shard_bytes) as w:
        w.append_batch(x)
    return x


def _tokens(path: Path) -> None:
    with MemmapWriter(path, records=False, fields={"tokens": ("int32", (None,))}) as w:
        for doc in ([1, 2, 3], [], [4, 5, 6, 7, 8, 9]):
            w.append(tokens=doc)


@pytest.mark.parametrize("kind", ["memmap", "tokens"])
def test_batch_indices_refuse_bool_masks_and_uint64_beyond_int64(tmp_path: Path, kind: str) -> None:
    """Found: MemmapDataset.read_batch took a bool mask as indices 1 and 0 (while ds[True] is a
    TypeError), and a uint64 index of 2**64-1 wrapped to -1 and read the last record, silently
    (TokenWindows too)."""
    if kind == "memmap":
        _fixed(tmp_path / "d")
        ds: Any = MemmapDataset(tmp_path / "d")
    else:
        _tokens(tmp_path / "d")
        ds = TokenWindows(tmp_path / "d", block_size=2)
    n = len(ds)
    for mask in ([True, False, True], np.array([True, False]), torch.tensor([False, True])):
        with pytest.raises(TypeError, match="integers, got bool"):
            ds.read_batch(mask)
    for big in (np.array([0, 2**64 - 1], np.uint64), [2**63], np.array([2**63], np.uint64)):
        with pytest.raises(IndexError, match=str(int(np.asarray(big)[-1]))):
            ds.read_batch(big)
    assert torch.equal(ds.read_batch(np.array([n - 1], np.uint64)), ds.read_batch([-1]))
    assert torch.equal(ds.read_batch(np.array([-1, 0], np.int8)), ds.read_batch([n - 1, 0]))


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


# ------------------------------------------------------------------------------ typed columns
@pytest.mark.parametrize(
    ("value", "match"),
    [
        (10**5000, "cannot be stored as JSON.*digits"),
        ({"k": ["a\ud800"]}, "cannot be stored as JSON.*surrogates"),
    ],
    ids=["huge-int", "lone-surrogate"],
)
def test_json_values_that_cannot_be_encoded_name_record_and_field(
    tmp_path: Path, value: Any, match: str
) -> None:
    """Found: a huge int and a lone surrogate inside a JSON value escaped the writer as a bare
    ValueError / UnicodeEncodeError naming neither record nor field."""
    with MemmapWriter(tmp_path / "j", records=False, fields={"j": "json"}) as w:
        w.append(j={"ok": 1})
        with pytest.raises(DatasetError, match=rf"record 1: field 'j': {match}"):
            w.append(j=value)
        w.append(j=[2])
    assert MemmapDataset(tmp_path / "j").read_batch([0, 1])["j"] == [{"ok": 1}, [2]]


@pytest.mark.parametrize(
    "text",
    [b"NaN", b"[1,-Infinity]", b'{"a":Infinity}', b"[" * 100_000 + b"]" * 100_000],
    ids=["nan", "-inf", "inf", "deep"],
)
def test_json_constants_the_writer_refuses_are_refused_on_read(tmp_path: Path, text: bytes) -> None:
    """Found: a hostile data file (valid CRC) holding ``NaN``/``Infinity`` read back as floats,
    values the writer never stores (JSON has no such constants). Guard: JSON nested 100,000
    deep (the writer stops at 100) is an error naming the record, not a crash."""
    root = tmp_path / "j"
    with MemmapWriter(root, records=False, fields={"j": "json"}) as w:
        w.append(j=[1])
        w.append(j=2)
    data = b"[1]" + text
    (root / "shard-00000.j").write_bytes(data)
    (root / "shard-00000.j.offsets").write_bytes(np.array([0, 3, len(data)], "<u8").tobytes())
    doc = json.loads((root / "index.json").read_text())
    for info in doc["shards"][0]["files"].values():
        raw = (root / info["path"]).read_bytes()
        info["bytes"], info["crc32c"] = len(raw), to_hex(crc32c(raw))
    (root / "index.json").write_text(json.dumps(doc))
    ds = MemmapDataset(root, verify=True)
    assert ds[0]["j"] == [1]
    with pytest.raises(DatasetError, match=r"shard-00000\.j: record 1 \(shard 0\): json"):
        ds.read_batch([0, 1])


# ------------------------------------------------------------------------------ TokenWindows
class TestPaddedTokenWindowsContract(DatasetContractTests):
    """The dataset contract with ``drop_last=False`` (a padded last window), empty documents
    and shards, and windows crossing shards: only ``drop_last=True`` was run through it."""

    def make_dataset(self, tmp_path: Path) -> Any:
        rng = np.random.default_rng(7)
        with MemmapWriter(
            tmp_path / "c", records=False, fields={"tokens": ("int16", (None,))}, shard_bytes=30
        ) as w:
            for k in (5, 0, 0, 13, 1, 0, 22, 3):
                w.append(tokens=rng.integers(-(2**15), 2**15, k).astype(np.int16))
        tw = TokenWindows(tmp_path / "c", block_size=7, drop_last=False, pad_value=-1)
        assert tw.num_tokens % 7 and len(tw) == -(-tw.num_tokens // 7)
        return tw


def _window_loader(tw: TokenWindows, world: int, rank: int) -> DataLoader:
    sampler = DistributedSampler(tw, world, rank, seed=3, batch_size=2, pad=False)
    loader = DataLoader(tw, batch_size=2, sampler=sampler, num_workers=2, worker_type="thread")
    loader.sampler.set_epoch(2)
    return loader


def test_padded_windows_resume_exactly_and_elastically(tmp_path: Path) -> None:
    """drop_last=False through the loader + sampler state (as tests/test_token_windows.py for
    drop_last=True): the same world resumes batch for batch; 3 ranks stopped, 2 finish the
    epoch, and every window, the padded last one included, is read exactly once."""
    rng = np.random.default_rng(1)
    with MemmapWriter(
        tmp_path / "c", records=False, fields={"tokens": ("int32", (None,))}, shard_bytes=64
    ) as w:
        for k in rng.integers(0, 12, 30):
            w.append(tokens=np.arange(k, dtype=np.int32) + 1000 * len(w.shards))
    tw = TokenWindows(tmp_path / "c", block_size=7, drop_last=False, pad_value=-7)
    assert tw.num_tokens % 7 and (tw[len(tw) - 1] == -7).any()
    window_of = {bytes(tw[i].numpy()): i for i in range(len(tw))}
    assert len(window_of) == len(tw)
    taken: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(3):
        full = list(_window_loader(tw, 3, rank))
        loader = _window_loader(tw, 3, rank)
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        taken += [window_of[bytes(r.numpy())] for b in first for r in b]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        again = _window_loader(tw, 3, rank)
        again.load_state_dict(state)
        again.sampler.set_epoch(2)
        got = first + list(again)
        assert len(got) == len(full)
        for g, want in zip(got, full, strict=True):
            assert torch.equal(g, want)
    rest: list[int] = []
    for rank in range(2):
        loader = _window_loader(tw, 2, rank)
        loader.load_state_dict(state)
        loader.sampler.set_epoch(2)
        rest += [window_of[bytes(r.numpy())] for b in loader for r in b]
    assert sorted(taken + rest) == list(range(len(tw)))
