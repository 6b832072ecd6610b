"""Zarr reads never return fill values for missing chunks (any backend, any worker), and
malformed ``zarr.json`` metadata is a ``DatasetError`` naming the file (issue 16, points 9, 10)."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import json_paths as _paths
from _helpers import json_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe import DatasetError, ZarrDataset

zarr = pytest.importorskip("zarr")
pytest.importorskip("tensorstore")


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


def test_missing_inner_chunk_of_a_shard_is_an_error(tmp_path: Path) -> None:
    _array(tmp_path / "a", sharded=True, zero_chunk=True)  # inner chunk 1 of shard 0 not stored
    for backend in ("zarr", "tensorstore"):
        ds = ZarrDataset(tmp_path / "a", backend=backend, preadv=False)
        with pytest.raises(DatasetError):
            ds.read_batch([9])


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


@pytest.mark.parametrize("raw", _raw_cases())
def test_hostile_zarr_json_text(tmp_path: Path, raw: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "zarr.json").write_text(raw, errors="surrogateescape")
    with pytest.raises(DatasetError, match=r"zarr\.json"):
        ZarrDataset(tmp_path / "a")


def test_zarr_json_without_shape_names_the_file(tmp_path: Path) -> None:
    _array(tmp_path / "a", sharded=False, n=8)
    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    del meta["shape"]
    (tmp_path / "a" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"a/zarr\.json.*shape"):
        ZarrDataset(tmp_path / "a")


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
