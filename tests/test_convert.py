"""feedpipe convert: every source kind, parallel parts, restart after a kill, CLI, bad input."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import DatasetError, MemmapDataset
from feedpipe.cli import main as cli_main
from feedpipe.convert import convert


def _image_folder(root: Path) -> dict[str, bytes]:
    from PIL import Image

    files = {}
    rng = np.random.default_rng(0)
    for cls, n in (("cat", 5), ("dog", 7)):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (8, 8 + i, 3), dtype=np.uint8)).save(buf, "PNG")
            path = root / cls / f"{i:03d}.png"
            path.write_bytes(buf.getvalue())
            files[str(path)] = buf.getvalue()
    (root / "dog" / "notes.txt").write_text("not an image")
    return files


def test_image_folder(tmp_path: Path) -> None:
    files = _image_folder(tmp_path / "imgs")
    res = convert(tmp_path / "imgs", tmp_path / "out", workers=2, shard_bytes=1000)
    assert res.records == 12 and res.shards >= 2 and "12 records" in res.summary()
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == ["cat", "dog"]
    expected = sorted(files.items())  # cat/000..004, dog/000..006
    for i, (path, data) in enumerate(expected):
        s = ds[i]
        assert bytes(s["data"].numpy()) == data
        assert int(s["label"]) == (0 if "/cat/" in path else 1)
    assert not (tmp_path / "out.partial").exists()


def test_npy_files_and_npz(tmp_path: Path) -> None:
    a = np.arange(100 * 6, dtype=np.int32).reshape(100, 6)
    b = np.arange(50 * 6, dtype=np.int32).reshape(50, 6) + 10_000
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    res = convert(
        [tmp_path / "a.npy", tmp_path / "b.npy"], tmp_path / "o1", workers=2, shard_bytes=512
    )
    ds = MemmapDataset(tmp_path / "o1")
    assert res.records == 150 and torch.equal(
        ds.read_batch(range(150)), torch.from_numpy(np.concatenate([a, b]))
    )
    np.savez(tmp_path / "c.npz", x=a, y=np.arange(100) * 2)
    convert(tmp_path / "c.npz", tmp_path / "o2", data_key="x", workers=1)
    ds = MemmapDataset(tmp_path / "o2")
    assert torch.equal(ds[7]["data"], torch.from_numpy(a[7])) and int(ds[7]["y"]) == 14


def test_zarr_group(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    x = np.random.default_rng(1).random((90, 5)).astype(np.float32)
    g = zarr.open_group(tmp_path / "z", mode="w")
    g.create_array(
        "data",
        shape=x.shape,
        chunks=(10, 5),
        shards=(30, 5),
        dtype="float32",
        compressors=ZstdCodec(),
    )[:] = x
    g.create_array("label", shape=(90,), dtype="int16")[:] = np.arange(90)
    convert(tmp_path / "z", tmp_path / "o", workers=2, shard_bytes=700)
    ds = MemmapDataset(tmp_path / "o")
    b = ds.read_batch([89, 0, 45])
    assert torch.equal(b["data"], torch.from_numpy(x[[89, 0, 45]]))
    assert b["label"].dtype == torch.int16 and b["label"].tolist() == [89, 0, 45]


class _Tuples(torch.utils.data.Dataset):
    classes = ["a", "b", "c"]

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2, 3), i, dtype=torch.float16), i % 3


def test_torch_dataset_and_callable_package_name(tmp_path: Path) -> None:
    res = feedpipe.convert(_Tuples(), tmp_path / "o", workers=2, shard_bytes=64)
    ds = MemmapDataset(tmp_path / "o")
    assert res.records == 40 and ds.classes == ["a", "b", "c"]
    for i in (0, 39):
        assert torch.equal(ds[i]["data"], _Tuples()[i][0]) and int(ds[i]["label"]) == i % 3


def test_torch_dataset_bad_record_is_named(tmp_path: Path) -> None:
    class Ragged(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> np.ndarray:
            return np.zeros(4 if i != 6 else 5, np.uint8)

    with pytest.raises(DatasetError, match=r"record 6: expected uint8 \(4,\) like record 0"):
        convert(Ragged(), tmp_path / "o", workers=1)
    assert not (tmp_path / "o" / "index.json").exists()


_KILLED = """
import os, sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from feedpipe.convert import convert

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 200
    def __getitem__(self, i):
        if i == 150 and os.environ.get("FEEDPIPE_TEST_KILL"):
            os._exit(9)  # killed mid-conversion: 8 parts of 25 records; parts 0-5 done
        return np.full(16, i, np.int64)

res = convert(Slow(), {dest!r}, workers=1, shard_bytes=400 * 8)
print("RESUMED", res.resumed_parts, res.records)
"""


def test_restart_after_kill_resumes_complete_parts(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    code = _KILLED.format(tests=str(Path(__file__).parent), dest=str(dest))
    env = {**os.environ, "FEEDPIPE_TEST_KILL": "1"}
    killed = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=False)
    assert killed.returncode == 9
    assert (tmp_path / "out.partial").exists() and not dest.exists()
    with pytest.raises(DatasetError):
        MemmapDataset(dest)
    env.pop("FEEDPIPE_TEST_KILL")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        timeout=120,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "RESUMED 6 200" in done.stdout
    ds = MemmapDataset(dest, verify=True)
    assert torch.equal(ds.read_batch(range(200))[:, 0], torch.arange(200))


def test_existing_dataset_and_bad_sources(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros((4, 2), np.uint8))
    convert(tmp_path / "a.npy", tmp_path / "o", workers=1)
    with pytest.raises(DatasetError, match="already exists"):
        convert(tmp_path / "a.npy", tmp_path / "o", workers=1)
    np.save(tmp_path / "a.npy", np.ones((5, 2), np.uint8))
    res = convert(tmp_path / "a.npy", tmp_path / "o", workers=1, overwrite=True)
    assert res.records == 5 and int(MemmapDataset(tmp_path / "o")[4][0]) == 1
    with pytest.raises(DatasetError, match=r"missing\.npy: source does not exist"):
        convert(tmp_path / "missing.npy", tmp_path / "o2")
    np.save(tmp_path / "b.npy", np.zeros((4, 3), np.uint8))
    with pytest.raises(DatasetError, match=r"b\.npy: array uint8 \(4, 3\) does not match"):
        convert([tmp_path / "a.npy", tmp_path / "b.npy"], tmp_path / "o3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no class sub-directories"):
        convert(tmp_path / "empty", tmp_path / "o4")


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "a.npy", np.arange(64, dtype=np.uint16).reshape(16, 4))
    rc = cli_main(
        [
            "convert",
            str(tmp_path / "a.npy"),
            str(tmp_path / "o"),
            "--shard-size",
            "40B",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "16 records" in out and "shards" in out
    assert len(MemmapDataset(tmp_path / "o").index.shards) == 4
    rc = cli_main(["convert", str(tmp_path / "nope.npy"), str(tmp_path / "o5")])
    assert rc == 1 and "nope.npy" in capsys.readouterr().err
