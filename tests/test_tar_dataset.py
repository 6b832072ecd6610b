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
