"""DCP through ckpt never runs code from a checkpoint, and DCP steps are loaded the documented ways.

A hostile byte item (a pickle that would create a file when unpickled), placed in a step with
every CRC recomputed so the step looks valid, must make ``dcp.load`` raise a clear error without
running it, and ``ckpt verify`` must report the step as bad. ``CheckpointManager.restore`` and
``ckpt.load`` on a DCP step raise an error that points to ``CkptStorageReader``.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
from ckpt import format as fmt
from ckpt.cli import main as ckpt_main
from ckpt.errors import CheckpointError, CorruptCheckpointError, DcpCheckpointError
from ckpt.manager import CheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Evil:
    """Unpickling this creates the marker file (a stand-in for ``os.system``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.marker, "w")


def _state(scale: float = 1.0) -> dict[str, Any]:
    return {"w": torch.arange(12.0).view(3, 4) * scale, "meta": {"step": 5, "name": "run"}}


def _save(root: Path, step: int = 5) -> Path:
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageWriter

    dcp.save(_state(), storage_writer=CkptStorageWriter(root, step), no_dist=True)
    return root / f"step-{step}"


def _plant(step_dir: Path, fqn: str, payload: bytes) -> None:
    """Replace byte item ``fqn`` by ``payload`` and recompute every CRC: the step stays valid."""
    body = fmt.read_manifest(step_dir)
    storage = body["metadata"]["dcp"]["storage_data"]
    item = next(s for s in storage if s[0] == fqn)
    loc = item[3]
    assert loc["kind"] == "bytes"
    rec = next(r for r in body["files"] if r["name"] == loc["file"])
    data = bytearray((step_dir / rec["name"]).read_bytes())
    data += bytes(-len(data) % fmt.ALIGN)
    loc["offset"], loc["nbytes"] = len(data), len(payload)
    data += payload
    (step_dir / rec["name"]).write_bytes(bytes(data))
    new = fmt.write_file(step_dir / rec["name"], memoryview(bytes(data)), None, rec["chunk_bytes"])
    rec.update(new)
    body["nbytes"] = sum(r["size"] for r in body["files"])
    fmt.write_manifest(step_dir, body)
    fmt.read_manifest(step_dir)  # still a valid manifest


def _evil_payload(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(_Evil(str(marker)), buf)
    return buf.getvalue()


def test_hostile_byte_item_never_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageReader

    step_dir = _save(tmp_path / "run")
    marker = tmp_path / "PWNED"
    _plant(step_dir, "meta.name", _evil_payload(marker))
    # the payload really runs under an unsafe loader (the test would prove nothing otherwise)
    torch.load(io.BytesIO(_evil_payload(tmp_path / "control")), weights_only=False)
    assert (tmp_path / "control").exists()

    for reader in (CkptStorageReader(tmp_path / "run", 5), CkptStorageReader(step_dir)):
        # DCP wraps a rank's error into its CheckpointException, keeping our message
        with pytest.raises((CorruptCheckpointError, CheckpointException)) as info:
            dcp.load(_state(0.0), storage_reader=reader, no_dist=True)
        assert "CorruptCheckpointError" in str(info.value) or info.type is CorruptCheckpointError
        assert re.search(r"item .meta\.name.: byte item cannot be loaded safely", str(info.value))
        assert "Unsupported global" in str(info.value)
        assert not marker.exists()

    assert ckpt_main(["verify", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "step 5: FAILED" in out and "meta.name" in out and "OK" not in out
    assert not marker.exists()


def test_byte_items_roundtrip_and_step_dir_form(tmp_path: Path) -> None:
    """The documented forms: ``CkptStorageReader(DIR, step)``, ``("DIR/step-N")``, ``(DIR)``."""
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageReader, CkptStorageWriter

    root = tmp_path / "ckpt"
    _save(root, 5)
    dcp.save(_state(2.0), storage_writer=CkptStorageWriter(root / "step-7"), no_dist=True)
    for reader, scale in [
        (CkptStorageReader(root, 5), 1.0),
        (CkptStorageReader(root / "step-5"), 1.0),
        (CkptStorageReader(str(root / "step-5")), 1.0),
        (CkptStorageReader(root), 2.0),  # newest
    ]:
        state = {"w": torch.zeros(3, 4), "meta": {"step": 0, "name": ""}}
        dcp.load(state, storage_reader=reader, no_dist=True)
        assert torch.equal(state["w"], torch.arange(12.0).view(3, 4) * scale)
        assert state["meta"] == {"step": 5, "name": "run"}
    assert ckpt_main(["verify", str(root)]) == 0


def test_unsafe_item_refused_at_save(tmp_path: Path) -> None:
    """An item that ``weights_only=True`` could not read back fails the save, naming it."""
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageWriter

    state = {"w": torch.ones(2), "extra": _Evil(str(tmp_path / "never"))}
    with pytest.raises((CheckpointError, CheckpointException)) as info:
        dcp.save(state, storage_writer=CkptStorageWriter(tmp_path / "run", 1), no_dist=True)
    assert re.search(r"step-1: item 'extra': .*cannot be stored without pickle", str(info.value))
    assert not (tmp_path / "run" / "step-1").exists()
    assert not (tmp_path / "never").exists()


def test_manager_restore_of_dcp_step_is_an_error(tmp_path: Path) -> None:
    """Never ``{}`` silently, never a silent fallback to an older, non-DCP step."""
    root = tmp_path / "run"
    with CheckpointManager(root) as manager:
        manager.save(3, {"w": torch.ones(2)}).result(30)
    _save(root, 5)
    reader = CheckpointManager(root)
    into = {"w": torch.zeros(3, 4)}
    for call in (lambda: reader.restore(into=into), lambda: reader.restore(5, into=into)):
        with pytest.raises(DcpCheckpointError, match=r"written by DCP.*CkptStorageReader"):
            call()
    assert torch.equal(into["w"], torch.zeros(3, 4))
    with pytest.raises(DcpCheckpointError, match="CkptStorageReader"):
        ckpt.load(root / "step-5")
    assert reader.restore(3)["w"].tolist() == [1.0, 1.0]
    assert os.path.isdir(root / "step-5")


def test_user_metadata_named_dcp_is_not_a_dcp_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"w": torch.ones(2)}, metadata={"dcp": {"note": "mine"}}).result(30)
        assert manager.restore()["w"].tolist() == [1.0, 1.0]
    assert ckpt_main(["verify", str(tmp_path)]) == 0
