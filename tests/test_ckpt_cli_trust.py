"""The ``ckpt`` command keeps what it must keep and reads what ckpt writes (issue 15, 4 and 13)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import cli
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions, read_status
from ckpt.saving import commit


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
    assert commit.steps(tmp_path) == [20, 30]


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
    assert commit.steps(tmp_path) == [10, 20, 30]
    # once uploaded (a manager with the right bucket reconciles), gc may delete them
    good = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, deadline_s=10)
    with CheckpointManager(tmp_path, keep_last=None, remote=good) as m:
        m.wait(uploads=True)
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert commit.steps(tmp_path) == [30]
    status = json.loads((tmp_path / "upload-status.json").read_text())
    assert status["steps"]["30"]["state"] == "done"


# ---- 13: the CLI reads what ckpt writes ----------------------------------------------------
def test_ls_and_verify_a_single_checkpoint_directory(tmp_path: Path, capsys: Any) -> None:
    import ckpt

    one = ckpt.save(tmp_path / "model.ckpt", {"w": torch.ones(10)}, metadata={"epoch": 3})
    assert cli.main(["ls", str(one)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {one}" in out and '{"epoch": 3}' in out
    assert cli.main(["verify", str(one)]) == 0
    assert f"{one}: OK" in capsys.readouterr().out
    _unrestorable(one)
    assert cli.main(["verify", str(one)]) == 1
    assert f"{one}: FAILED" in capsys.readouterr().out


def test_ls_and_verify_a_lightning_checkpoint(tmp_path: Path, capsys: Any) -> None:
    lightning = pytest.importorskip("ckpt.integrations.lightning")
    io = lightning.CkptCheckpointIO(async_save=False)
    path = tmp_path / "epoch=0-step=100.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 100}, path)
    assert cli.main(["verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["ls", str(path)]) == 0
    assert "ckpt.integrations.lightning" in capsys.readouterr().out


def test_ls_shows_metadata_and_manager_metadata(tmp_path: Path, capsys: Any) -> None:
    _populate(tmp_path)
    with CheckpointManager(tmp_path) as m:
        assert m.metadata(20) == {"s": 20}
    assert cli.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[0] == "20" and lines[2].endswith('{"s": 20}')


def test_bad_steps_exit_nonzero_without_traceback(tmp_path: Path, capsys: Any) -> None:
    _populate(tmp_path)
    manifest = tmp_path / "step-20" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()  # a manifest replaced by a directory
    _unrestorable(tmp_path / "step-30")
    assert cli.main(["ls", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "BAD:" in out.out and "Traceback" not in out.out + out.err
    assert cli.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith("step 10: OK")
    assert lines[1].startswith("step 20: FAILED") and lines[2].startswith("step 30: FAILED")
    assert "Traceback" not in out.out + out.err


def test_read_only_directory_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    import os

    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    _populate(tmp_path / "run")
    (tmp_path / "run" / ".lock").unlink()
    (tmp_path / "run").chmod(0o555)
    try:
        assert cli.main(["ls", str(tmp_path / "run")]) == 0
        assert cli.main(["verify", str(tmp_path / "run")]) == 0
        assert cli.main(["gc", str(tmp_path / "run"), "--keep-last", "1"]) == 1
        err = capsys.readouterr().err
        assert "ckpt:" in err and "Permission denied" in err and "Traceback" not in err
    finally:
        (tmp_path / "run").chmod(0o755)


def test_ls_and_verify_a_remote_url(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, capsys: Any
) -> None:
    pytest.importorskip("s3fs")
    bucket, opts = s3_bucket
    remote = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, deadline_s=10)
    _populate(tmp_path, (1, 2), remote=remote)
    url, endpoint = f"s3://{bucket}/run", ["--endpoint-url", s3_server]
    assert cli.main(["ls", url, *endpoint]) == 0
    out = capsys.readouterr().out
    assert f"committed ({url}/step-2)" in out and '{"s": 2}' in out
    assert cli.main(["verify", url, *endpoint]) == 0
    assert capsys.readouterr().out.count(": OK: ok (") == 2
    assert cli.main(["verify", f"{url}/step-1", *endpoint]) == 0  # one remote checkpoint
    assert f"{url}/step-1: OK" in capsys.readouterr().out
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.pipe_file(f"{bucket}/run/step-2/data.bin", b"garbage")
    assert cli.main(["verify", url, *endpoint]) == 1
    out = capsys.readouterr().out
    assert f"step 2: FAILED: {url}/step-2/data.bin" in out  # the URL, not s3:/... nor a temp dir
    assert cli.main(["verify", url, "--step", "7", *endpoint]) == 1
    assert f"{url}/step-7: no manifest" in capsys.readouterr().out


def test_os_errors_are_messages_not_tracebacks(tmp_path: Path, capsys: Any) -> None:
    _populate(tmp_path)
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()  # the writer lock cannot be opened
    assert cli.main(["gc", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ckpt: ") and ".lock" in err and "Traceback" not in err
