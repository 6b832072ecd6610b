"""Steps saved from CUDA restore on a CPU-only host: mapped to the CPU with a warning (never
skipped); a bad ``map_location`` is an error, not a fallback; every fallback is logged."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")


def _as_saved_on(step_dir: Path, device: str) -> None:
    """Rewrite a step's manifest as if its tensors had been saved on ``device`` (CRC recomputed)."""
    body = fmt.read_manifest(step_dir)
    for entry in body["entries"]:
        if entry["kind"] == "tensor":
            entry["device"] = device
    fmt.write_manifest(step_dir, body)


def _two_steps(root: Path) -> CheckpointManager:
    m = CheckpointManager(root, keep_last=None)
    for step in (1, 2):
        m.save(step, {"w": torch.full((3,), float(step)), "step": step}).result()
    return m


@pytest.mark.parametrize("device", ["cuda:0", "cuda", "mps"])
def test_cuda_step_maps_to_cpu_with_a_warning(
    tmp_path: Path, device: str, caplog: pytest.LogCaptureFixture
) -> None:
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("MPS is available here")
    m = _two_steps(tmp_path)
    _as_saved_on(tmp_path / "step-2", device)
    with (
        pytest.warns(UserWarning, match=rf"{device} -> cpu.*map_location"),
        caplog.at_level(logging.WARNING, logger="ckpt"),
    ):
        state = m.restore()
    assert state["step"] == 2 and state["w"].device.type == "cpu"
    assert torch.equal(state["w"], torch.full((3,), 2.0))
    assert m.stats.last_restore is not None and m.stats.last_restore.skipped == []
    assert any("map_location" in r.getMessage() for r in caplog.records)
    target = torch.zeros(3)
    into = {"w": target, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the bytes go straight into the CPU tensor: nothing mapped
        m.restore(into=into)
    assert into["step"] == 2 and into["w"] is target and torch.equal(target, torch.full((3,), 2.0))
    m.close()


def test_map_location_cpu_is_silent(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    m = _two_steps(tmp_path)
    _as_saved_on(tmp_path / "step-2", "cuda:0")
    assert m.restore(map_location="cpu")["step"] == 2
    assert not [w for w in recwarn if "map_location" in str(w.message)]
    m.close()


def test_bad_map_location_raises_instead_of_falling_back(tmp_path: Path) -> None:
    m = _two_steps(tmp_path)
    with pytest.raises(CheckpointError, match="map_location='cuda'"):
        m.restore(map_location="cuda")
    with pytest.raises(CheckpointError, match="map_location='nowhere'"):
        m.restore(map_location="nowhere")
    m.close()


def test_simple_load_maps_too(tmp_path: Path) -> None:
    path = ckpt.save(tmp_path / "one", {"w": torch.ones(2)})
    _as_saved_on(path, "cuda:0")
    with pytest.warns(UserWarning, match="cuda:0 -> cpu"):
        assert torch.equal(ckpt.load(path)["w"], torch.ones(2))
