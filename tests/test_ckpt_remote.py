"""The remote tier against a real S3 server (moto, server mode) via s3fs, with a fault proxy."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _faultproxy import FaultProxy

from ckpt import cli
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import STATUS_FILE, RemoteOptions, list_remote, read_status
from ckpt.saving import commit
from feedpipe.io.reaper import StuckWorkerWarning

pytest.importorskip("s3fs")
pytest.importorskip("moto")

SECRET = "s3cr3t-Very-Private-Value"


def _state(seed: int, n: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(seed, seed + 7), "step": seed}


def _opts(endpoint: str) -> dict[str, Any]:
    return {
        "key": "AKIDTESTING",
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},  # our retry loop, not botocore's
        "skip_instance_cache": True,
    }


def _remote(bucket: str, endpoint: str, **kw: Any) -> RemoteOptions:
    kw.setdefault("deadline_s", 20.0)
    kw.setdefault("threads", 4)
    kw.setdefault("block_bytes", 5 << 20)
    return RemoteOptions(f"s3://{bucket}/run", storage_options=_opts(endpoint), **kw)


def _fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**_opts(endpoint))


def test_upload_verify_status_and_ls(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, capsys: Any
) -> None:
    bucket, _ = s3_bucket
    big = {"w": torch.randn(3 << 20), "step": 1}  # 12 MiB: multipart with 5 MiB parts
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server)) as m:
        m.save(1, big)
        m.save(2, _state(2))
        m.wait(uploads=True)
        ups = m.stats.remote.uploads  # type: ignore[union-attr]
        assert {s: u.state for s, u in ups.items()} == {1: "done", 2: "done"}
        assert ups[1].nbytes > 12 << 20
    fs = _fs(s3_server)
    listing = list_remote(fs, f"{bucket}/run")
    assert sorted(s for s, e in listing.items() if e.committed) == [1, 2]
    for step in (1, 2):
        local = tmp_path / f"step-{step}"
        for name in ("manifest.json", "data.bin"):
            assert fs.cat_file(f"{bucket}/run/step-{step}/{name}") == (local / name).read_bytes()
    assert read_status(tmp_path)[2]["state"] == "done"
    assert SECRET not in (tmp_path / STATUS_FILE).read_text()
    assert cli.main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "upload" in out and out.count("done") >= 2


def test_restore_pulls_remote_when_local_missing_or_corrupt(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    bucket, _ = s3_bucket
    remote = _remote(bucket, s3_server)
    with CheckpointManager(tmp_path / "a", remote=remote) as m:
        m.save(5, _state(5))
        m.save(6, _state(6))
        m.wait(uploads=True)
    # local copy missing: a fresh machine restores from the remote, then keeps it locally
    with CheckpointManager(tmp_path / "b", remote=remote) as m:
        got = m.restore()
        assert got["step"] == 6 and torch.equal(got["w"], _state(6)["w"])
        assert m.stats.last_restore is not None and "s3://" in m.stats.last_restore.path
        assert commit.steps(tmp_path / "b") == [6]  # kept locally
        assert m.steps() == [5, 6]  # steps() lists the remote tier too
        assert torch.equal(m.restore(step=5)["w"], _state(5)["w"])
    # local copy corrupt: the same step comes back from the remote
    data = tmp_path / "a" / "step-6" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with CheckpointManager(tmp_path / "a", remote=remote) as m:
        got = m.restore()
        assert got["step"] == 6 and torch.equal(got["w"], _state(6)["w"])
    assert m.restore(step=6)["step"] == 6  # the bad local copy was replaced by the verified one


def test_partial_remote_prefix_is_not_a_checkpoint_and_is_collected(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    bucket, _ = s3_bucket
    fs = _fs(s3_server)
    fs.pipe_file(f"{bucket}/run/step-99/data.bin", b"x" * 1000)  # an interrupted upload
    with CheckpointManager(tmp_path / "a", remote=_remote(bucket, s3_server, grace_s=3600)) as m:
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            m.restore()
        m.save(1, _state(1))
        m.wait(uploads=True)
        assert m.restore()["step"] == 1
        assert fs.exists(f"{bucket}/run/step-99/data.bin")  # younger than the grace period
    with CheckpointManager(tmp_path / "a", remote=_remote(bucket, s3_server, grace_s=0.0)) as m:
        m.save(2, _state(2))
        m.wait(uploads=True)
        assert m.stats.remote.partial_removed == [99]  # type: ignore[union-attr]
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/run/step-99/data.bin")


def test_remote_retention_and_tier_aware_local_retention(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    bucket, _ = s3_bucket
    remote = _remote(bucket, s3_server)
    with CheckpointManager(tmp_path, keep_last=1, remote=remote, keep_last_remote=2) as m:
        for step in range(1, 5):
            m.save(step, _state(step))
            m.wait(uploads=True)
        assert commit.steps(tmp_path) == [4]
        assert m.steps() == [3, 4]  # local and remote
        assert m.stats.remote.remote_evicted == [1, 2]  # type: ignore[union-attr]
    listing = list_remote(_fs(s3_server), f"{bucket}/run")
    assert sorted(s for s, e in listing.items() if e.committed) == [3, 4]
    assert sorted(listing) == [3, 4]  # deleted steps leave no partial prefix behind


def test_permanent_error_fails_fast_keeps_local_and_redacts(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy, caplog: Any
) -> None:
    bucket, _ = s3_bucket
    caplog.set_level(logging.DEBUG, logger="ckpt")
    caplog.set_level(logging.DEBUG, logger="feedpipe")
    proxy.inject("403", times=1000, method="PUT")
    remote = _remote(bucket, proxy.url)
    m = CheckpointManager(tmp_path, keep_last=1, remote=remote)
    for step in (1, 2, 3):
        m.save(step, _state(step))  # training never blocks on, nor fails inside, the remote tier
        m.wait()
        m.remote.wait(timeout=30)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match=r"403|Access ?Denied") as info:
            m.save(100 + step, _state(step))
        assert f"s3://{bucket}/run" in str(info.value) and SECRET not in str(info.value)
        m.wait()
    assert m.steps() == [1, 2, 3]  # not uploaded: nothing evicted despite keep_last=1
    ups = m.stats.remote.uploads  # type: ignore[union-attr]
    assert ups[1].state == "failed" and "Access Denied" in ups[1].reason
    puts = [r for r in proxy.requests if r[0] == "PUT" and "step-1/" in r[1]]
    assert len(puts) == 1  # failed fast: no retry of a permanent error
    m.close()  # every failure was reported already: close does not raise them again
    assert SECRET not in caplog.text and SECRET not in json.dumps(read_status(tmp_path))
    # opting out of tier-aware retention lets local retention proceed
    with CheckpointManager(
        tmp_path / "optout",
        keep_last=1,
        remote=_remote(bucket, proxy.url, evict_before_upload=True),
    ) as m2:
        for step in (1, 2, 3):
            m2.save(step, _state(step))
            m2.wait()
        assert m2.steps() == [3]
        m2.remote.wait(timeout=30)  # type: ignore[union-attr]
        proxy.clear()
        with pytest.raises(CheckpointError):
            m2.wait()


def test_transient_faults_are_retried(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy, s3_server: str
) -> None:
    bucket, _ = s3_bucket
    state = {"w": torch.randn(3 << 20)}  # multipart
    proxy.inject("drop", times=2, method="PUT")
    proxy.inject("503", times=2, method="PUT")
    proxy.inject("500", times=1, method="GET")
    proxy.inject("truncate", times=1, method="GET")
    with CheckpointManager(tmp_path, remote=_remote(bucket, proxy.url)) as m:
        m.save(1, state)
        m.wait(uploads=True)
        assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    assert proxy.faults_served == 6
    local = (tmp_path / "step-1/data.bin").read_bytes()
    assert _fs(s3_server).cat_file(f"{bucket}/run/step-1/data.bin") == local


def test_restart_uploads_steps_never_uploaded(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path) as m:  # no remote configured yet
        m.save(1, _state(1))
        m.save(2, _state(2))
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server)) as m:
        m.wait(uploads=True)
        assert {s: u.state for s, u in m.stats.remote.uploads.items()} == {  # type: ignore[union-attr]
            1: "done",
            2: "done",
        }
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server)) as m:
        m.wait(uploads=True)
        assert m.stats.remote.uploaded_bytes == 0  # type: ignore[union-attr]  (already there)
    shutil.rmtree(tmp_path / "step-2")
    with CheckpointManager(tmp_path / "fresh", remote=_remote(bucket, s3_server)) as m:
        assert m.restore()["step"] == 2


def test_resaved_step_is_uncommitted_before_reupload(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, proxy: FaultProxy
) -> None:
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server)) as m:
        m.save(1, _state(1))
        m.wait(uploads=True)
    # step 1 saved again with other values; its upload then dies after the data files
    proxy.inject("403", times=1000, match="manifest.json", method="PUT")
    with CheckpointManager(tmp_path, remote=_remote(bucket, proxy.url)) as m:
        m.save(1, _state(7))
        m.wait()
        m.remote.wait(timeout=30)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError):
            m.wait()
    listing = list_remote(_fs(s3_server), f"{bucket}/run")
    assert not listing[1].committed  # the old manifest never points at the new data
    opts = copy.deepcopy(_remote(bucket, s3_server))
    with (
        CheckpointManager(tmp_path / "fresh", remote=opts) as m,
        pytest.raises(CheckpointError, match="no valid checkpoint"),
    ):
        m.restore()


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="verify"):
        RemoteOptions("s3://b/x", verify="md5")
    with pytest.raises(ValueError, match="5 MiB"):
        RemoteOptions("s3://b/x", block_bytes=1024)


def test_missing_bucket_fails_fast_and_names_url(tmp_path: Path, proxy: FaultProxy) -> None:
    remote = RemoteOptions("s3://no-such-bucket-xyz/run", storage_options=_opts(proxy.url))
    with CheckpointManager(tmp_path, remote=remote) as m:
        m.save(1, _state(1))
        m.wait()
        m.remote.wait(timeout=60)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match="no-such-bucket-xyz") as info:
            m.wait()
        assert "NoSuchBucket" in str(info.value) or "not exist" in str(info.value).lower()
        assert m.steps() == [1]
    puts = [r for r in proxy.requests if r[0] == "PUT"]
    assert len(puts) <= 1  # not retried until the deadline


def test_training_never_blocks_on_a_stalled_remote(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy, s3_server: str, caplog: Any
) -> None:
    bucket, _ = s3_bucket
    # the upload's first request (is the step there already?) gets half a reply, then nothing
    proxy.inject("stall", times=1000, match="manifest.json", method="GET")
    remote = _remote(bucket, proxy.url, close_timeout_s=0.5)
    m = CheckpointManager(tmp_path, keep_last=1, remote=remote)
    for step in (1, 2):
        m.save(step, _state(step)).result(timeout=30)  # committed locally meanwhile
    m.wait()  # saves are done; the uploads are not
    ups = m.stats.remote.uploads  # type: ignore[union-attr]
    deadline = time.monotonic() + 20
    while ups[1].state != "uploading" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (ups[1].state, ups[2].state) == ("uploading", "pending")
    with pytest.warns(StuckWorkerWarning, match=r"ckpt upload to s3://.* thread ckpt-upload-"):
        m.close()  # gives up on the uploads after close_timeout_s, naming the stuck thread
    assert "unfinished" in caplog.text
    assert m.steps() == [1, 2]  # nothing evicted: neither step reached the remote
    proxy.clear()
    with CheckpointManager(tmp_path, keep_last=1, remote=_remote(bucket, s3_server)) as m2:
        m2.wait(uploads=True)
        assert m2.stats.remote.uploads[2].state == "done"  # type: ignore[union-attr]
        m2.save(3, _state(3))
        m2.wait(uploads=True)
        assert m2.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
        # uploaded, so local retention proceeds; step 1 stays only while the first manager's
        # abandoned (still stalled) upload holds its reader lock
        local = commit.steps(tmp_path)  # m2.steps() lists the remote copies as well
        assert 2 not in local and 3 in local
