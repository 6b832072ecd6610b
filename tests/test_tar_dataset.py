"""feedpipe.TarDataset: WebDataset .tar shards read in place (local and S3), grouped by key."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import tar_shard as _shard

import feedpipe
from feedpipe import DataLoader, DatasetError, MemmapDataset, TarDataset
from feedpipe.datasets.tar import expand_shards


def _write_tar(path: Path, members: list[tuple[str, bytes]], links: bool = False) -> None:
    with tarfile.open(path, "w") as tar:
        if links:
            d = tarfile.TarInfo("dir")
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
            s = tarfile.TarInfo("dir/evil.jpg")
            s.type, s.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(s)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _shards(tmp: Path, n_shards: int = 3, per: int = 5) -> list[str]:
    out = []
    for s in range(n_shards):
        members = []
        for i in range(per):
            key = f"sample{s:02d}{i:03d}"
            members += [(f"{key}.jpg", os.urandom(100 + i)), (f"{key}.cls", str(i).encode())]
        path = tmp / f"shard-{s:03d}.tar"
        _write_tar(path, members, links=s == 0)
        out.append(str(path))
    return out


def test_samples_group_members_by_key_in_order(tmp_path: Path) -> None:
    shards = _shards(tmp_path)
    ds = TarDataset(shards)
    assert len(ds) == 15
    assert ds.keys()[:2] == ["sample00000", "sample00001"]
    with tarfile.open(shards[1]) as tar:
        want = tar.extractfile("sample01003.jpg").read()  # type: ignore[union-attr]
    got = ds[8]
    assert got["__key__"] == "sample01003" and got["__url__"] == shards[1]
    assert got["jpg"] == want and got["cls"] == b"3"
    assert set(got) == {"__key__", "__url__", "jpg", "cls"}  # the links and dirs are skipped


def test_brace_patterns_expand_like_webdataset(tmp_path: Path) -> None:
    _shards(tmp_path)
    pattern = str(tmp_path / "shard-{000..002}.tar")
    assert expand_shards(pattern) == [str(tmp_path / f"shard-{i:03d}.tar") for i in range(3)]
    assert len(TarDataset(pattern)) == 15
    with pytest.raises(ValueError, match="empty"):
        expand_shards("x-{5..1}.tar")


def test_a_brace_pattern_with_a_mistyped_bound_is_refused_at_once() -> None:
    """``{0000..9999999999}`` built a list of 10**10 names (all the RAM) before any error."""
    with pytest.raises(ValueError, match=r"more than 1,000,000 shards"):
        expand_shards("s-{0..1000}-{0..999}.tar")  # 1,001,000 (checked before any list)
    assert len(expand_shards("s-{0..99}-{0..9}.tar")) == 1000


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_with_shuffle_and_transform_reads_every_sample_once(
    tmp_path: Path, workers: int
) -> None:
    ds = TarDataset(_shards(tmp_path), transform=lambda s: int(s["cls"]) + 100 * len(s["jpg"]))
    loader = DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(1),
    )
    got = sorted(int(x) for b in loader for x in b)
    want = sorted(int(ds[i]) for i in range(len(ds)))
    assert got == want


def test_truncated_shard_names_shard_and_member(tmp_path: Path) -> None:
    shards = _shards(tmp_path, n_shards=1)
    data = Path(shards[0]).read_bytes()
    Path(shards[0]).write_bytes(data[:1600])  # cut inside the first sample's jpg data
    with pytest.raises(DatasetError, match=r"shard-000\.tar.* truncated"):
        TarDataset(shards)
    Path(shards[0]).write_bytes(data[:2048])  # cut exactly at a member boundary
    with pytest.raises(DatasetError, match=r"shard-000\.tar ends without .*truncated"):
        TarDataset(shards)


def test_shard_truncated_after_indexing_is_a_short_read_error(tmp_path: Path) -> None:
    shards = _shards(tmp_path, n_shards=1)
    ds = TarDataset(shards)
    os.truncate(shards[0], 1024)
    with pytest.raises(DatasetError, match="short read"):
        ds[len(ds) - 1]


def test_compressed_tar_is_refused_with_the_reason(tmp_path: Path) -> None:
    shards = _shards(tmp_path, n_shards=1)
    gz = tmp_path / "c.tar.gz"
    gz.write_bytes(gzip.compress(Path(shards[0]).read_bytes()))
    with pytest.raises(DatasetError, match=r"c\.tar\.gz is a compressed tar"):
        TarDataset(str(gz))


def test_not_a_tar_and_missing_shard(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DatasetError, match=r"junk\.tar"):
        TarDataset(str(junk))
    with pytest.raises(DatasetError, match=r"nope\.tar"):
        TarDataset(str(tmp_path / "nope.tar"))


def test_duplicate_field_in_a_sample_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    _write_tar(path, [("a.jpg", b"1"), ("a.jpg", b"2")])
    with pytest.raises(DatasetError, match=r"dup\.tar: sample 'a' has two 'jpg' members"):
        TarDataset(str(path))


def test_index_out_of_range(tmp_path: Path) -> None:
    ds = TarDataset(_shards(tmp_path, n_shards=1))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_s3_shards_read_through_fsspec(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    local = _shards(tmp_path, n_shards=2)
    fs = fsspec.filesystem("s3", **opts)
    for p in local:
        fs.put(p, f"{bucket}/wds/{Path(p).name}")
    ds = TarDataset(f"s3://{bucket}/wds/shard-{{000..001}}.tar", storage_options=opts)
    ref = TarDataset(local)
    assert len(ds) == len(ref) == 10
    for i in (0, 7, 9):
        a, b = ds[i], ref[i]
        assert a["jpg"] == b["jpg"] and a["cls"] == b["cls"] and a["__key__"] == b["__key__"]
    loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=lambda b: [s["cls"] for s in b])
    assert sorted(x for b in loader for x in b) == sorted(ref[i]["cls"] for i in range(10))


# ------------------------------------------------------------------------------ TarDataset
def _reg(name: str, data: bytes, **pax: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.pax_headers = pax
    return info, data


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> str:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return str(path)


def test_negative_pax_size_names_shard_and_member(tmp_path: Path) -> None:
    """Found: a pax ``size=-5`` indexed fine, then every read was a bare OSError(EINVAL)."""
    shard = _tar(tmp_path / "neg.tar", [_reg("a.txt", b"hello", size="-5"), _reg("b.txt", b"y")])
    with pytest.raises(DatasetError, match=r"neg\.tar.*'a\.txt'.*negative size"):
        TarDataset(shard)


def test_huge_pax_size_names_the_shard(tmp_path: Path) -> None:
    """Found: a pax size beyond a file offset raised a bare ValueError from tarfile's seek."""
    shard = _tar(tmp_path / "huge.tar", [_reg("a.txt", b"hello", size=str(10**30))])
    with pytest.raises(DatasetError, match=r"huge\.tar"):
        TarDataset(shard)


def test_sparse_members_are_refused_naming_shard_and_member(tmp_path: Path) -> None:
    """Found: a GNU sparse member read as b"" (silently wrong bytes); a pax sparse member was
    reported as a truncated shard."""
    info = tarfile.TarInfo("g.bin")
    info.size, info.type = 4, tarfile.GNUTYPE_SPARSE
    raw = info.tobuf(format=tarfile.GNU_FORMAT) + b"abcd".ljust(512, b"\0") + b"\0" * 1024
    gnu = tmp_path / "gnu.tar"
    gnu.write_bytes(raw)
    with pytest.raises(DatasetError, match=r"gnu\.tar.*'g\.bin' is sparse"):
        TarDataset(str(gnu))
    sp, _ = _reg("s.bin", b"abcd")
    sp.pax_headers = {"GNU.sparse.size": "100000", "GNU.sparse.map": "0,4"}
    sp.pax_headers |= {"GNU.sparse.numblocks": "1", "GNU.sparse.offset": "0"}
    shard = _tar(tmp_path / "pax.tar", [(sp, b"abcd"), _reg("t.txt", b"zz")])
    with pytest.raises(DatasetError, match=r"pax\.tar.*'s\.bin' is sparse"):
        TarDataset(shard)


def test_shard_replaced_after_indexing_is_an_error_naming_it(tmp_path: Path) -> None:
    """Found: a shard rewritten with different bytes of the same length after indexing gave
    other members' bytes, silently."""
    path = tmp_path / "s.tar"
    _tar(path, [_reg("a.txt", b"A" * 100), _reg("b.txt", b"B" * 50)])
    ds = TarDataset(str(path))
    st = path.stat()
    _tar(path, [_reg("a.txt", b"A" * 50), _reg("b.txt", b"B" * 100)])  # same length
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match=r"s\.tar changed after it was indexed"):
        ds[1]


def test_odd_but_valid_tars(tmp_path: Path) -> None:
    """Guards: dots in folder names, 0-byte members, an empty tar, only directories,
    non-adjacent duplicate keys (two samples, as WebDataset), a symlinked shard."""
    d = tarfile.TarInfo("dir")
    d.type = tarfile.DIRTYPE
    main = _tar(
        tmp_path / "m.tar",
        [
            _reg("a.b/c.jpg", b"x"),
            _reg("a.b/c.cls", b""),
            _reg("k.txt", b"1"),
            _reg("z.txt", b"2"),
            _reg("k.txt", b"3"),
        ],
    )
    link = tmp_path / "link.tar"
    link.symlink_to(main)
    empty, dirs = _tar(tmp_path / "e.tar", []), _tar(tmp_path / "d.tar", [(d, None)])
    ds = TarDataset([str(link), empty, dirs])
    assert ds.keys() == ["a.b/c", "k", "z", "k"]
    assert ds[0]["jpg"] == b"x" and ds[0]["cls"] == b"" and ds[3]["txt"] == b"3"
    assert ds[0]["__url__"] == str(link)


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_tar_in_process_workers(tmp_path: Path, ctx: str) -> None:
    shard = _tar(tmp_path / "w.tar", [_reg(f"{i:03d}.cls", str(i).encode()) for i in range(20)])
    loader = DataLoader(
        TarDataset(shard),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=ctx,
        collate_fn=_fields,
    )
    got = [x for b in loader for x in b]
    assert got == [str(i).encode() for i in range(20)]


def _fields(batch: list[dict[str, Any]]) -> list[bytes]:
    return [s["cls"] for s in batch]


def test_hostile_s3_shards_name_their_url(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    neg = _tar(tmp_path / "neg.tar", [_reg("a.txt", b"hello", size="-5")])
    huge = _tar(tmp_path / "huge.tar", [_reg("a.txt", b"hello", size=str(10**30))])
    for local in (neg, huge):
        url = f"s3://{bucket}/bad/{Path(local).name}"
        fs.put(local, url)
        with pytest.raises(DatasetError, match=rf"{url}"):
            TarDataset(url, storage_options=opts)


def test_members_webdataset_skips_are_skipped(tmp_path: Path) -> None:
    """Found: a member without an extension (``README``) or a macOS ``._`` dot file became a
    sample with field ``""`` (or an extra field), where WebDataset skips it."""
    shard = _tar(
        tmp_path / "mac.tar",
        [
            _reg("README", b"r"),
            _reg("._0001.jpg", b"junk"),
            _reg("d/LICENSE", b"l"),
            _reg("0001.jpg", b"J"),
            _reg("0001.cls", b"1"),
            _reg("x/y.seg.png", b"P"),
        ],
    )
    ds = TarDataset(shard)
    assert ds.keys() == ["0001", "x/y"]
    assert ds[0]["jpg"] == b"J" and ds[1]["seg.png"] == b"P"


# ------------------------------------------------------------------------------ TarDataset
def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _fields_txt(batch: list[dict[str, Any]]) -> list[bytes]:
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
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=_fields_txt)
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


def _sample(i: int) -> dict[str, bytes]:
    return {
        "jpg": bytes([i]) * (3 + i),
        "txt": f"a cät number {i}\n".encode(),
        "json": json.dumps({"i": i, "tags": ["x"] * i, "f": i / 2}).encode(),
        "cls": str(i % 3).encode(),
        "seg": bytes(range(i)),
    }


def test_tar_txt_json_and_unknown_members_become_typed_columns(tmp_path: Path) -> None:
    _shard(tmp_path / "s-0.tar", [(f"{i:04d}", _sample(i)) for i in range(4)])
    _shard(tmp_path / "s-1.tar", [(f"{i:04d}", _sample(i)) for i in range(4, 7)])
    res = feedpipe.convert(str(tmp_path / "s-{0..1}.tar"), tmp_path / "o")
    assert res.records == 7
    ds = MemmapDataset(tmp_path / "o")
    for i in range(7):
        r = ds[i]
        assert bytes(r["data"].numpy()) == bytes([i]) * (3 + i)
        assert r["txt"] == f"a cät number {i}\n"
        assert r["json"] == {"i": i, "tags": ["x"] * i, "f": i / 2}
        assert int(r["cls"]) == i % 3
        assert bytes(r["seg"].numpy().astype(np.uint8)) == bytes(range(i))


def test_tar_typed_columns_same_bytes_for_1_and_2_workers(tmp_path: Path) -> None:
    root = tmp_path / "wds"
    root.mkdir()
    for s in range(3):
        _shard(root / f"s{s}.tar", [(f"{s}{i:03d}", _sample(s * 4 + i)) for i in range(4)])
    feedpipe.convert(root, tmp_path / "o1", workers=1)
    feedpipe.convert(root, tmp_path / "o2", workers=2)
    files = sorted(p.name for p in (tmp_path / "o1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "o2").iterdir())
    for name in files:
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()


def test_tar_invalid_utf8_txt_names_shard_and_member(tmp_path: Path) -> None:
    good = _sample(1)
    bad = dict(_sample(2), txt=b"caf\xe9")
    _shard(tmp_path / "t.tar", [("k1", good), ("k2", bad)])
    with pytest.raises(DatasetError, match=r"t\.tar.*'k2\.txt'.*UTF-8"):
        feedpipe.convert(tmp_path / "t.tar", tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists()


def test_tar_invalid_json_names_shard_and_member(tmp_path: Path) -> None:
    for name, payload in (("j.tar", b"{not json"), ("n.tar", b'{"x": NaN}')):
        _shard(tmp_path / name, [("k1", dict(_sample(1), json=payload))])
        with pytest.raises(DatasetError, match=rf"{name[0]}\.tar.*'k1\.json'.*JSON"):
            feedpipe.convert(tmp_path / name, tmp_path / "o")
        assert not (tmp_path / "o").exists()


def test_tar_non_integer_cls_and_bad_field_names_are_refused(tmp_path: Path) -> None:
    _shard(tmp_path / "c.tar", [("k1", {"jpg": b"x", "cls": b"cat"})])
    with pytest.raises(DatasetError, match=r"c\.tar.*'k1\.cls'.*integer"):
        feedpipe.convert(tmp_path / "c.tar", tmp_path / "o")
    _shard(tmp_path / "d.tar", [("k1", {"jpg": b"x", "seg.png": b"y"})])
    with pytest.raises(DatasetError, match=r"d\.tar.*'k1\.seg\.png'.*cannot name a side field"):
        feedpipe.convert(tmp_path / "d.tar", tmp_path / "o")
    assert not (tmp_path / "o").exists()
