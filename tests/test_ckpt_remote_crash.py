"""SIGKILL the uploading process mid-upload, restart it: the upload completes, and no
half-uploaded checkpoint is ever restorable (a real process, the real moto S3 server)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from _ckpt_upload_worker import options, state_for
from _procs import child_env, python_child, read_marker, stop

from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import list_remote, read_status

pytest.importorskip("s3fs")
pytest.importorskip("moto")

WORKER = str(Path(__file__).with_name("_ckpt_upload_worker.py"))


def _spawn(args: list[str], pause: str) -> AbstractContextManager[subprocess.Popen[str]]:
    return python_child(WORKER, *args, env=child_env(CKPT_TEST_PAUSE=pause))


def _check_remote(bucket: str, endpoint: str, scratch: Path) -> list[int]:
    """Every remote step with a manifest restores, verified, to exactly what was saved."""
    opts = options(bucket, endpoint)
    with CheckpointManager(scratch, remote=opts) as m:
        committed = m.remote.committed_steps()  # type: ignore[union-attr]
        for step in committed:
            got = m.restore(step=step)
            assert torch.equal(got["w"], state_for(step)["w"]), f"step {step} differs"
    return committed


@pytest.mark.parametrize("rounds", [2, pytest.param(10, marks=pytest.mark.slow)])
def test_sigkill_mid_upload_then_restart_completes(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, rounds: int
) -> None:
    bucket, _ = s3_bucket
    directory = tmp_path / "run"
    rng = random.Random(10)
    kills_mid_upload = 0
    for rnd in range(rounds):
        first, last = 3 * rnd + 1, 3 * rnd + 3
        with _spawn(
            [str(directory), bucket, s3_server, "save", str(first), str(last)],
            "upload:0.6,upload_manifest:0.6",
        ) as proc:
            read_marker(proc, "committed")  # the first local commit of this round
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until an upload is in progress
                if any(s["state"] == "uploading" for s in read_status(directory).values()):
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
            assert stop(proc, signal.SIGKILL) == -signal.SIGKILL
        states = {s: v["state"] for s, v in read_status(directory).items()}
        kills_mid_upload += any(v in ("uploading", "pending") for v in states.values())
        _check_remote(bucket, s3_server, tmp_path / f"scratch-{rnd}")
        # restart: the new process uploads every committed local step that is not remote yet
        with _spawn([str(directory), bucket, s3_server, "resume"], "") as proc:
            out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "uploaded" in out, out
        local = [int(p.name[5:]) for p in directory.glob("step-*") if p.name[5:].isdigit()]
        committed = _check_remote(bucket, s3_server, tmp_path / f"scratch-r{rnd}")
        assert set(local) <= set(committed), (local, committed)
        assert all(read_status(directory)[s]["state"] == "done" for s in local)
    assert kills_mid_upload >= rounds // 2, "the kills did not land during uploads"
    # a prefix without a manifest never restores
    import s3fs

    fs = s3fs.S3FileSystem(**options(bucket, s3_server).storage_options)  # type: ignore[arg-type]
    partial = [s for s, e in list_remote(fs, f"{bucket}/run").items() if not e.committed]
    with CheckpointManager(tmp_path / "last", remote=options(bucket, s3_server)) as m:
        for step in partial:
            with pytest.raises(CheckpointError):
                m.restore(step=step)
