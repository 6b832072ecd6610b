"""Helpers shared by several test files: one definition each (issue 26 item 7).

- tiny datasets of every kind (``fixed_memmap``, ``columns_memmap``, ``bytes_memmap``,
  ``token_windows``, ``zarr_group``, ``mixed``, ``tar_shard(s)``);
- ``copy_batch``: a batch with every tensor copied to the CPU (nothing keeps a worker slot);
- S3 against the moto server (``s3_options``, ``s3_fs``, ``remote_options``), the
  states ckpt tests save (``big_state``, ``small_state``, ``save_two_steps``);
- small things: ``tree_bytes``, ``json_paths``, ``json_values`` (a hypothesis strategy),
  ``rng_warnings``, ``QuietHandler``, ``FakeClock`` (conftest's ``clock`` fixture installs one),
  ``fresh_worker_slots`` (an autouse fixture for the test modules that import it).
"""

from __future__ import annotations

import http.server
import io
import json
import os
import tarfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ckpt import format as fmt
from feedpipe import MemmapDataset, MemmapWriter, MixedDataset, TokenWindows
from feedpipe.io.crc import crc32c, to_hex

MIB = 1 << 20


def copy_batch(batch: Any) -> Any:
    """``batch`` with every tensor copied to the CPU (nothing keeps a worker slot or the GPU)."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().to("cpu", copy=True)
    if isinstance(batch, dict):
        return {k: copy_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(copy_batch(v) for v in batch)
    return batch


# ------------------------------------------------------------------------- tiny datasets
def fixed_memmap(path: Path, base: int = 0, n: int = 22) -> MemmapDataset:
    """Fixed records of shape (3,) int64 (``base + i`` each) with an int32 ``label`` field."""
    x = (base + np.arange(n, dtype=np.int64))[:, None] * np.ones((1, 3), np.int64)
    with MemmapWriter(
        path, shape=(3,), dtype="int64", fields={"label": "int32"}, shard_bytes=200
    ) as w:
        w.append_batch(x, label=np.arange(n, dtype=np.int32) % 5)
    return MemmapDataset(path)


def columns_memmap(path: Path, n: int = 22) -> MemmapDataset:
    """Ragged int16 records with typed columns: ragged int32, str, json and int64."""
    rng = np.random.default_rng(0)
    spec = {"tokens": ("int32", (None,)), "text": "str", "meta": "json", "label": "int64"}
    with MemmapWriter(path, shape=(None,), dtype="int16", fields=spec, shard_bytes=120) as w:
        for i in range(n):
            k = int(rng.integers(0, 7))
            w.append(
                np.arange(i % 5, dtype=np.int16),
                tokens=rng.integers(-5, 1000, k).astype(np.int32),
                text="é" * k + f"-{i}",
                meta={"i": i, "tags": ["x"] * (k % 3)},
                label=i * 3,
            )
    return MemmapDataset(path)


def bytes_memmap(path: Path, n: int = 22) -> MemmapDataset:
    """The bytes layout: records of 0-79 random bytes, with ``label`` and ``pair`` fields."""
    rng = np.random.default_rng(2)
    with MemmapWriter(
        path, fields={"label": "int64", "pair": ("float32", (2,))}, shard_bytes=300
    ) as w:
        for i in range(n):
            w.append(
                rng.integers(0, 256, rng.integers(0, 80), dtype=np.uint8).tobytes(),
                label=i,
                pair=[i, -i],
            )
    return MemmapDataset(path)


def token_windows(path: Path, docs: int = 12, block_size: int = 5) -> TokenWindows:
    """Windows of ``block_size`` tokens over ``docs`` documents of 0-19 int32 tokens."""
    rng = np.random.default_rng(1)
    fields = {"tokens": ("int32", (None,))}
    with MemmapWriter(path, records=False, fields=fields, shard_bytes=160) as w:
        for k in rng.integers(0, 20, docs):
            w.append(tokens=rng.integers(0, 50_000, k).astype(np.int32))
    return TokenWindows(path, block_size=block_size)


def mixed(path: Path, n: int = 22) -> MixedDataset:
    """Two fixed memmaps (13 and 5 records) mixed 2:1, ``n`` samples an epoch."""
    members = {"a": fixed_memmap(path / "a", 1000, 13), "b": fixed_memmap(path / "b", 2000, 5)}
    return MixedDataset(members, weights={"a": 2, "b": 1}, seed=3, epoch_samples=n)


def zarr_group(path: Path, n: int = 22) -> Path:
    """A zarr group of a sharded ``data`` array (n, 4, 8) int32 and an int64 ``label``."""
    import zarr

    x = np.random.default_rng(0).integers(0, 1000, (n, 4, 8)).astype(np.int32)
    g = zarr.open_group(path, mode="w")
    a = g.create_array("data", shape=x.shape, chunks=(5, 4, 8), shards=(10, 4, 8), dtype="int32")
    a[:] = x
    lab = g.create_array("label", shape=(n,), chunks=(8,), dtype="int64")
    lab[:] = np.arange(n)
    return path


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar file holding ``members`` (name, bytes) in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def tar_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A webdataset tar shard at ``path``: for each ``(key, {ext: bytes})`` a ``key.ext``
    member per field, in order."""
    write_tar(
        path, [(f"{key}.{ext}", data) for key, fields in samples for ext, data in fields.items()]
    )
    return path


def tar_shards(path: Path, shards: int = 3, per: int = 8) -> list[str]:
    """``shards`` webdataset-style tar shards of ``per`` samples (``.bin`` and ``.cls``)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(4)
    out = []
    for s in range(shards):
        members = []
        for i in range(per):
            key = f"sample{s:02d}{i:03d}"
            data = rng.integers(0, 256, 10 + i, dtype=np.uint8).tobytes()
            members += [(f"{key}.bin", data), (f"{key}.cls", str(i).encode())]
        write_tar(path / f"shard-{s:03d}.tar", members)
        out.append(str(path / f"shard-{s:03d}.tar"))
    return out


# ------------------------------------------------------------------ S3 and ckpt states
def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec storage_options for s3fs against a local endpoint (conftest's ``s3_server``)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def s3_fs(endpoint: str) -> Any:
    """An ``s3fs.S3FileSystem`` on the moto server at ``endpoint``."""
    import s3fs

    return s3fs.S3FileSystem(**s3_options(endpoint))


def remote_options(bucket: str, endpoint: str, **kw: Any) -> Any:
    """ckpt ``RemoteOptions`` for ``s3://bucket/run`` with short test defaults (20 s deadline,
    4 threads, 5 MiB blocks) unless ``kw`` says otherwise."""
    from ckpt.remote import RemoteOptions

    kw.setdefault("deadline_s", 20.0)
    kw.setdefault("threads", 4)
    kw.setdefault("block_bytes", 5 * MIB)
    return RemoteOptions(f"s3://{bucket}/run", storage_options=s3_options(endpoint), **kw)


def big_state(step: int) -> dict[str, Any]:
    """An 11 MiB state (three 5 MiB upload parts), different for each step."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(11 * MIB // 4, generator=g), "step": step}


def small_state(step: int) -> dict[str, Any]:
    """A 4 kB state that says its step."""
    return {"w": torch.full((1000,), float(step)), "step": step}


def save_two_steps(root: Path) -> Path:
    """A checkpoint directory at ``root`` with steps 1 and 2 of ``small_state``."""
    from ckpt.manager import CheckpointManager

    with CheckpointManager(root, keep_last=None) as m:
        for s in (1, 2):
            m.save(s, small_state(s)).result(30)
    return root


# --------------------------------------------------------------------------- small things
def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root``: relative path -> contents."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indices) of every node of a JSON document, the root first."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += json_paths(v, (*prefix, i))
    return out


def json_values() -> Any:
    """A hypothesis strategy for JSON documents, and the values that break naive parsers
    (infinities, 2**64, -1, empty containers)."""
    from hypothesis import strategies as st

    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=12,
    ) | st.sampled_from([float("inf"), float("-inf"), -1, 2**64, 1.5, True, "", "x", [], {}, [-1]])


def rng_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    """The recorded warnings about the global RNG."""
    return [str(w.message) for w in record if "global RNG" in str(w.message)]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """A static file handler that logs nothing."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def fresh_worker_slots() -> Iterator[None]:
    """The process's worker slot registry is empty before and after each test of a module that
    imports this fixture (autouse there only: this is not a conftest)."""
    from feedpipe.loader import slots as slots_mod

    slots_mod._WORKER.clear()
    yield
    slots_mod._WORKER.clear()


class FakeClock:
    """A deterministic perf_counter: tests advance it explicitly."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def state_with_empties(step: int) -> dict[str, Any]:
    return {
        "w": torch.full((4, 3), float(step)),
        "z": torch.empty(0, 3),
        "a": np.full(3, step, dtype="<f4"),
        "za": np.empty((0, 2), dtype="<f4"),
        "size": torch.Size([2, 3]),
        "step": step,
    }


def write_raw(step_dir: Path, body: Any) -> None:
    """Write ``body`` as the manifest with a correct CRC32C, whatever it holds (NaN included)."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    text = b'{"crc32c":"' + to_hex(crc32c(canon)).encode() + b'","body":' + canon + b"}\n"
    (step_dir / fmt.MANIFEST).write_bytes(text)


# ------------------------------------------------- global-RNG warnings blame the right thread
class RngFreeItems(Dataset):  # type: ignore[type-arg]
    """Leaves every global RNG alone; items 2, 3 (worker 1's first batch) are slow."""

    def __init__(self, slow_s: float = 0.0) -> None:
        self.slow_s = slow_s

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if i in {2, 3}:
            time.sleep(self.slow_s)
        return i


def fail_on_5(sample: Any) -> Any:
    if int(np.asarray(sample).reshape(-1)[0]) == 5:
        raise ValueError("cannot decode sample 5")
    return sample


class Squares(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i * i


# ---------------------------------------------------------------------- 2: one file:// rule
def file_url_fixtures(root: Path) -> dict[str, Path]:
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


# ------------------------------------------------------------------------------ batch indices
def fixed_int32_dataset(path: Path, n: int = 20, shard_bytes: int = 8192) -> np.ndarray:
    """A fixed-layout dataset of ``n`` records of 1024 int32 (2 records per shard)."""
    x = np.repeat(np.arange(n, dtype=np.int32)[:, None], 1024, axis=1)
    with MemmapWriter(path, shape=(1024,), dtype="int32", shard_bytes=shard_bytes) as w:
        w.append_batch(x)
    return x


def relocate_dataset(root: Path, renames: dict[str, str]) -> dict[str, str]:
    """Rename dataset files (into subdirectories too) and rewrite index.json to match."""
    doc = json.loads((root / "index.json").read_text())
    for shard in doc["shards"]:
        for info in shard["files"].values():
            new = renames.get(info["path"])
            if new is not None:
                (root / new).parent.mkdir(parents=True, exist_ok=True)
                os.replace(root / info["path"], root / new)
                info["path"] = new
    (root / "index.json").write_text(json.dumps(doc))
    return renames
