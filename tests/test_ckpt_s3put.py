"""ckpt's S3 upload path (``ckpt.tiers.s3put``, ``RemoteOptions.verify="auto"``) against the
real moto S3 server of ``conftest.py``, with ``_faultproxy.FaultProxy`` in front of it where a
request or reply must be altered: an upload reported verified is byte-identical to the committed
local step; a corrupted, incomplete or partial upload never commits; nothing committed is lost;
a flaky network gets retries and a clear error, never a hang."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _faultproxy import FaultProxy
from _helpers import big_state as _big
from _helpers import remote_options as _remote
from _helpers import s3_fs as _fs
from _helpers import s3_options as _opts

from ckpt.format import CHUNK_BYTES
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions
from ckpt.tiers import s3put
from feedpipe.io import crc32c, to_hex

MIB = 1 << 20


class _OnFirstPart(FaultProxy):
    """Runs ``action`` once, when the first part of a multipart upload arrives (the request is
    held meanwhile): the moment the upload has begun reading the file."""

    def __init__(self, upstream: str, action: Any) -> None:
        super().__init__(upstream)
        self._action, self._done, self._once = action, False, threading.Lock()

    def _take(self, method: str, path: str) -> str | None:
        if method == "PUT" and "partNumber=" in path:
            with self._once:
                if not self._done:
                    self._done = True
                    self._action()
        return super()._take(method, path)


# ---- 1. the bytes vouched for are the bytes checked ---------------------------------------------
def test_a_file_that_changes_after_the_local_check_is_never_vouched_for(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """TOCTOU: the local file was checked against the manifest in one read and uploaded from
    another. A byte that changes between the two (bit rot, a careless ``dd``) was then sent,
    MD5'd, vouched for by the store's ETags, and committed remotely under a manifest whose
    CRC32C it fails. The bytes sent must be the bytes checked."""
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path) as m:
        m.save(1, _big(1))
        m.wait()
    data = tmp_path / "step-1" / "data.bin"
    original = data.read_bytes()

    def rot() -> None:  # part 3 (bytes 10-11 MiB) is read after part 1 went out (1 thread)
        with open(data, "r+b") as f:
            f.seek(10 * MIB + 123)
            f.write(bytes([original[10 * MIB + 123] ^ 0x01]))

    with _OnFirstPart(s3_server, rot) as hook:
        remote = _remote(bucket, hook.url, threads=1, on_error="warn")
        with CheckpointManager(tmp_path, remote=remote) as m:
            m.wait(uploads=True)
            status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
    fs = _fs(s3_server)
    if fs.exists(f"{bucket}/run/step-1/manifest.json"):  # committed: must be the committed bytes
        assert fs.cat_file(f"{bucket}/run/step-1/data.bin") == original, (
            "a remote step was committed whose data differs from its manifest"
        )
    else:
        assert status.state == "failed" and "checksum mismatch" in status.reason, status
        assert "data.bin" in status.reason
        started = [r for r in hook.requests if r[0] == "POST" and r[1].endswith("?uploads")]
        assert len(started) == 1, "a file that fails its manifest locally was sent again"


def test_chunk_check_combines_chunks_cut_by_part_boundaries() -> None:
    """``ChunkCheck`` sees parts in any order and sizes unrelated to the manifest's chunks; a
    flipped byte in any chunk (whole, or cut by part boundaries) is found."""
    chunk, size = 1000, 4321
    data = bytearray(os.urandom(size))
    rec = {
        "chunk_bytes": chunk,
        "size": size,
        "crc32c": [to_hex(crc32c(bytes(data[i : i + chunk]))) for i in range(0, size, chunk)],
    }
    for part in (333, 1000, 1500, 4321):
        offsets = list(range(0, size, part))[::-1]  # last part first
        check = s3put.ChunkCheck(rec, "f")
        for off in offsets:
            check(off, bytes(data[off : off + part]))
        for flip in (0, 999, 1000, 2500, size - 1):
            bad = bytearray(data)
            bad[flip] ^= 0x80
            check = s3put.ChunkCheck(rec, "f")
            with pytest.raises(Exception, match=f"checksum mismatch in chunk {flip // chunk}"):
                for off in offsets:
                    check(off, bytes(bad[off : off + part]))


# ---- 2. S3's limits: 10,000 parts, 5 GiB a part -----------------------------------------------
@pytest.mark.parametrize("threads", [1, 8, 64])
def test_no_file_is_cut_into_more_parts_than_s3_takes(threads: int) -> None:
    """A file over 10,000 x ``block_bytes`` (160 GB at the default 16 MiB) was cut into more
    than S3's 10,000 parts: the upload failed at part 10,001, after sending 160 GB."""
    for size in (1, 5 * MIB, 160 << 30, (160 << 30) + 1, 1 << 40, 40 << 40):
        part = s3put.part_bytes(size, 16 * MIB, threads)
        assert -(-size // part) <= s3put.MAX_PARTS, (size, part)
        assert part >= 5 * MIB


def test_block_bytes_over_s3s_largest_part_is_refused() -> None:
    """A part (or a single ``PutObject``) over 5 GiB is refused by S3 only after it was sent."""
    with pytest.raises(ValueError, match="5 GiB"):
        RemoteOptions("s3://b/x", block_bytes=6 << 30)
    RemoteOptions("s3://b/x", block_bytes=5 << 30)


# ---- 3. a completion the store did, whose reply was lost ----------------------------------------
def test_a_lost_completion_reply_is_not_a_failed_upload(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy, s3_server: str
) -> None:
    """``CompleteMultipartUpload`` done by the store, its reply lost: the retry finds no such
    upload. The object's ETag (the MD5 of the part MD5s) says whether it is exactly the parts
    sent; then the upload stands, verified, instead of failing the step."""
    bucket, _ = s3_bucket
    proxy.inject("lose_reply", method="POST", match="uploadId=")
    # the retry: the upload is gone (moto completes it again; a store may answer NoSuchUpload)
    proxy.inject("404", method="POST", match="uploadId=")
    with CheckpointManager(tmp_path, remote=_remote(bucket, proxy.url, on_error="warn")) as m:
        m.save(1, _big(1))
        m.wait(uploads=True)
        status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
    assert proxy.faults_served == 2
    assert status.state == "done", status
    fs = _fs(s3_server)
    local = (tmp_path / "step-1" / "data.bin").read_bytes()
    assert fs.cat_file(f"{bucket}/run/step-1/data.bin") == local


def test_a_lost_completion_reply_over_other_bytes_is_not_taken(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """The recovery of a lost completion reply trusts only an object whose ETag is that of the
    parts just sent: an older object at the key (other bytes) is no proof."""
    import boto3

    bucket, _ = s3_bucket
    client = boto3.client(
        "s3", endpoint_url=s3_server, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    )  # fmt: skip
    client.put_object(Bucket=bucket, Key="k", Body=b"old bytes")
    fs = _fs(s3_server)
    assert s3put._completed(fs, bucket, "k", "0" * 32 + "-3") is None
    etag = client.head_object(Bucket=bucket, Key="k")["ETag"].strip('"')
    assert s3put._completed(fs, bucket, "k", etag) is not None


# ---- 4. symlinks and empty files -----------------------------------------------------------------
@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_empty_data_file_swapped_for_a_symlink_is_never_uploaded(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, slow: bool
) -> None:
    """A 0-byte data file went through s3fs's ``put_file``, which follows a symlink: a secret
    outside the step was sent to the bucket (the size check failed it only afterwards, and the
    object stayed)."""
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"step": 1})  # no tensor: an empty data.bin
        m.wait()
    data = tmp_path / "run" / "step-1" / "data.bin"
    assert data.stat().st_size == 0
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"AWS_SECRET_ACCESS_KEY=do-not-upload-me\n")
    data.unlink()
    data.symlink_to(secret)
    for verify in ("auto", "size") if slow else ("auto",):
        remote = _remote(bucket, s3_server, verify=verify, on_error="warn")
        with CheckpointManager(tmp_path / "run", remote=remote) as m:
            m.wait(uploads=True)
            status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
            assert status.state == "failed" and "data.bin" in status.reason, (verify, status)
        fs = _fs(s3_server)
        assert not fs.exists(f"{bucket}/run/step-1/manifest.json")
        key = f"{bucket}/run/step-1/data.bin"
        assert not fs.exists(key) or b"do-not-upload" not in fs.cat_file(key), verify


@pytest.mark.slow
def test_an_empty_data_file_uploads_and_verifies(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """The 0-byte file now goes through ``_s3put`` too: it still uploads, verified."""
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server)) as m:
        m.save(1, {"step": 1})
        m.wait(uploads=True)
        assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    fs = _fs(s3_server)
    assert fs.cat_file(f"{bucket}/run/step-1/data.bin") == b""
    assert fs.exists(f"{bucket}/run/step-1/manifest.json")


def test_a_file_at_exactly_one_part_and_one_byte_over(tmp_path: Path, s3_server: str) -> None:
    """Boundaries: a file of exactly ``part_bytes`` goes in one request, one byte more as two
    parts (the last of one byte); both are vouched for and stored byte for byte."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=s3_server, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    ).create_bucket(Bucket=bucket)  # fmt: skip
    fs = _fs(s3_server)
    part = 5 * MIB
    with ThreadPoolExecutor(4) as pool:
        for size in (part, part + 1):
            local = tmp_path / f"f{size}"
            body = os.urandom(size)
            local.write_bytes(body)
            rec = {
                "chunk_bytes": CHUNK_BYTES,
                "size": size,
                "crc32c": [to_hex(crc32c(body[i : i + CHUNK_BYTES]))
                           for i in range(0, size, CHUNK_BYTES)],
            }  # fmt: skip
            vouched = s3put.put_file(
                fs, local, f"{bucket}/f{size}", size=size, part_bytes=part, pool=pool,
                call=lambda fn, what: fn(), check=s3put.ChunkCheck(rec, str(local)),
            )  # fmt: skip
            assert vouched
            assert fs.cat_file(f"{bucket}/f{size}") == body


# ---- 5. an uploader killed mid-multipart ---------------------------------------------------------
def _client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    )  # fmt: skip


def _open_uploads(endpoint: str, bucket: str) -> list[str]:
    return [u["Key"] for u in _client(endpoint).list_multipart_uploads(Bucket=bucket).get(
        "Uploads", [])]  # fmt: skip


def test_stale_multipart_uploads_are_aborted_after_grace(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """Parts of a file whose uploader died stay stored (and billed) with no object: nothing
    listed or deleted them. Remote GC aborts those of a step older than ``grace_s``, and only
    those: a young one, or one outside any ``step-N``, is left."""
    bucket, _ = s3_bucket
    client = _client(s3_server)
    for key in ("run/step-7/data.bin", "run/notes/x.bin"):
        uid = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x" * 100)
    # moto dates every upload's Initiated in 2010: the age filter is checked on the listing
    assert s3put.stale_uploads(_fs(s3_server), f"{bucket}/run", before=0.0) == []
    listed = s3put.stale_uploads(_fs(s3_server), f"{bucket}/run", before=time.time() + 60)
    assert sorted(rel for rel, _, _ in listed) == ["notes/x.bin", "step-7/data.bin"]
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server, grace_s=0.0)) as m:
        m.remote.gc()  # type: ignore[union-attr]
    assert _open_uploads(s3_server, bucket) == ["run/notes/x.bin"]


_CHILD = """
import sys, torch
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions
d, bucket, endpoint = sys.argv[1:4]
opts = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
remote = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, threads=1,
                       block_bytes=5 << 20, deadline_s=60.0)
with CheckpointManager(d, remote=remote) as m:
    g = torch.Generator().manual_seed(1)
    m.save(1, {"w": torch.randn(11 * (1 << 20) // 4, generator=g), "step": 1})
    m.wait(uploads=True)
"""


class _HoldSecondPart(FaultProxy):
    """Lets part 1 of a multipart upload through (the store keeps it), then holds part 2 until
    ``release`` is set, and drops it."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.reached, self.release = threading.Event(), threading.Event()

    def _take(self, method: str, path: str) -> str | None:
        if method == "PUT" and "partNumber=2" in path and not self.reached.is_set():
            self.reached.set()
            self.release.wait(60)
            return "drop"
        return super()._take(method, path)


@pytest.mark.slow
def test_sigkill_mid_multipart_then_restart(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """A real uploader SIGKILLed with a part stored and its multipart upload open: nothing is
    committed or counted as verified; the restart uploads the step, verified, and remote GC
    aborts the orphan upload."""
    import signal
    import subprocess

    bucket, _ = s3_bucket
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    with _HoldSecondPart(s3_server) as hook:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path), bucket, hook.url], env=env
        )
        try:
            assert hook.reached.wait(90), "the child never sent part 2"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            hook.release.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    fs = _fs(s3_server)
    assert not fs.exists(f"{bucket}/run/step-1/manifest.json")
    assert not fs.exists(f"{bucket}/run/step-1/data.bin")
    assert _open_uploads(s3_server, bucket) == ["run/step-1/data.bin"]
    with CheckpointManager(tmp_path, remote=_remote(bucket, s3_server, grace_s=0.0)) as m:
        m.wait(uploads=True)
        assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    local = (tmp_path / "step-1" / "data.bin").read_bytes()
    assert fs.cat_file(f"{bucket}/run/step-1/data.bin") == local
    assert _open_uploads(s3_server, bucket) == []


# ---- 6. credentials never appear ---------------------------------------------------------------
@pytest.mark.slow
def test_a_failed_multipart_upload_never_shows_the_secret(
    tmp_path: Path,
    s3_bucket: tuple[str, dict],
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A part refused for good (403): the error raised to the caller, the log, the status and
    its file name the URL and never the secret."""
    from ckpt.errors import CheckpointError

    bucket, _ = s3_bucket
    secret = "a3-SEKRIT-do-not-print"
    opts = {**_opts(proxy.url), "secret": secret}
    proxy.inject("403", times=100, match="partNumber=", method="PUT")
    remote = RemoteOptions(
        f"s3://{bucket}/run", storage_options=opts, threads=2, block_bytes=5 * MIB, deadline_s=5.0
    )
    m = CheckpointManager(tmp_path, remote=remote)
    try:
        m.save(1, _big(1))
        m.wait()
        m.remote.wait(30)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError) as err:
            m.remote.raise_pending()  # type: ignore[union-attr]
        status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
    finally:
        proxy.clear()
        m.close()
    text = (
        f"{err.value} {status.reason} {caplog.text} {(tmp_path / 'upload-status.json').read_text()}"
    )
    assert f"s3://{bucket}/run" in str(err.value)
    assert status.state == "failed"
    assert secret not in text
