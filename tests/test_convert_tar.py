"""``feedpipe convert`` from WebDataset ``.tar`` shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import tar_shard as _shard

import feedpipe
from feedpipe import DatasetError, MemmapDataset
from feedpipe.cli import main as cli_main


def _image(i: int) -> bytes:
    return bytes([i % 251]) * (10 + i)


def _shards(root: Path) -> None:
    root.mkdir()
    for s in range(2):
        _shard(
            root / f"train-{s:02d}.tar",
            [
                (
                    f"{s * 5 + k:06d}",
                    {"cls": str((s * 5 + k) % 3).encode(), "jpg": _image(s * 5 + k)},
                )
                for k in range(5)
            ],
        )


def test_tar_shards_cli_brace_pattern(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _shards(tmp_path / "wds")
    pattern = str(tmp_path / "wds" / "train-{00..01}.tar")
    rc = cli_main(["convert", pattern, str(tmp_path / "o"), "--no-progress", "--workers", "2"])
    assert rc == 0, capsys.readouterr().err
    ds = MemmapDataset(tmp_path / "o")
    assert len(ds) == 10
    for i in range(10):
        assert bytes(ds[i]["data"].numpy()) == _image(i) and int(ds[i]["cls"]) == i % 3


def test_tar_folder_api(tmp_path: Path) -> None:
    _shards(tmp_path / "wds")
    res = feedpipe.convert(tmp_path / "wds", tmp_path / "o", workers=1)
    assert res.records == 10


def test_tar_conversion_keeps_the_webdataset_key(tmp_path: Path) -> None:
    """Issue 25 item 15: each sample's ``__key__`` (as WebDataset and TarDataset give it) is
    kept as a str column of the same name, in samples and in batches."""
    _shards(tmp_path / "wds")
    _shard(tmp_path / "wds" / "train-02.tar", [("sub/dir.v2/x", {"cls": b"2", "jpg": b"z"})])
    keys = feedpipe.TarDataset(str(tmp_path / "wds" / "train-{00..02}.tar")).keys()
    assert keys[-1] == "sub/dir.v2/x" and len(keys) == 11
    feedpipe.convert(tmp_path / "wds", tmp_path / "o", workers=2, shard_bytes=64)
    ds = MemmapDataset(tmp_path / "o")
    assert ds.fields["__key__"].kind == "str" and len(ds.index.shards) > 1
    assert [ds[i]["__key__"] for i in range(len(ds))] == keys
    batch = ds.read_batch([10, 0, 7])
    assert batch["__key__"] == [keys[10], keys[0], keys[7]]
    assert batch["cls"].tolist() == [2, 0, 1]


def test_tar_refuses_what_it_cannot_store(tmp_path: Path) -> None:
    _shard(tmp_path / "t.tar", [("a", {"jpg": b"x", "cls": b"a cat"})])
    with pytest.raises(DatasetError, match=r"member 'a\.cls' is not an integer"):
        feedpipe.convert(tmp_path / "t.tar", tmp_path / "o")
    assert not (tmp_path / "o").exists()
    _shard(tmp_path / "m.tar", [("a", {"jpg": b"x", "cls": b"1"}), ("b", {"jpg": b"y"})])
    with pytest.raises(DatasetError, match=r"sample 'b' in .*m\.tar: fields"):
        feedpipe.convert(tmp_path / "m.tar", tmp_path / "o2", workers=1)


@pytest.mark.parametrize("cls", [b"99999999999999999999", b"-9223372036854775809"])
def test_a_class_out_of_int64_is_named(tmp_path: Path, cls: bytes) -> None:
    """A ``cls`` member beyond int64 was a bare OverflowError naming no shard or member."""
    _shard(
        tmp_path / "t.tar", [("a", {"jpg": b"x", "cls": b"1"}), ("b", {"jpg": b"y", "cls": cls})]
    )
    with pytest.raises(DatasetError, match=r"t\.tar: member 'b\.cls' is not an integer .*int64"):
        feedpipe.convert(tmp_path / "t.tar", tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists()
