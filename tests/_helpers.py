"""Helpers shared by several test files: one definition each (issue 26 item 7).

- tiny datasets of every kind (``fixed_memmap``, ``columns_memmap``, ``bytes_memmap``,
  ``token_windows``, ``zarr_group``, ``mixed``, ``tar_shards``);
- ``copy_batch``: a batch with every tensor copied to the CPU (nothing keeps a worker slot).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset, TokenWindows


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
