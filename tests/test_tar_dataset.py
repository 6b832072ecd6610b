"""feedpipe.TarDataset: WebDataset .tar shards read in place (local and S3), grouped by key."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from feedpipe import DataLoader, DatasetError, TarDataset
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
