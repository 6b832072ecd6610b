"""ZarrDataset over arrays written by zarr-python (v3 sharding codec + zstd), both backends."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import json_paths as _paths
from _helpers import json_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, default_collate

import feedpipe
from feedpipe import DatasetError, ZarrDataset

zarr = pytest.importorskip("zarr")
pytest.importorskip("tensorstore")

BACKENDS = ["tensorstore", "zarr"]


def _group(tmp: Path, n: int = 200) -> tuple[Path, np.ndarray]:
    from zarr.codecs import ZstdCodec

    x = np.random.default_rng(0).integers(0, 1000, (n, 4, 8)).astype(np.int32)
    g = zarr.open_group(tmp / "g", mode="w")
    a = g.create_array(
        "data",
        shape=x.shape,
        chunks=(10, 4, 8),
        shards=(50, 4, 8),
        dtype="int32",
        compressors=ZstdCodec(level=3),
    )
    a[:] = x
    lab = g.create_array("label", shape=(n,), chunks=(64,), dtype="int64")
    lab[:] = np.arange(n)
    return tmp / "g", x


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_sharded_zstd_matches_default_collate(tmp_path: Path, backend: str) -> None:
    path, x = _group(tmp_path)
    ds = ZarrDataset(path, backend=backend)
    assert len(ds) == 200 and ds.names == ["data", "label"]
    s = ds[17]
    assert torch.equal(s["data"], torch.from_numpy(x[17])) and int(s["label"]) == 17
    idx = [199, 3, 3, 120, 0, -1]
    got = ds.read_batch(idx)
    want = default_collate([ds[i] for i in idx])
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
    items = ds.__getitems__(idx)
    assert torch.equal(items[3]["data"], torch.from_numpy(x[120]))
    out = {
        "data": torch.zeros(8, 4, 8, dtype=torch.int32),
        "label": torch.zeros(8, dtype=torch.int64),
    }
    got = ds.read_batch(idx, out=out)
    assert got["data"].data_ptr() == out["data"].data_ptr()
    assert torch.equal(out["data"][:6], torch.from_numpy(x[idx]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_array_and_arrays_selection(tmp_path: Path, backend: str) -> None:
    path, x = _group(tmp_path)
    ds = ZarrDataset(path / "data", backend=backend)
    assert torch.equal(ds.read_batch(np.array([5, 1])), torch.from_numpy(x[[5, 1]]))
    only = ZarrDataset(path, arrays=["label"], backend=backend)
    assert only[4] == {"label": torch.tensor(4)}


@pytest.mark.parametrize("context", ["forkserver", "fork"])
def test_pickles_and_works_in_worker_processes(tmp_path: Path, context: str) -> None:
    path, x = _group(tmp_path)
    ds = ZarrDataset(path)
    ds[0]  # opens TensorStore handles; they must not travel
    assert len(pickle.dumps(ds)) < 5000
    loader = DataLoader(
        ds, batch_size=50, num_workers=2, multiprocessing_context=context, timeout=60
    )
    # a child forked after TensorStore ran in its parent falls back to zarr-python (a warning)
    assert torch.equal(torch.cat([b["data"] for b in loader]), torch.from_numpy(x))


def test_out_of_range_and_not_zarr(tmp_path: Path) -> None:
    path, _ = _group(tmp_path)
    ds = ZarrDataset(path)
    with pytest.raises(IndexError, match=r"index 200 is out of range .*length 200"):
        ds[200]
    with pytest.raises(IndexError, match="index -201"):
        ds.read_batch([0, -201])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: not a Zarr v3 array or group"):
        ZarrDataset(tmp_path / "empty")
    with pytest.raises(DatasetError, match=r"g/nope: not a Zarr v3"):
        ZarrDataset(path, arrays=["nope"])


def test_misaligned_group(tmp_path: Path) -> None:
    g = zarr.open_group(tmp_path / "m", mode="w")
    g.create_array("a", shape=(10, 2), dtype="uint8")
    g.create_array("b", shape=(9,), dtype="uint8")
    with pytest.raises(DatasetError, match="not aligned"):
        ZarrDataset(tmp_path / "m")


def test_missing_shard_is_an_error_not_zeros(tmp_path: Path) -> None:
    path, _ = _group(tmp_path)
    shard = path / "data" / "c" / "3" / "0" / "0"
    assert shard.exists()
    os.remove(shard)
    ds = ZarrDataset(path)
    ds[0]
    with pytest.raises(DatasetError, match=r"g/data: reading records \[160\] failed: .*missing"):
        ds[160]


def test_remote_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, options = s3_bucket
    from zarr.storage import FsspecStore

    url = f"s3://{bucket}/z"
    store = FsspecStore.from_url(url, storage_options=options, read_only=False)
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    arr = zarr.create_array(store, shape=x.shape, chunks=(5, 3), shards=(10, 3), dtype="float32")
    arr[:] = x
    ds = ZarrDataset(url, storage_options=options)
    assert ds.backend == "zarr" and len(ds) == 20
    assert torch.equal(ds.read_batch([19, 2]), torch.from_numpy(x[[19, 2]]))


@pytest.mark.parametrize("index_location", ["end", "start"])
def test_direct_reads_of_uncompressed_sharded_arrays(tmp_path: Path, index_location: str) -> None:
    from zarr.codecs import BytesCodec, ShardingCodec

    x = np.random.default_rng(2).integers(-99, 99, (130, 3, 5)).astype(np.int16)
    arr = zarr.create_array(
        tmp_path / "u",
        shape=x.shape,
        chunks=(40, 3, 5),
        dtype="int16",
        compressors=None,
        serializer=ShardingCodec(
            chunk_shape=(1, 3, 5), codecs=[BytesCodec()], index_location=index_location
        ),
    )
    arr[:] = x
    direct = ZarrDataset(tmp_path / "u")
    engine = ZarrDataset(tmp_path / "u", preadv=False)
    assert "" in direct._preadv and not engine._preadv
    idx = [129, 0, 41, 40, 39, 7, 7, -2]
    assert torch.equal(direct.read_batch(idx), engine.read_batch(idx))
    assert torch.equal(direct.read_batch(idx), torch.from_numpy(x[idx]))
    # a corrupt shard index is caught by its CRC32C
    shard = tmp_path / "u" / "c" / "1" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    pos = len(raw) - 20 if index_location == "end" else 3
    raw[pos] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match=r"c/1/0/0: shard index fails its CRC32C"):
        ZarrDataset(tmp_path / "u").read_batch([45])
    os.remove(tmp_path / "u" / "c" / "2" / "0" / "0")
    with pytest.raises(DatasetError, match=r"c/2/0/0: chunk/shard file is missing"):
        ZarrDataset(tmp_path / "u").read_batch([85])


def test_direct_reads_of_unsharded_arrays(tmp_path: Path) -> None:
    x = np.arange(50 * 4, dtype=np.float64).reshape(50, 4)
    zarr.create_array(
        tmp_path / "p", shape=x.shape, chunks=(16, 4), dtype="float64", compressors=None
    )[:] = x
    ds = ZarrDataset(tmp_path / "p")
    assert ds._preadv and torch.equal(ds.read_batch([49, 0, 17]), torch.from_numpy(x[[49, 0, 17]]))


@pytest.mark.parametrize("index_location", ["end", "start"])
def test_direct_reads_of_big_records_across_shards(tmp_path: Path, index_location: str) -> None:
    """Records of 64 KiB and more are copied one by one into place (mapped or preadv)."""
    from zarr.codecs import BytesCodec, ShardingCodec

    x = np.random.default_rng(3).integers(0, 255, (9, 1 << 16)).astype(np.uint8)
    zarr.create_array(
        tmp_path / "big",
        shape=x.shape,
        chunks=(3, 1 << 16),
        dtype="uint8",
        compressors=None,
        serializer=ShardingCodec(
            chunk_shape=(1, 1 << 16), codecs=[BytesCodec()], index_location=index_location
        ),
    )[:] = x
    ds = ZarrDataset(tmp_path / "big")
    assert ds._preadv
    for idx in ([8, 0, 4, 3, 8, 1], [5, 4], [2]):
        assert torch.equal(ds.read_batch(idx), torch.from_numpy(x[idx]))


# ---------------------------------------------------------------------- edges of the chunk grid
# (chunk, shard or None, compressed): shards along one axis, along two axes (the second axis, 3
# wide, ends inside its second inner chunk), one record per inner chunk, and unsharded (the
# uncompressed layouts are also read with preadv at addresses from the shard index).
_EDGE_LAYOUTS = [
    ((4, 3), (12, 3), False),
    ((4, 2), (8, 2), True),
    ((1, 3), (5, 3), False),
    ((4, 3), None, True),
    ((4, 3), None, False),
]


def _edge_lengths(chunk: int, shard: int) -> list[int]:
    """Lengths at every edge: below one chunk, around one chunk, around k = 1, 2 shards."""
    around = {k * shard + d for k in (1, 2) for d in (-1, 0, 1)}
    return sorted({1, chunk - 1, chunk, chunk + 1, *around} - {0})


def _write_zarr_python(path: Path, x: np.ndarray, chunk: Any, shard: Any, zstd: bool) -> None:
    from zarr.codecs import ZstdCodec

    a = zarr.create_array(
        path,
        shape=x.shape,
        dtype=x.dtype,
        chunks=chunk,
        shards=shard,
        compressors=ZstdCodec(level=1) if zstd else None,
        config={"write_empty_chunks": True},
    )
    a[:] = x


def _write_tensorstore(path: Path, x: np.ndarray, chunk: Any, shard: Any, zstd: bool) -> None:
    import tensorstore as ts

    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if zstd:
        codecs.append({"name": "zstd", "configuration": {"level": 1}})
    if shard is not None:
        index = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        conf = {"chunk_shape": list(chunk), "codecs": codecs, "index_codecs": index}
        codecs = [{"name": "sharding_indexed", "configuration": conf}]
    grid = {"name": "regular", "configuration": {"chunk_shape": list(shard or chunk)}}
    meta = {"shape": list(x.shape), "data_type": str(x.dtype), "chunk_grid": grid, "codecs": codecs}
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, "metadata": meta}
    ts.open(spec, create=True).result().write(x).result()


@pytest.mark.parametrize("layout", _EDGE_LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}-zstd{v[2]}")
@pytest.mark.parametrize("writer", [_write_zarr_python, _write_tensorstore], ids=["zarr", "ts"])
def test_arrays_ending_inside_a_chunk_or_shard_read_back_equal(
    tmp_path: Path, writer: Any, layout: tuple[Any, Any, bool]
) -> None:
    """Issue 25 item 6: inner chunks wholly outside the array are never written, so they are not
    missing; every length around the chunk and shard edges reads back equal to numpy on every
    backend (TensorStore, strict zarr-python, preadv)."""
    chunk, shard, zstd = layout
    for n in _edge_lengths(chunk[0], shard[0] if shard else 2 * chunk[0]):
        x = np.arange(n * 3, dtype=np.int32).reshape(n, 3) * 7 + 1
        path = tmp_path / f"a{n}"
        writer(path, x, chunk, shard, zstd)
        idx = list(range(n - 1, -1, -1))
        for backend, preadv in [("tensorstore", False), ("zarr", False), ("tensorstore", True)]:
            ds = ZarrDataset(path, backend=backend, preadv=preadv)
            assert len(ds) == n and bool(ds._preadv) == (preadv and not zstd and chunk[1] == 3)
            got = ds.read_batch(idx)
            assert np.array_equal(got.numpy(), x[idx]), (n, backend, preadv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_inner_chunk_inside_the_last_partial_shard_is_still_an_error(
    tmp_path: Path, backend: str
) -> None:
    """The edge rule skips only inner chunks outside the array: one inside it, in the last
    shard that the array ends in, is still missing."""
    x = np.arange(25 * 3, dtype=np.int32).reshape(25, 3) + 1
    x[16:20] = 0  # inner chunk 1 of shard 1 (rows 12..23) equals the fill value: not stored
    a = zarr.create_array(
        tmp_path / "a",
        shape=x.shape,
        dtype="int32",
        chunks=(4, 3),
        shards=(12, 3),
        compressors=None,
        config={"write_empty_chunks": False},
    )
    a[:] = x
    ds = ZarrDataset(tmp_path / "a", backend=backend, preadv=False)
    assert np.array_equal(ds.read_batch([24, 0]).numpy(), x[[24, 0]])
    with pytest.raises(DatasetError, match=r"c/1/0.*missing"):
        ds.read_batch(list(range(12, 24)))


@pytest.mark.parametrize(
    "encoding",
    [
        {"name": "v2", "separator": "."},
        {"name": "v2", "separator": "/"},
        {"name": "default", "separator": "."},
    ],
    ids=["v2-dot", "v2-slash", "default-dot"],
)
def test_partial_last_shard_under_every_chunk_key_encoding(
    tmp_path: Path, encoding: dict[str, str]
) -> None:
    """The shard's place in the grid (which inner chunks lie outside the array) is read from
    its key under every chunk key encoding."""
    x = np.arange(25 * 3, dtype=np.int32).reshape(25, 3) + 1
    a = zarr.create_array(
        tmp_path / "a", shape=x.shape, dtype="int32", chunks=(4, 3), shards=(12, 3),
        chunk_key_encoding=encoding,
    )  # fmt: skip
    a[:] = x
    ds = ZarrDataset(tmp_path / "a", backend="zarr", preadv=False)
    assert np.array_equal(ds.read_batch(list(range(24, -1, -1))).numpy(), x[::-1])


def _array(root: Path, *, sharded: bool, n: int = 64, zero_chunk: bool = False) -> np.ndarray:
    from zarr.codecs import ZstdCodec

    x = np.arange(n * 4, dtype=np.int32).reshape(n, 4) + 1
    if zero_chunk:
        x[8:16] = 0  # one inner chunk equal to the fill value
    a = zarr.create_array(
        root,
        shape=x.shape,
        chunks=(8, 4),
        shards=(32, 4) if sharded else None,
        dtype="int32",
        compressors=ZstdCodec(level=1),
        config={"write_empty_chunks": not zero_chunk},
    )
    a[:] = x
    return x


def _epoch(ds: Any, workers: int) -> list[Any]:
    loader = feedpipe.DataLoader(
        ds, batch_size=8, num_workers=workers, worker_type="process", timeout=60
    )
    return list(loader)


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
@pytest.mark.parametrize("parent_read_first", [False, True])
def test_missing_chunk_fails_the_epoch_in_process_workers(
    tmp_path: Path, parent_read_first: bool
) -> None:
    _array(tmp_path / "a", sharded=False)
    os.unlink(tmp_path / "a" / "c" / "5" / "0")
    ds = ZarrDataset(tmp_path / "a", preadv=False)
    if parent_read_first:  # TensorStore now runs in the parent: forked workers use zarr-python
        with pytest.raises(DatasetError, match="c/5/0"):
            ds.read_batch(list(range(40, 48)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(Exception, match=r"c/5/0|records \[40") as info:
            _epoch(ds, 2)
    assert str(tmp_path / "a") in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
@pytest.mark.parametrize("sharded", [False, True])
def test_zarr_python_backend_refuses_missing_chunks(tmp_path: Path, sharded: bool) -> None:
    _array(tmp_path / "a", sharded=sharded)
    victim = "c/1/0" if sharded else "c/3/0"
    os.unlink(tmp_path / "a" / victim)
    for backend in ("zarr", "tensorstore"):
        ds = ZarrDataset(tmp_path / "a", backend=backend, preadv=False)
        assert ds.read_batch([0, 1])[0, 0] == 1  # other chunks read fine
        with pytest.raises(DatasetError, match=victim if backend == "zarr" else "records"):
            ds.read_batch([40 if sharded else 26])


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
def test_missing_inner_chunk_of_a_shard_is_an_error(tmp_path: Path) -> None:
    _array(tmp_path / "a", sharded=True, zero_chunk=True)  # inner chunk 1 of shard 0 not stored
    for backend in ("zarr", "tensorstore"):
        ds = ZarrDataset(tmp_path / "a", backend=backend, preadv=False)
        with pytest.raises(DatasetError):
            ds.read_batch([9])


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
def test_remote_zarr_missing_chunk_is_an_error(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    _array(tmp_path / "a", sharded=False, n=32)
    fs = fsspec.filesystem("s3", **opts)
    fs.put(str(tmp_path / "a"), f"{bucket}/a", recursive=True)
    fs.rm_file(f"{bucket}/a/c/2/0")
    ds = ZarrDataset(f"s3://{bucket}/a", storage_options=opts)
    assert int(ds.read_batch([0])[0, 0]) == 1
    with pytest.raises(DatasetError, match="c/2/0"):
        ds.read_batch([17])


# ---------------------------------------------------------------------- malformed metadata
_JSON = json_values()


def _mutate(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not path:
        return value
    doc = json.loads(json.dumps(doc))
    node = doc
    for k in path[:-1]:
        node = node[k]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


def _raw_cases() -> list[str]:
    return [
        "[" * 100_000 + "]" * 100_000,
        '{"zarr_format": 3, "node_type": "array", "shape": [Infinity], "data_type": "int32"}',
        "\xff",
        "",
    ]


def _check_only_dataset_errors(open_and_read: Any, where: str) -> None:
    try:
        open_and_read()
    except DatasetError as exc:
        assert where in str(exc)


@pytest.fixture(scope="module")
def zarr_template() -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        _array(Path(tmp) / "a", sharded=True, n=32)
        yield Path(tmp) / "a"


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_malformed_zarr_json_raises_only_dataset_error(zarr_template: Path, data: Any) -> None:
    good = json.loads((zarr_template / "zarr.json").read_text())
    path = data.draw(st.sampled_from(_paths(good)))
    value = data.draw(_JSON)
    doc = _mutate(good, path, value, data.draw(st.booleans()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "a"
        root.mkdir()
        os.symlink(zarr_template / "c", root / "c")
        (root / "zarr.json").write_text(json.dumps(doc))
        for backend in ("zarr", "tensorstore"):

            def go(backend: str = backend) -> None:
                ds = ZarrDataset(root, backend=backend)
                ds.read_batch([0, len(ds) - 1] if len(ds) else [])

            _check_only_dataset_errors(go, str(root))


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
@pytest.mark.parametrize("raw", _raw_cases())
def test_hostile_zarr_json_text(tmp_path: Path, raw: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "zarr.json").write_text(raw, errors="surrogateescape")
    with pytest.raises(DatasetError, match=r"zarr\.json"):
        ZarrDataset(tmp_path / "a")


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
def test_zarr_json_without_shape_names_the_file(tmp_path: Path) -> None:
    _array(tmp_path / "a", sharded=False, n=8)
    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    del meta["shape"]
    (tmp_path / "a" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"a/zarr\.json.*shape"):
        ZarrDataset(tmp_path / "a")


@pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None, reason="needs tensorstore")
@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("chunk_grid", "configuration", "chunk_shape", 0), float("inf")),  # found by hypothesis
        (("chunk_grid", "configuration", "chunk_shape", 0), 0),
        (("chunk_grid", "configuration", "chunk_shape"), [4, 4, 4, 4, 4]),
        (("codecs", 0, "configuration", "chunk_shape", 0), "x"),
    ],
)
def test_bad_chunk_shapes_are_dataset_errors(
    zarr_template: Path, tmp_path: Path, path: tuple[Any, ...], value: Any
) -> None:
    """A chunk shape no backend can use is refused at open, naming the file."""
    doc = _mutate(json.loads((zarr_template / "zarr.json").read_text()), path, value, False)
    root = tmp_path / "a"
    root.mkdir()
    os.symlink(zarr_template / "c", root / "c")
    (root / "zarr.json").write_text(json.dumps(doc))
    for backend in ("zarr", "tensorstore"):
        with pytest.raises(DatasetError, match="chunk_shape"):
            ZarrDataset(root, backend=backend).read_batch([0])
