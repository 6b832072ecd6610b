"""DCP through ckpt storage on real gloo ranks: sharded save, load at another world size, plain DCP
``FileSystemWriter`` parity, async_save staging, remote upload of the committed step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _dist import run_ranks

from ckpt import format as fmt
from ckpt.errors import CorruptCheckpointError
from ckpt.saving import commit

ROWS, COLS = 10, 6  # 10 rows shard unevenly over 3 and 4 ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _full(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(ROWS, COLS, generator=g) * scale,
        "emb": (torch.randn(7, 4, generator=g) * scale).to(torch.bfloat16),
        "bias": torch.randn(COLS, generator=g) * scale,
    }


def _sharded(mesh: Any, scale: float) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = _full(scale)
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(1)]),
            "bias": distribute_tensor(full["bias"], mesh, [Replicate()]),
        },
        "meta": {"step": int(scale * 10), "name": "run"},
    }


def _remote_opts(endpoint: str, bucket: str) -> Any:
    from ckpt.remote import RemoteOptions

    return RemoteOptions(
        f"s3://{bucket}/dcp",
        storage_options={
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        },
        deadline_s=20.0,
    )


def _save(  # noqa: PLR0917 - run_ranks passes positional args
    rank: int, world: int, root: str, fsdir: str, endpoint: str, bucket: str
) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt.dcp import CkptStorageWriter, checkpoint_group
    from ckpt.manager import CheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    pg = checkpoint_group()  # DCP's collectives stay off the training group
    manager = None
    if rank == 0:
        manager = CheckpointManager(root, remote=_remote_opts(endpoint, bucket))
    state = _sharded(mesh, 1.0)
    dcp.save(state, storage_writer=CkptStorageWriter(root, 1, manager=manager), process_group=pg)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(fsdir), process_group=pg)
    # async_save stages through the writer's pool; mutating afterwards must not leak into step 2
    state2 = _sharded(mesh, 2.0)
    writer = CkptStorageWriter(root, 2, manager=manager)
    response = dcp.async_save(state2, storage_writer=writer, process_group=pg)
    for t in state2["model"].values():
        t.to_local().fill_(-7.0)
    getattr(response, "upload_completion", response).result(timeout=60)
    files = sorted(p.name for p in (Path(root) / "step-2").iterdir())
    uploads = None
    if manager is not None:
        manager.wait(timeout=60, uploads=True)
        uploads = {s: u.state for s, u in manager.stats.remote.uploads.items()}  # type: ignore[union-attr]
        manager.close()
    return files, writer.pool.allocated_bytes, uploads


def _load(rank: int, world: int, root: str, fsdir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt.dcp import CkptStorageReader, checkpoint_group

    mesh = init_device_mesh("cpu", (world,))
    pg = checkpoint_group()
    out = {}
    readers = {
        "ckpt1": lambda: CkptStorageReader(root, 1),
        "ckpt2": lambda: CkptStorageReader(root, 2),
        "fs": lambda: dcp.FileSystemReader(fsdir),
    }
    for name, make in readers.items():
        state = _sharded(mesh, 0.0)
        dcp.load(state, storage_reader=make(), process_group=pg)
        # numpy, not tensors: tensors would cross the result queue as shared-memory handles
        full = {k: v.full_tensor().float().numpy() for k, v in state["model"].items()}
        out[name] = (full, state["meta"])
    return out


@pytest.mark.timeout(240)
def test_sharded_save_reshard_load_and_parity(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    bucket, _ = s3_bucket
    root, fsdir = str(tmp_path / "ckpt"), str(tmp_path / "fs")
    saved = run_ranks(_save, 2, root, fsdir, s3_server, bucket, timeout=150)
    files, pooled, uploads = saved[0]
    assert files == ["manifest.json", "rank-00000.bin", "rank-00001.bin"]  # one file per rank
    assert pooled > 0 and saved[1][1] > 0  # async_save staged through each rank's pool
    assert uploads == {1: "done", 2: "done"}
    assert commit.steps(Path(root)) == [1, 2] and commit.read_latest(Path(root)) == 2
    loaded = run_ranks(_load, 3, root, fsdir, timeout=150)
    for rank_out in loaded:
        for name, scale in (("ckpt1", 1.0), ("ckpt2", 2.0), ("fs", 1.0)):
            full, meta = rank_out[name]
            for key, want in _full(scale).items():
                assert np.array_equal(full[key], want.float().numpy()), (name, key)
            assert meta == {"step": int(scale * 10), "name": "run"}
    # the remote copy is a complete ckpt step too
    import s3fs

    from ckpt.remote import list_remote

    fs = s3fs.S3FileSystem(**_remote_opts(s3_server, bucket).storage_options)
    listing = list_remote(fs, f"{bucket}/dcp")
    assert sorted(s for s, e in listing.items() if e.committed) == [1, 2]
    # single process (no_dist): resharded into whole tensors; ckpt and plain DCP agree
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageReader
    from ckpt.manager import CheckpointManager

    # a machine without the local copy fetches it (verified) from the remote, then loads it
    fresh = tmp_path / "fresh"
    with CheckpointManager(fresh, remote=_remote_opts(s3_server, bucket)) as m:
        assert m.fetch(2) == fresh / "step-2"
    state = {"model": {k: torch.zeros_like(v) for k, v in _full(2.0).items()}}
    dcp.load(state, storage_reader=CkptStorageReader(fresh, 2), no_dist=True)
    for key, want in _full(2.0).items():
        assert torch.equal(state["model"][key], want)

    for reader in (CkptStorageReader(root, 1), dcp.FileSystemReader(fsdir)):
        state = {"model": {k: torch.zeros_like(v) for k, v in _full(1.0).items()}}
        dcp.load(state, storage_reader=reader, no_dist=True)
        for key, want in _full(1.0).items():
            assert torch.equal(state["model"][key], want)
    # a flipped byte in one rank's file is caught and named
    data = Path(root) / "step-1" / "rank-00001.bin"
    raw = bytearray(data.read_bytes())
    raw[3] ^= 0x01
    data.write_bytes(bytes(raw))
    state = {"model": {k: torch.zeros_like(v) for k, v in _full(1.0).items()}}
    from torch.distributed.checkpoint.api import CheckpointException

    # DCP wraps a rank's error in a CheckpointException that carries its traceback text
    with pytest.raises(CheckpointException, match=r"CorruptCheckpointError.*rank-00001\.bin"):
        dcp.load(state, storage_reader=CkptStorageReader(root, 1), no_dist=True)
    body = fmt.read_manifest(Path(root) / "step-2")
    assert "dcp" in body["metadata"] and "pickle" not in str(body)


def test_metadata_roundtrip_and_bad_ids(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageReader, CkptStorageWriter, decode_metadata, encode_metadata

    state = {"a": torch.arange(6.0).view(2, 3), "n": 3, "nested": {"b": torch.ones(2)}}
    dcp.save(state, storage_writer=CkptStorageWriter(tmp_path, 5), no_dist=True)
    reader = CkptStorageReader(checkpoint_id := tmp_path / "step-5")
    reader.reset(checkpoint_id)
    md = reader.read_metadata()
    again = decode_metadata(encode_metadata(md))
    assert again.state_dict_metadata.keys() == md.state_dict_metadata.keys()
    assert again.storage_data == md.storage_data
    out = {"a": torch.zeros(2, 3), "n": 0, "nested": {"b": torch.zeros(2)}}
    dcp.load(out, checkpoint_id=tmp_path / "step-5", storage_reader=CkptStorageReader())
    assert torch.equal(out["a"], state["a"]) and out["n"] == 3
    with pytest.raises(CorruptCheckpointError, match="DCP metadata is malformed"):
        decode_metadata({"entries": {"x": {"type": "tensor"}}}, "here")
    from ckpt.errors import CheckpointError

    with pytest.raises(CheckpointError, match="step-N"):
        CkptStorageWriter().reset(tmp_path / "not-a-step")


def test_dcp_coordinator_becomes_the_writer(tmp_path: Path) -> None:
    """The DCP coordinator takes the writer lock and clears leftovers before any rank writes."""
    from ckpt import _layout
    from ckpt.dcp import CkptStorageWriter
    from ckpt.errors import CheckpointError
    from ckpt.manager import CheckpointManager, WriteOptions

    leftover = tmp_path / _layout.tmp_name(_layout.step_name(9), "dcp")
    leftover.mkdir()
    with CheckpointManager(tmp_path) as m:
        assert leftover.exists()  # nothing removed until a writer is needed
        CkptStorageWriter(tmp_path, 1, manager=m).set_up_storage_writer(True, rank=0)
        assert not leftover.exists()
        other = CheckpointManager(tmp_path, write=WriteOptions(lock_timeout_s=0.2))
        with pytest.raises((CheckpointError, TimeoutError)):
            other.ensure_writer()
        other.close()
