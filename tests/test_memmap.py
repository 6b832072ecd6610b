"""MemmapWriter / MemmapDataset: round trips, batched reads equal to default_collate, bad input."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import json_paths as _paths
from _helpers import json_values
from _procs import run_cli as _cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, default_collate

from feedpipe import DatasetError, MemmapDataset, MemmapWriter
from feedpipe.format import Index, read_index

RNG = np.random.default_rng(0)


def _fixed(  # noqa: PLR0917
    tmp: Path,
    n: int = 300,
    shape: tuple[int, ...] = (16,),
    dtype: str = "int32",
    shard_bytes: int = 4096,
    fields: bool = True,
) -> tuple[Path, np.ndarray]:
    x = RNG.integers(-1000, 1000, (n, *shape)).astype(dtype)
    path = tmp / "fixed"
    with MemmapWriter(
        path,
        shape=shape,
        dtype=dtype,
        shard_bytes=shard_bytes,
        fields={"label": "int64"} if fields else None,
    ) as w:
        half = n // 2
        if fields:
            w.append_batch(x[:half], label=np.arange(half))
            for i in range(half, n):
                w.append(x[i], label=i)
        else:
            w.append_batch(x)
    return path, x


def _bytes(tmp: Path, n: int = 200, shard_bytes: int = 1500) -> tuple[Path, list[bytes]]:
    recs = [RNG.integers(0, 256, RNG.integers(0, 80), dtype=np.uint8).tobytes() for _ in range(n)]
    path = tmp / "bytes"
    with MemmapWriter(
        path,
        fields={"label": "int64", "pair": ("float32", (2,))},
        shard_bytes=shard_bytes,
        extra={"classes": ["a", "b"]},
    ) as w:
        for i, r in enumerate(recs):
            w.append(r, label=i, pair=[i, -i])
    return path, recs


def test_fixed_roundtrip_and_index(tmp_path: Path) -> None:
    path, x = _fixed(tmp_path)
    ds = MemmapDataset(path)
    assert len(ds) == len(x)
    index = read_index(path)
    assert len(index.shards) > 3 and index.num_records == len(x)
    # every file on disk is in the index, and the index lists sizes/CRCs
    listed = {rel for _, rel, _, _ in index.files()}
    assert listed == {p.name for p in path.iterdir()} - {"index.json"}
    for i in (0, 1, 150, 299, -1):
        s = ds[i]
        assert torch.equal(s["data"], torch.from_numpy(x[i])) and int(s["label"]) == i % len(x)
        assert s["data"].dtype == torch.int32 and s["label"].dtype == torch.int64


@pytest.mark.parametrize("shape", [(16,), (3, 90, 100)])  # the second is read with preadv
def test_read_batch_equals_default_collate(tmp_path: Path, shape: tuple[int, ...]) -> None:
    path, _ = _fixed(
        tmp_path,
        n=60,
        shape=shape,
        dtype="uint8" if len(shape) > 1 else "int32",
        shard_bytes=200_000,
    )
    ds = MemmapDataset(path)
    for idx in ([5, 3, 59, 0, 1, 2, 3, 40], list(range(60)), [7], []):
        if not idx:
            continue
        got = ds.read_batch(idx)
        want = default_collate([ds[i] for i in idx])
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
        items = ds.__getitems__(idx)
        assert all(torch.equal(a["data"], ds[i]["data"]) for a, i in zip(items, idx, strict=True))


def test_read_batch_into_out_buffer(tmp_path: Path) -> None:
    path, x = _fixed(tmp_path)
    ds = MemmapDataset(path)
    out = {
        "data": torch.zeros(32, 16, dtype=torch.int32),
        "label": torch.zeros(32, dtype=torch.int64),
    }
    idx = [9, 250, 4, 4]
    got = ds.read_batch(idx, out=out)
    assert got["data"].data_ptr() == out["data"].data_ptr()
    assert torch.equal(out["data"][:4], torch.from_numpy(x[idx]))
    assert out["label"][:4].tolist() == idx
    with pytest.raises(ValueError, match="int32"):
        ds.read_batch(idx, out={"data": torch.zeros(32, 16), "label": out["label"]})


def test_no_fields_returns_tensor(tmp_path: Path) -> None:
    path, x = _fixed(tmp_path, fields=False)
    ds = MemmapDataset(path)
    assert torch.equal(ds.read_batch(torch.tensor([2, 1])), torch.from_numpy(x[[2, 1]]))
    assert torch.equal(ds[3], torch.from_numpy(x[3]))


def test_bytes_layout(tmp_path: Path) -> None:
    path, recs = _bytes(tmp_path)
    ds = MemmapDataset(path)
    assert ds.classes == ["a", "b"] and len(ds) == len(recs)
    idx = [10, 11, 12, 199, 0, 50, 11]
    b = ds.read_batch(idx)
    assert [bytes(t.numpy()) for t in b["data"]] == [recs[i] for i in idx]
    assert b["label"].tolist() == idx
    assert torch.equal(b["pair"], default_collate([ds[i]["pair"] for i in idx]))
    assert ds[12]["data"].dtype == torch.uint8 and bytes(ds[12]["data"].numpy()) == recs[12]
    flat = torch.zeros(10_000, dtype=torch.uint8)
    b2 = ds.read_batch(idx, out={"data": flat})
    assert [bytes(t.numpy()) for t in b2["data"]] == [recs[i] for i in idx]


def test_pickles_cheaply_and_works_in_worker_processes(tmp_path: Path) -> None:
    path, x = _fixed(tmp_path)
    ds = MemmapDataset(path)
    ds.read_batch([1, 2, 3])  # opens files and maps
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    loader = DataLoader(
        ds, batch_size=32, num_workers=2, shuffle=False, multiprocessing_context="fork", timeout=60
    )
    seen = torch.cat([b["data"] for b in loader])
    assert torch.equal(seen, torch.from_numpy(x))


def test_crashed_writer_never_looks_complete(tmp_path: Path) -> None:
    path = tmp_path / "crash"
    code = textwrap.dedent(f"""
        import os, numpy as np
        from feedpipe import MemmapWriter
        w = MemmapWriter({str(path)!r}, shape=(256,), dtype="uint8", shard_bytes=4096)
        for i in range(100):
            w.append(np.full(256, i, np.uint8))
        os._exit(0)  # killed before close(): shards on disk, no index
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert any(path.iterdir()) and not (path / "index.json").exists()
    with pytest.raises(DatasetError, match="not a feedpipe dataset"):
        MemmapDataset(path)
    # an exception inside the with-block aborts too
    with pytest.raises(RuntimeError), MemmapWriter(tmp_path / "x", shape=(2,), dtype="uint8") as w:
        w.append(np.zeros(2, np.uint8))
        raise RuntimeError("boom")
    assert not (tmp_path / "x" / "index.json").exists()


def test_wrong_dtype_or_shape_names_the_record(tmp_path: Path) -> None:
    with MemmapWriter(tmp_path / "w", shape=(4,), dtype="int32", fields={"label": "int64"}) as w:
        w.append(np.zeros(4, np.int32), label=0)
        with pytest.raises(DatasetError, match=r"record 1: expected shape \(4,\)"):
            w.append(np.zeros(5, np.int32), label=1)
        with pytest.raises(DatasetError, match=r"record 1: expected dtype int32, got float64"):
            w.append(np.zeros(4), label=1)
        with pytest.raises(DatasetError, match=r"records 1\.\.3: expected shape"):
            w.append_batch(np.zeros((3, 5), np.int32), label=[1, 2, 3])
        with pytest.raises(DatasetError, match=r"field 'label'.*do not fit"):
            w.append(np.zeros(4, np.int32), label=1.5)
        with pytest.raises(DatasetError, match="missing"):
            w.append(np.zeros(4, np.int32))
    with MemmapWriter(tmp_path / "b") as w, pytest.raises(DatasetError, match=r"record 0.*str"):
        w.append("text")
    with pytest.raises(DatasetError, match="already exists"):
        MemmapWriter(tmp_path / "w", shape=(4,), dtype="int32")


def test_out_of_range_index(tmp_path: Path) -> None:
    path, _ = _fixed(tmp_path)
    ds = MemmapDataset(path)
    with pytest.raises(IndexError, match=r"index 300 is out of range .*length 300"):
        ds[300]
    with pytest.raises(IndexError, match=r"index -301 .*length 300"):
        ds.read_batch([0, -301])


def test_missing_shard(tmp_path: Path) -> None:
    path, _ = _fixed(tmp_path)
    (path / "shard-00002.data").unlink()
    with pytest.raises(DatasetError, match=r"shard-00002\.data: shard 2 file is missing"):
        MemmapDataset(path)


def test_truncated_shard(tmp_path: Path) -> None:
    path, _ = _fixed(tmp_path)
    with open(path / "shard-00001.data", "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        DatasetError, match=r"shard-00001\.data: .*100 bytes but the index says 4096"
    ):
        MemmapDataset(path)


@pytest.mark.parametrize("side", [100, 150])  # mapped gather, and preadv (>= 64 KiB records)
def test_truncated_after_open_is_never_returned_short(tmp_path: Path, side: int) -> None:
    rb = 3 * side * side
    path, _ = _fixed(
        tmp_path, n=8, shape=(3, side, side), dtype="uint8", shard_bytes=1 << 20, fields=False
    )
    ds = MemmapDataset(path)
    ds[0]
    os.truncate(path / "shard-00000.data", rb * 5)
    with pytest.raises(DatasetError, match=r"shard-00000\.data: (short read at record 7|.*now)"):
        ds.read_batch([7])
    with pytest.raises(DatasetError, match=r"shard-00000\.data"):
        ds[6]


def test_index_size_mismatch(tmp_path: Path) -> None:
    path, _ = _fixed(tmp_path)
    doc = json.loads((path / "index.json").read_text())
    doc["shards"][0]["files"]["data"]["bytes"] += 4
    (path / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match=r"shard 0 file 'shard-00000\.data' is listed with"):
        MemmapDataset(path)
    doc["shards"][0]["files"]["data"]["bytes"] -= 4
    doc["num_records"] += 1
    (path / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match="num_records is 301"):
        MemmapDataset(path)


def test_checksum_mismatch_on_verify(tmp_path: Path) -> None:
    path, _ = _fixed(tmp_path)
    MemmapDataset(path, verify=True)
    with open(path / "shard-00003.label", "r+b") as f:
        f.seek(8)
        f.write(b"\xff")
    MemmapDataset(path)  # sizes still agree: only verify reads the bytes
    with pytest.raises(DatasetError, match=r"shard-00003\.label: checksum failed: crc32c"):
        MemmapDataset(path, verify=True)


def test_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "some.txt").write_text("hi")
    with pytest.raises(DatasetError, match=r"not a feedpipe dataset \(no index\.json\)"):
        MemmapDataset(tmp_path)
    with pytest.raises(DatasetError, match="not a directory"):
        MemmapDataset(tmp_path / "some.txt")
    (tmp_path / "index.json").write_text('{"format": "other"}')
    with pytest.raises(DatasetError, match="format='other'"):
        MemmapDataset(tmp_path)


def test_index_rejects_escaping_paths() -> None:
    doc = {
        "format": "feedpipe.memmap",
        "version": 1,
        "layout": {"kind": "bytes"},
        "fields": {},
        "num_records": 0,
        "shards": [
            {
                "records": 0,
                "files": {
                    "data": {"path": "../etc/passwd", "bytes": 0, "crc32c": "00000000"},
                    "offsets": {"path": "o", "bytes": 8, "crc32c": "00000000"},
                },
            }
        ],
    }
    with pytest.raises(DatasetError, match="escapes the dataset"):
        Index.from_json(doc)
    doc["shards"][0]["files"]["data"]["path"] = "/abs"
    with pytest.raises(DatasetError, match="escapes the dataset"):
        Index.from_json(doc)


def test_remote_without_staging_is_explicit(s3_bucket: tuple[str, dict]) -> None:
    bucket, options = s3_bucket
    import fsspec

    fs = fsspec.filesystem("s3", **options)
    doc = {
        "format": "feedpipe.memmap",
        "version": 1,
        "layout": {"kind": "fixed", "shape": [2], "dtype": "uint8"},
        "fields": {},
        "num_records": 1,
        "shards": [
            {
                "records": 1,
                "files": {"data": {"path": "shard-00000.data", "bytes": 2, "crc32c": "00000000"}},
            }
        ],
    }
    fs.pipe(f"{bucket}/ds/index.json", json.dumps(doc).encode())
    ds = MemmapDataset(f"s3://{bucket}/ds", storage_options=options)
    assert len(ds) == 1
    with pytest.raises(NotImplementedError, match="staging"):
        ds[0]


@pytest.mark.parametrize("record", [100, 64 << 10])
def test_batches_spanning_shards_small_and_big_records(tmp_path: Path, record: int) -> None:
    """Batches over many shards: gathered per shard, then put back in batch order."""
    n = 40
    x = RNG.integers(0, 256, (n, record), dtype=np.uint8)
    with MemmapWriter(tmp_path / "ds", shape=(record,), shard_bytes=record * 3) as w:
        w.append_batch(x)
    ds = MemmapDataset(tmp_path / "ds")
    assert len(ds.index.shards) == 14
    for idx in (RNG.permutation(n), RNG.integers(0, n, 25), np.array([39, 0, 0, 39, 7])):
        assert torch.equal(ds.read_batch(idx), torch.from_numpy(x[idx]))
        assert torch.equal(ds.read_batch(idx[:3].tolist()), torch.from_numpy(x[idx[:3]]))


def test_concurrent_first_reads_from_many_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first batches of a fresh dataset may come from several reader threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # large batches split over a read pool

    rng = np.random.default_rng(0)
    records = [rng.integers(0, 255, 200_000 + i, dtype=np.uint8).tobytes() for i in range(96)]
    with MemmapWriter(tmp_path / "ds", shard_bytes=8 << 20) as w:
        for rec in records:
            w.append(np.frombuffer(rec, dtype=np.uint8))
    for _ in range(3):
        ds = MemmapDataset(tmp_path / "ds")  # fresh: no open files, no read pool yet
        batches = [list(range(96)), list(range(95, -1, -1))] * 4
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ds.read_batch, batches))
        for idx, got in zip(batches, results, strict=True):
            assert [bytes(t.numpy()) for t in got] == [records[i] for i in idx]
        ds.close()


def test_memmap_writer_to_s3(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, opts = s3_bucket
    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/w"
    with MemmapWriter(url, shape=(3,), dtype="float32", storage_options=opts) as w:
        w.append_batch(np.ones((5, 3), np.float32))
    assert os.listdir(tmp_path) == []
    ds = MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "c")
    assert ds.read_batch([0, 4]).sum().item() == 6.0
    # an aborted writer publishes nothing
    with (
        pytest.raises(RuntimeError),
        MemmapWriter(
            f"s3://{bucket}/aborted", shape=(3,), dtype="float32", storage_options=opts
        ) as w,
    ):
        w.append_batch(np.ones((5, 3), np.float32))
        raise RuntimeError("boom")
    import fsspec

    assert not fsspec.filesystem("s3", **opts).exists(f"{bucket}/aborted/index.json")
    assert sorted(os.listdir(tmp_path)) == ["c"]


# ---------------------------------------------------------------------- point 8
def test_string_side_field_is_refused_at_write_time(tmp_path: Path) -> None:
    np.savez(tmp_path / "s.npz", data=np.zeros((6, 2), np.float32), name=np.array(["ab"] * 6))
    res = _cli("convert", "s.npz", "out", "--no-progress", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "'name'" in res.stderr and "<U2" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": (2,), "dtype": object}, "object"),
        ({"shape": (2,), "dtype": "U4"}, "<U4"),
        ({"shape": (2**32, 2**32), "dtype": "uint8"}, "too large"),
        ({"shape": (-1,), "dtype": "uint8"}, "negative"),
        ({"shape": (2,), "dtype": ">i4"}, "byte order"),
        ({"shape": None, "fields": {"f": ("int64", (-2,))}}, "negative"),
        ({"shape": None, "fields": {"f": "S3"}}, "S3"),
        ({"shape": None, "fields": {"f": ("float32", (2**40, 2**40))}}, "too large"),
    ],
)
def test_writer_refuses_unreadable_layouts(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(DatasetError, match=match):
        MemmapWriter(tmp_path / "w", **kwargs)
    assert not (tmp_path / "w").exists()


def _index(tmp_path: Path, n: int, **changes: Any) -> Path:
    with MemmapWriter(tmp_path / "ds", shape=(2,), dtype="int32", fields={"y": "int64"}) as w:
        w.append_batch(np.zeros((n, 2), np.int32), y=np.arange(n))
    doc = json.loads((tmp_path / "ds" / "index.json").read_text())
    for path, value in changes.items():
        node = doc
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[keys[-1]] = value
    (tmp_path / "ds" / "index.json").write_text(json.dumps(doc))
    return tmp_path / "ds"


@pytest.mark.parametrize(
    ("n", "changes"),
    [
        (0, {"layout__dtype": "object"}),  # an empty dataset: no size check can catch these
        (0, {"layout__dtype": "<U3"}),
        (0, {"layout__shape": [2**32, 2**32]}),
        (0, {"fields__y__shape": [-1]}),
        (0, {"fields__y__dtype": "<U3"}),
        (3, {"shards__0__files__data__path": "."}),
        (3, {"shards__0__files__data__path": "a/./b"}),
        (3, {"shards__0__files__data__path": "index.json"}),
        (3, {"shards__0__records": 3.0}),
        (3, {"num_records": 3.0}),
    ],
)
def test_open_refuses_unreadable_index(tmp_path: Path, n: int, changes: dict[str, Any]) -> None:
    ds = _index(tmp_path, n, **changes)
    with pytest.raises(DatasetError, match=r"index\.json"):
        MemmapDataset(ds)


# ---------------------------------------------------------------------- point 9
_JSON = json_values()


@pytest.fixture(scope="module")
def dataset_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tpl") / "ds"
    with MemmapWriter(root, shape=None, fields={"y": ("int16", (2,))}, shard_bytes=64) as w:
        for i in range(12):
            w.append(bytes([i]) * (i + 1), y=[i, -i])
    return root


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_malformed_index_raises_only_dataset_error(dataset_template: Path, data: Any) -> None:
    """Any mutation of a valid index: open and read give a result or a DatasetError naming it."""
    import tempfile

    good = json.loads((dataset_template / "index.json").read_text())
    path = data.draw(st.sampled_from(_paths(good)))
    value = data.draw(_JSON)
    doc = json.loads(json.dumps(good))
    if path:
        node = doc
        for k in path[:-1]:
            node = node[k]
        if data.draw(st.booleans()) and isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = value
    else:
        doc = value
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        root.mkdir()
        for f in dataset_template.iterdir():
            if f.name != "index.json":
                os.symlink(f, root / f.name)
        (root / "index.json").write_text(json.dumps(doc))  # Infinity/NaN included
        try:
            ds = MemmapDataset(root)
            ds.read_batch(np.arange(len(ds)))
        except DatasetError as exc:
            assert str(root) in str(exc)


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"format": "feedpipe.memmap", "version": 1, "layout": {"kind": "bytes"}, '
        '"fields": {}, "num_records": Infinity, "shards": []}',
        '{"format": "feedpipe.memmap", "version": 1, "layout": {"kind": "fixed", "shape": '
        '[1e999], "dtype": "uint8"}, "fields": {}, "num_records": 0, "shards": []}',
    ],
)
def test_hostile_index_text(tmp_path: Path, raw: str) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "index.json").write_text(raw)
    with pytest.raises(DatasetError, match=r"ds/index\.json"):
        MemmapDataset(tmp_path / "ds")
    res = _cli("inspect", "ds", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "index.json" in res.stderr
