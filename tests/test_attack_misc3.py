"""Fresh-context attacks on three changes: Parquet / Hugging Face conversion (hostile files,
lying metadata, files replaced mid-conversion), the one ``file://`` rule of
:func:`feedpipe.io.local_file_path` across entry points, and the growth of worker slots."""

from __future__ import annotations

import gc
import io
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import DatasetError, MemmapDataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _hf_meta(table: Any, features: dict[str, Any]) -> Any:
    raw = json.dumps({"info": {"features": features}}).encode()
    return table.replace_schema_metadata({b"huggingface": raw})


# ---------------------------------------------------------------------- 1: Parquet / HF
@pytest.mark.parametrize("lie", [5, ["Image"], {"x": 1}, None])
def test_hf_metadata_whose_type_is_not_a_string_is_ignored(tmp_path: Path, lie: Any) -> None:
    """Valid JSON whose ``_type`` is not a string was an AttributeError; it is no feature."""
    table = _hf_meta(pa.table({"data": np.arange(4), "x": np.arange(4) * 2}),
                     {"data": {"_type": lie}, "x": {"_type": lie, "shape": [2]}})  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    batch = MemmapDataset(tmp_path / "o").read_batch([1, 3])
    assert batch["data"].tolist() == [1, 3] and batch["x"].tolist() == [2, 6]


def test_classlabel_metadata_on_a_non_integer_column_is_ignored(tmp_path: Path) -> None:
    """A ``ClassLabel`` claimed for a string column names no classes (its values are no
    label numbers); on an integer column it does."""
    table = pa.table({"data": np.arange(4), "s": ["p", "q", "r", "s"], "y": np.arange(4) % 2})
    feats = {"s": {"_type": "ClassLabel", "names": ["a", "b"]},
             "y": {"_type": "ClassLabel", "names": ["neg", "pos"]}}  # fmt: skip
    pq.write_table(_hf_meta(table, feats), tmp_path / "t.parquet")
    feedpipe.convert(tmp_path / "t.parquet", tmp_path / "o", workers=1)
    ds = MemmapDataset(tmp_path / "o")
    assert ds.index.extra["class_labels"] == {"y": ["neg", "pos"]}
    assert ds.classes == ["neg", "pos"]


def test_parquet_file_urls_follow_the_one_rule(tmp_path: Path) -> None:
    """``file://localhost/abs`` and ``FILE:///abs`` are ``/abs``; ``file://host/abs`` is refused
    naming the URL (it was read as the relative path ``host/abs``)."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"data": np.arange(5)}), path)
    for i, url in enumerate([f"file://localhost{path}", f"FILE://{path}", f"file://{path}"]):
        feedpipe.convert(url, tmp_path / f"o{i}", workers=1)
        assert MemmapDataset(tmp_path / f"o{i}").read_batch([4]).tolist() == [4]
        assert MemmapDataset(tmp_path / f"o{i}").index.extra["source"]["paths"] == [str(path)]
    with pytest.raises(ValueError, match="names another host") as err:
        feedpipe.convert(f"file://host{path}", tmp_path / "ox", workers=1)
    assert f"file://host{path}" in str(err.value)
    assert not (tmp_path / "ox").exists()


def _two_groups(path: Any, scale: int, schema_int: bool = True) -> None:
    col = np.arange(8) * scale if schema_int else (np.arange(8) * scale).astype(np.float32)
    pq.write_table(pa.table({"data": col}), path, row_group_size=4)


@pytest.mark.parametrize("same_schema", [True, False])
def test_local_parquet_replaced_mid_conversion_is_named(tmp_path: Path, same_schema: bool) -> None:
    """Row group 0 is read, then the file is replaced (same row counts; same or another
    schema): reading row group 1 is an error naming the file, never rows of two versions."""
    from feedpipe.datasets.tables import ParquetSource

    path = tmp_path / "t.parquet"
    _two_groups(path, 1)
    src = ParquetSource([str(path)], None)
    assert src.read(0, 4)[0].tolist() == [0, 1, 2, 3]
    _two_groups(tmp_path / "new.parquet", 100, schema_int=same_schema)
    os.replace(tmp_path / "new.parquet", path)
    with pytest.raises(DatasetError, match="changed while it was converted") as err:
        src.read(4, 8)
    assert str(path) in str(err.value)


def test_s3_parquet_replaced_mid_conversion_is_named(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    import fsspec

    from feedpipe.datasets.tables import ParquetSource

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    url = f"s3://{bucket}/pq/t.parquet"
    for scale in (1, 100):
        buf = io.BytesIO()
        _two_groups(buf, scale)
        if scale == 1:
            fs.pipe(url, buf.getvalue())
            src = ParquetSource([url], None, opts)
            assert src.read(0, 4)[0].tolist() == [0, 1, 2, 3]
        else:
            fs.pipe(url, buf.getvalue())
    with pytest.raises(DatasetError, match="changed while it was converted") as err:
        src.read(4, 8)
    assert url in str(err.value)


def test_nulls_without_statistics_in_a_late_row_group_publish_nothing(tmp_path: Path) -> None:
    """No statistics (a footer that says nothing of nulls): the null is found when its row
    group is converted, after other parts were written; nothing appears at DEST."""
    path = tmp_path / "t.parquet"
    vals = pa.array([float(i) if i != 3001 else None for i in range(3200)])
    table = pa.table({"data": np.arange(3200), "v": vals})
    pq.write_table(table, path, row_group_size=200, write_statistics=False)
    with pytest.raises(DatasetError, match="row 3001 \\(record 3001\\): column 'v'"):
        feedpipe.convert(path, tmp_path / "o", workers=1, shard_bytes=4096)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- 2: one file:// rule
def _fixtures(root: Path) -> dict[str, Path]:
    """A memmap dataset, a Zarr array, a tar shard and a folder of .npy files under ``root``."""
    import tarfile

    import zarr

    from feedpipe import MemmapWriter

    mm = root / "mm"
    with MemmapWriter(mm, dtype="int64", shape=(2,)) as w:
        for i in range(3):
            w.append(np.array([i, -i]))
    zarr.create_array(root / "z.zarr", shape=(3, 2), dtype="int64", chunks=(2, 2))[:] = 7
    tar = root / "a b.tar"
    with tarfile.open(tar, "w") as t:
        for i in range(2):
            info = tarfile.TarInfo(f"{i:03d}.txt")
            info.size = 1
            t.addfile(info, io.BytesIO(str(i).encode()))
    np.save(root / "x.npy", np.arange(6).reshape(3, 2))
    return {"mm": mm, "zarr": root / "z.zarr", "tar": tar, "npy": root / "x.npy"}


def _targets(root: Path, paths: dict[str, Path]) -> dict[str, Path]:
    names = {"out": "o1", "out2": "o2", "staged": "staged", "ck": "ck"}
    return {**paths, **{k: root / v for k, v in names.items()}}


def _entry_points(f: dict[str, Any], out: Path) -> dict[str, Any]:
    """Each entry point that takes a local path, called with the (URL) paths ``f``."""
    import ckpt
    from ckpt.cli import main as ckpt_main

    return {
        "MemmapDataset": lambda: len(feedpipe.MemmapDataset(f["mm"])),
        "ZarrDataset": lambda: len(feedpipe.ZarrDataset(f["zarr"])),
        "TarDataset": lambda: len(feedpipe.TarDataset(f["tar"])),
        "convert npy": lambda: feedpipe.convert(f["npy"], f["out"], workers=1).records,
        "convert tar": lambda: feedpipe.convert(f["tar"], f["out2"], workers=1).records,
        "stage": lambda: feedpipe.stage(f["mm"], f["staged"]) and len(os.listdir(out / "staged")),
        "CheckpointManager": lambda: str(ckpt.CheckpointManager(f["ck"]).directory),
        "ckpt CLI": lambda: ckpt_main(["ls", str(f["ck"])]),
    }


@pytest.mark.parametrize("prefix", ["file://", "file://localhost", "FILE://LocalHost"])
def test_every_entry_point_reads_a_file_url_as_its_path(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TarDataset read ``file:///x.tar`` as the relative path ``file:/x.tar``, convert took a
    ``file://`` folder for Zarr, and stage wrote into ``./file:/abs``: now every entry point
    gives the same answer for the URL as for the plain path."""
    monkeypatch.chdir(tmp_path)
    paths = _fixtures(tmp_path)
    plain = _targets(tmp_path, paths)
    urls = {k: f"{prefix}{v}" for k, v in plain.items()}
    want = {name: call() for name, call in _entry_points(plain, tmp_path).items()}
    for p in ("o1", "o2", "staged"):
        import shutil

        shutil.rmtree(tmp_path / p)
    got = {name: call() for name, call in _entry_points(urls, tmp_path).items()}
    assert got == want
    assert not any(p.name.lower().startswith("file:") for p in tmp_path.iterdir())


def test_every_entry_point_refuses_a_file_url_of_another_host_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _fixtures(tmp_path)
    plain = _targets(tmp_path, paths)
    urls = {k: f"file://server{v}" for k, v in plain.items()}
    for name, call in _entry_points(urls, tmp_path).items():
        if name == "ckpt CLI":
            assert call() == 2
            assert f"file://server{tmp_path / 'ck'}" in capsys.readouterr().err
            continue
        with pytest.raises(ValueError, match="names another host") as err:
            call()
        assert f"file://server{tmp_path}" in str(err.value), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a b.tar", "mm", "x.npy", "z.zarr"]


def test_stage_reads_the_relative_file_colon_form_like_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``file:name`` is the relative path ``./file:name`` (the documented rule); fsspec read it
    as ``./name``, so stage copied another dataset than the one named."""
    monkeypatch.chdir(tmp_path)
    _fixtures(tmp_path)
    with pytest.raises(DatasetError, match="file:mm"):
        feedpipe.stage("file:mm", tmp_path / "staged")  # ./file:mm does not exist
    os.rename(tmp_path / "mm", tmp_path / "file:mm")
    feedpipe.stage("file:mm", tmp_path / "staged")
    assert len(feedpipe.MemmapDataset(tmp_path / "staged")) == 3


# ---------------------------------------------------------------------- 3: worker slots
@pytest.fixture
def fresh_slots() -> Any:
    from feedpipe.loader import slots as slots_mod

    slots_mod._WORKER.clear()
    yield slots_mod
    slots_mod._WORKER.clear()


@pytest.mark.parametrize("k", [4095, 4096, 4200])
def test_many_slots_never_share_bytes_with_the_flags(fresh_slots: Any, k: int) -> None:
    """``prefetch_factor + 2`` slots: with 4094 or more, the flags and the seen byte ran into
    slot 0, and the main process marking the buffer seen overwrote the batch's first bytes."""
    mod = fresh_slots
    main = mod.Slots(pin=False)
    held = []
    for b in range(3):
        ref = mod.collate_into([torch.zeros(4, dtype=torch.int64)] * 8, k=k, rows=None)
        assert ref is not None
        ref.received = True
        batch, _ = main.resolve(ref)
        held.append(batch)
        assert not any(h.any() for h in held), (b, held)


def test_loader_with_a_huge_prefetch_factor_delivers_torchs_batches() -> None:
    data = [torch.zeros(4, dtype=torch.int64) for _ in range(32)]
    loader = feedpipe.DataLoader(data, batch_size=8, num_workers=1, worker_type="process",
                                 prefetch_factor=4095)  # fmt: skip
    assert [b.tolist() for b in loader] == [[[0] * 4] * 8] * 4
    assert loader.worker_slots is not None and loader.worker_slots["batches_in_slots"] == 4


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_eq, a, b))
    return bool(a == b)


_SIZES = [1, 2, 40, 3, 100, 1, 120, 5, 2, 200, 1]
_BATCHES = [list(range(sum(_SIZES[:k]), sum(_SIZES[: k + 1]))) for k in range(len(_SIZES))]
_BLOCK = {i: k for k, b in enumerate(_BATCHES) for i in b}


class _Shifting(torch.utils.data.Dataset[Any]):
    """Samples whose shape and dtype change from batch to batch (equal within one)."""

    def __len__(self) -> int:
        return sum(_SIZES)

    def __getitem__(self, i: int) -> Any:
        k = _BLOCK[i]
        dtype = [torch.float32, torch.int64, torch.uint8, torch.float64][k % 4]
        x = torch.full((1 + k % 3, 8), i % 250).to(dtype)
        return {"x": x, "i": i, "a": np.full(3, i, dtype=np.int16)}


def test_batches_that_grow_shrink_and_change_shape_equal_torchs() -> None:
    """Growing and shrinking batches of changing shapes and dtypes, every batch held while
    the slots grow, persistent workers over two epochs and two iterators at once: the batches
    equal torch's, and still do after the pass."""
    ds = _Shifting()
    want = list(torch.utils.data.DataLoader(ds, batch_sampler=_BATCHES, num_workers=0))
    loader = feedpipe.DataLoader(ds, batch_sampler=_BATCHES, num_workers=2,
                                 worker_type="process", persistent_workers=True)  # fmt: skip
    for _ in range(2):
        held = list(loader)
        assert len(held) == len(want) and all(map(_eq, want, held))
        del held
        gc.collect()
    info = loader.worker_slots
    assert info is not None and info["batches_in_slots"] > 0, info
    loader = feedpipe.DataLoader(ds, batch_sampler=_BATCHES, num_workers=2, worker_type="process")
    a, b = [], []
    for x, y in itertools.zip_longest(iter(loader), iter(loader)):
        a.append(x)
        b.append(y)
    assert all(map(_eq, want, a)) and all(map(_eq, want, b)) and len(a) == len(b) == len(want)


def test_feedpipe_stage_stays_callable_after_its_module_is_imported(tmp_path: Path) -> None:
    """``from feedpipe.stage import stage`` (a public path) bound the module over the function:
    ``feedpipe.stage(src, dst)`` was then "'module' object is not callable"."""
    import feedpipe.stage

    paths = _fixtures(tmp_path)
    feedpipe.stage(paths["mm"], tmp_path / "staged")
    assert len(MemmapDataset(tmp_path / "staged")) == 3


class _KillOnce(torch.utils.data.Dataset[torch.Tensor]):
    """SIGKILLs its worker at sample 50 (in the batch after the first big one) once."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return sum(_SIZES)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 50 and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), 9)
        return torch.full((16,), float(i))


def test_worker_killed_while_its_slots_grow_then_a_new_pass(tmp_path: Path) -> None:
    """A process worker dies by SIGKILL while batches grow: the pass fails naming the worker,
    the batches already delivered stay intact, and the next pass equals torch's."""
    from feedpipe.errors import WorkerError

    marker = tmp_path / "killed"
    ds = _KillOnce(marker)
    marker.touch()
    want = list(torch.utils.data.DataLoader(ds, batch_sampler=_BATCHES[:8]))
    marker.unlink()
    loader = feedpipe.DataLoader(ds, batch_sampler=_BATCHES[:8], num_workers=2,
                                 worker_type="process", timeout=30)  # fmt: skip
    got = []
    with pytest.raises(WorkerError, match="died with exit code -9"):
        for batch in loader:
            got.append(batch)
    again = list(loader)
    assert len(again) == len(want) and all(map(torch.equal, want, again))
    assert all(map(torch.equal, want, got))
