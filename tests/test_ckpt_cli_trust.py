"""The ``ckpt`` command keeps what it must keep and reads what ckpt writes (issue 15, 4 and 13)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import _commit, cli
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions, read_status


def _populate(root: Path, steps: tuple[int, ...] = (10, 20, 30), **kw: Any) -> None:
    with CheckpointManager(root, keep_last=None, **kw) as m:
        for step in steps:
            m.save(step, {"w": torch.ones(1000) * step, "step": step}, metadata={"s": step})
        m.wait()


def _unrestorable(step_dir: Path) -> None:
    """Make a step whose manifest and data CRCs are valid but whose tree cannot be rebuilt."""
    body = fmt.read_manifest(step_dir)
    body["tree"] = {"t": "dict", "items": [["w", {"t": "tensor", "i": 99}]]}
    fmt.write_manifest(step_dir, body)


# ---- 4: gc uses the manager's retention rule, with the same guards ------------------------------
def test_gc_keep_last_counts_only_restorable_steps(tmp_path: Path, capsys: Any) -> None:
    _populate(tmp_path)
    _unrestorable(tmp_path / "step-30")
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept step 20 (newest valid checkpoint)" in out
    assert "kept step 30 (not restorable" in out and "deleted step 10" in out
    assert _commit.steps(tmp_path) == [20, 30]


def test_manager_retention_counts_only_restorable_steps(tmp_path: Path) -> None:
    _populate(tmp_path)
    _unrestorable(tmp_path / "step-30")
    with CheckpointManager(tmp_path, keep_last=1) as m:
        assert m.gc() == [10]  # the same rule as `ckpt gc`: step 20 replaces the bad step 30
        assert m.steps() == [20, 30]


def test_gc_keeps_steps_whose_upload_is_pending(
    tmp_path: Path, s3_bucket: tuple[str, dict], capsys: Any
) -> None:
    pytest.importorskip("s3fs")
    bucket, opts = s3_bucket
    missing = RemoteOptions(f"s3://{bucket}-missing/run", storage_options=opts, deadline_s=2)
    with CheckpointManager(tmp_path, keep_last=None, remote=missing) as m:
        for step in (10, 20, 30):
            m.save(step, {"w": torch.ones(10) * step})
        with pytest.raises(CheckpointError, match="upload of step 10"):
            m.wait(uploads=True)
    assert {s: st["state"] for s, st in read_status(tmp_path).items()} == {
        10: "failed",
        20: "failed",
        30: "failed",
    }
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept step 10 (upload not finished)" in out and "deleted" not in out
    assert _commit.steps(tmp_path) == [10, 20, 30]
    # once uploaded (a manager with the right bucket reconciles), gc may delete them
    good = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, deadline_s=10)
    with CheckpointManager(tmp_path, keep_last=None, remote=good) as m:
        m.wait(uploads=True)
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert _commit.steps(tmp_path) == [30]
    status = json.loads((tmp_path / "upload-status.json").read_text())
    assert status["steps"]["30"]["state"] == "done"
