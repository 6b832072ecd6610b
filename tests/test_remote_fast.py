"""The fast remote paths (issue 18 section 4): ckpt's uploader sends every part at once and lets
S3 vouch for the bytes (its MD5 ETags) instead of downloading them again; and what "verified"
means stays honest: a byte flipped in flight or a part left out of the object never passes.

All against the real moto S3 server of ``conftest.py``, with ``_faultproxy.FaultProxy`` in front
of it where a request must be altered on the way. The default run keeps one test per claim; the
whole-manager variants (retry, failure, read-back, local rot) are marked slow.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _faultproxy import FaultProxy
from _helpers import big_state as _big
from _helpers import remote_options as _remote
from _helpers import s3_fs as _fs

from ckpt.errors import CorruptCheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions
from ckpt.tiers import s3put

MIB = 1 << 20


class _Counting(FaultProxy):
    """A proxy that holds each matching request ``hold_s`` and records the most in flight."""

    def __init__(self, upstream: str, method: str, match: str, hold_s: float = 0.4) -> None:
        super().__init__(upstream)
        self.peak, self._now, self._count_lock = 0, 0, threading.Lock()
        self._method, self._match, self._hold_s = method, match, hold_s

    def _take(self, method: str, path: str) -> str | None:
        if method == self._method and self._match in path:
            with self._count_lock:
                self._now += 1
                self.peak = max(self.peak, self._now)
            time.sleep(self._hold_s)
            with self._count_lock:
                self._now -= 1
        return super()._take(method, path)


def _data_requests(proxy: FaultProxy, method: str) -> list[str]:
    return [p for m, p, _ in proxy.requests if m == method and "/data.bin" in p]


def test_default_upload_is_vouched_by_the_store_without_a_second_transfer(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy
) -> None:
    """verify="auto" (the default) on S3: parts sent, no byte of the data read back, and the
    stored object equals the local file."""
    bucket, _ = s3_bucket
    assert RemoteOptions("s3://b/x").verify == "auto"
    with CheckpointManager(tmp_path, remote=_remote(bucket, proxy.url)) as m:
        m.save(1, _big(1))
        m.wait(uploads=True)
        assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    parts = [p for p in _data_requests(proxy, "PUT") if "partNumber=" in p]
    assert len(parts) == 3, proxy.requests
    assert _data_requests(proxy, "GET") == [], "the data was downloaded again"
    local = (tmp_path / "step-1" / "data.bin").read_bytes()
    assert _fs(proxy.url).cat_file(f"{bucket}/run/step-1/data.bin") == local


@pytest.mark.slow
def test_parts_of_one_file_are_in_flight_together(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """Every part of a file is sent at once (up to ``threads``), not in s3fs's rounds: the
    parts' requests overlap in time at the server's door."""
    bucket, _ = s3_bucket
    with _Counting(s3_server, "PUT", "partNumber=", hold_s=0.3) as slow:
        remote = _remote(bucket, slow.url, threads=4)
        with CheckpointManager(tmp_path, remote=remote) as m:
            m.save(1, _big(1))
            m.wait(uploads=True)
            assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    assert slow.peak >= 3, f"at most {slow.peak} parts were in flight at once"


@pytest.mark.slow
def test_a_byte_flipped_in_flight_is_caught_and_sent_again(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy, caplog: Any
) -> None:
    bucket, _ = s3_bucket
    proxy.inject("corrupt", times=1, match="partNumber=2", method="PUT")
    remote = _remote(bucket, proxy.url)
    with (
        caplog.at_level(logging.WARNING, logger="ckpt"),
        CheckpointManager(tmp_path, remote=remote) as m,
    ):
        m.save(1, _big(1))
        m.wait(uploads=True)
        assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    assert proxy.faults_served == 1
    assert "did not verify; uploading again" in caplog.text
    local = (tmp_path / "step-1" / "data.bin").read_bytes()
    assert _fs(proxy.url).cat_file(f"{bucket}/run/step-1/data.bin") == local


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["corrupt", "drop_part"])
def test_a_corrupt_or_incomplete_upload_never_commits(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy, fault: str
) -> None:
    """Every attempt altered on the way (a flipped byte in a part; the last part left out of
    the completed object): the step fails, no remote manifest is written, the local copy
    stays."""
    bucket, _ = s3_bucket
    if fault == "corrupt":
        proxy.inject("corrupt", times=1000, match="partNumber=2", method="PUT")
    else:
        proxy.inject("drop_part", times=1000, match="/data.bin?uploadId=", method="POST")
    remote = _remote(bucket, proxy.url, on_error="warn")
    with CheckpointManager(tmp_path, remote=remote) as m:
        m.save(1, _big(1))
        m.wait(uploads=True)
        status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
        assert status.state == "failed", status
        assert "data.bin" in status.reason
    assert proxy.faults_served >= 2
    fs = _fs(proxy.url)
    assert not fs.exists(f"{bucket}/run/step-1/manifest.json")
    assert (tmp_path / "step-1" / "data.bin").exists()


def test_put_file_reports_what_the_store_vouched_for(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy
) -> None:
    """``s3put.put_file`` returns True only when every ETag matched the bytes sent: a part
    altered in flight, or a single-request body altered, makes it False (the caller then reads
    the object back); a part left out of the object fails the size check."""
    bucket, _ = s3_bucket
    fs = _fs(proxy.url)
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(bytes(range(256)) * (11 * MIB // 256))  # 3 parts of at most 5 MiB
    small.write_bytes(bytes(range(256)) * (MIB // 256))  # one request

    def put(key: str, part: int) -> bool:
        path = big if part == 5 * MIB else small
        with ThreadPoolExecutor(4) as pool:
            return s3put.put_file(
                fs, path, f"{bucket}/{key}", size=path.stat().st_size, part_bytes=part,
                pool=pool, call=lambda fn, what: fn(),
            )  # fmt: skip

    assert put("ok-multi", 5 * MIB) is True
    assert put("ok-single", 16 * MIB) is True
    proxy.inject("corrupt", times=1, match="partNumber=3", method="PUT")
    assert put("multi", 5 * MIB) is False
    proxy.inject("corrupt", times=1, match="/single", method="PUT")
    assert put("single", 16 * MIB) is False
    proxy.inject("drop_part", times=1, match="/short?uploadId=", method="POST")
    with pytest.raises(CorruptCheckpointError, match="stored size"):
        put("short", 5 * MIB)
    assert proxy.faults_served == 3


@pytest.mark.slow
def test_readback_still_checks_every_chunk(
    tmp_path: Path, s3_bucket: tuple[str, dict], proxy: FaultProxy
) -> None:
    """verify="readback" keeps its meaning on the fast path: the data is read back."""
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path, remote=_remote(bucket, proxy.url, verify="readback")) as m:
        m.save(1, _big(1))
        m.wait(uploads=True)
        assert m.stats.remote.uploads[1].state == "done"  # type: ignore[union-attr]
    assert _data_requests(proxy, "GET"), "verify='readback' read nothing back"


@pytest.mark.slow
def test_local_bytes_that_differ_from_the_manifest_are_never_uploaded_as_verified(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """The store vouches only for the bytes sent: a data file that no longer matches its
    manifest (bit rot after the commit) fails the upload instead of being vouched for."""
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path) as m:
        m.save(1, _big(1))
        m.wait()
    data = tmp_path / "step-1" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[7 * MIB] ^= 0x10
    data.write_bytes(bytes(raw))
    remote = _remote(bucket, s3_server, on_error="warn")
    with CheckpointManager(tmp_path, remote=remote) as m:
        m.wait(uploads=True)
        status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
        assert status.state == "failed" and "checksum mismatch" in status.reason, status
    assert not _fs(s3_server).exists(f"{bucket}/run/step-1/manifest.json")


def test_bad_verify_option_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'auto', 'readback' or 'size'"):
        RemoteOptions("s3://b/x", verify="etag")
    with pytest.raises(ValueError, match="verify"):
        RemoteOptions("s3://b/x", verify="")


@pytest.mark.serial  # a peak of concurrent downloads is a timing bound: not beside another run
def test_stage_keeps_every_worker_transferring(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """``stage(workers=16)`` has 16 downloads in flight: the S3 client's connection pool is
    sized to the workers (botocore's default pool of 10 connections capped them at 10)."""
    from test_stage import make_dataset, upload

    from feedpipe.remote.stage import stage

    bucket, opts = s3_bucket
    contents = make_dataset(tmp_path / "src", shards=10, nbytes=2000)  # 20 files
    url = upload(tmp_path / "src", bucket, opts)
    with _Counting(s3_server, "GET", "/ds/shard-") as counting:
        remote_opts = dict(
            opts, client_kwargs={**opts["client_kwargs"], "endpoint_url": counting.url}
        )
        result = stage(
            url, tmp_path / "dst", storage_options=remote_opts, workers=16, progress=False
        )
    assert result.copied == len(contents)
    assert counting.peak >= 14, f"only {counting.peak} downloads were in flight at once"


def test_a_symlinked_data_file_is_never_uploaded(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """A data file replaced by a symlink (to identical bytes outside the step) is refused, in
    every verify mode: nothing in a checkpoint directory is followed out of it."""
    bucket, _ = s3_bucket
    with CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"w": torch.arange(1000.0)})
        m.wait()
    data = tmp_path / "run" / "step-1" / "data.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    remote = _remote(bucket, s3_server, verify="size", on_error="warn")
    with CheckpointManager(tmp_path / "run", remote=remote) as m:
        m.wait(uploads=True)
        status = m.stats.remote.uploads[1]  # type: ignore[union-attr]
        assert status.state == "failed" and "data.bin" in status.reason, status
    assert not _fs(s3_server).exists(f"{bucket}/run/step-1/manifest.json")
