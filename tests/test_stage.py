"""feedpipe.stage against the real local S3 server (moto through s3fs), file:// and local paths."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _faultproxy import FaultProxy
from _helpers import file_url_fixtures as _fixtures
from conftest import free_port

from feedpipe import MemmapDataset
from feedpipe.errors import DatasetError
from feedpipe.remote import transfer as _remote
from feedpipe.remote.stage import stage

SECRET_KEY = "AKIAFEEDPIPETESTKEY1"
SECRET = "s3cr3t/FeedpipeTestSecretValue+xyz"


def make_dataset(
    root: Path, shards: int = 4, nbytes: int = 50_000, seed: int = 0
) -> dict[str, bytes]:
    """Write a dataset with :class:`feedpipe.MemmapWriter` (fixed layout + a label field) of
    ``shards`` shards of about ``nbytes`` each; return ``{relpath: content}`` of every file."""
    from feedpipe import MemmapWriter

    rng = np.random.default_rng(seed)
    record, per_shard = 1000, max(1, nbytes // 1000)
    with MemmapWriter(
        root,
        shape=(record,),
        dtype="uint8",
        fields={"label": "int64"},
        shard_bytes=record * per_shard,
    ) as w:
        n = shards * per_shard
        w.append_batch(rng.integers(0, 256, (n, record), dtype=np.uint8), label=np.arange(n))
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "index.json"}


def upload(local: Path, bucket: str, opts: dict[str, Any], prefix: str = "ds") -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{bucket}/{prefix}/{p.name}")
    return f"s3://{bucket}/{prefix}"


def assert_same(dst: Path, contents: dict[str, bytes]) -> None:
    for rel, data in contents.items():
        assert (dst / rel).read_bytes() == data, rel
    assert (dst / "index.json").exists()
    assert not [p for p in dst.rglob("*") if _remote.is_temp(p.name)]


def feedpipe_logs(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("feedpipe"))


def secret_opts(opts: dict[str, Any], endpoint: str | None = None) -> dict[str, Any]:
    out = dict(opts, key=SECRET_KEY, secret=SECRET)
    ck = dict(out["client_kwargs"])
    if endpoint:
        ck["endpoint_url"] = endpoint
    out["client_kwargs"] = ck
    # no retries inside botocore, so that feedpipe's own retry is what is tested (s3fs still
    # retries dropped connections and SlowDown itself, but not a 500 InternalError)
    out["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
    return out


def test_stage_from_s3(tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    contents = make_dataset(tmp_path / "src")
    url = upload(tmp_path / "src", bucket, opts)
    result = stage(url, tmp_path / "dst", storage_options=opts, workers=4, progress=False)
    assert result.copied == len(contents) and result.skipped == 0
    assert result.bytes_copied == sum(len(v) for v in contents.values())
    assert_same(tmp_path / "dst", contents)


@pytest.mark.parametrize("scheme", ["path", "file"])
def test_stage_from_local_path_and_file_url(tmp_path: Path, scheme: str) -> None:
    contents = make_dataset(tmp_path / "lustre" / "ds")
    src = str(tmp_path / "lustre" / "ds")
    if scheme == "file":
        src = "file://" + src
    result = stage(src, tmp_path / "dst", workers=3, progress=False)
    assert result.copied == len(contents)
    assert_same(tmp_path / "dst", contents)


def test_rerun_copies_only_missing_or_wrong(tmp_path: Path) -> None:
    contents = make_dataset(tmp_path / "src", shards=3)
    dst = tmp_path / "dst"
    stage(tmp_path / "src", dst, progress=False)
    (dst / "shard-00000.data").unlink()  # missing
    bad = bytearray((dst / "shard-00001.data").read_bytes())
    bad[100] ^= 0xFF  # same size, wrong content
    (dst / "shard-00001.data").write_bytes(bytes(bad))
    (dst / "shard-00002.label").write_bytes(b"short")  # wrong size
    (dst / ".feedpipe-tmp.123.999999999.deadbeef.shard-00002.data").write_bytes(b"junk")  # dead
    result = stage(tmp_path / "src", dst, progress=False)
    assert result.copied == 3
    assert result.skipped == len(contents) - 3
    assert_same(dst, contents)


def test_interrupted_stage_has_no_index_and_resumes(tmp_path: Path) -> None:
    """A failed run leaves no index.json (not a complete dataset); the rerun fills the gap only."""
    contents = make_dataset(tmp_path / "src", shards=4)
    gone = tmp_path / "src" / "shard-00002.data"
    saved = gone.read_bytes()
    gone.unlink()
    with pytest.raises(DatasetError, match=r"shard-00002\.data"):
        stage(tmp_path / "src", tmp_path / "dst", workers=1, progress=False)
    assert not (tmp_path / "dst" / "index.json").exists()
    gone.write_bytes(saved)
    result = stage(tmp_path / "src", tmp_path / "dst", workers=2, progress=False)
    assert result.copied >= 1 and result.skipped >= 1
    assert_same(tmp_path / "dst", contents)


def test_corrupt_source_is_rejected_naming_url(tmp_path: Path) -> None:
    make_dataset(tmp_path / "src", shards=2)
    p = tmp_path / "src" / "shard-00001.data"
    data = bytearray(p.read_bytes())
    data[0] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"shard-00001\.data.*does not match the index"):
        stage(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst" / "shard-00001.data").exists()
    assert not (tmp_path / "dst" / "index.json").exists()


def test_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "index.json").write_text('{"format": "other"}')
    with pytest.raises(DatasetError, match="not a feedpipe dataset index"):
        stage(tmp_path / "src", tmp_path / "dst", progress=False)
    (tmp_path / "src" / "index.json").write_text("{nope")
    with pytest.raises(DatasetError, match="not valid JSON"):
        stage(tmp_path / "src", tmp_path / "dst", progress=False)


def test_missing_key_and_bucket_fail_fast_naming_url(
    tmp_path: Path,
    s3_bucket: tuple[str, dict[str, Any]],
    s3_server: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket, opts = s3_bucket
    sopts = secret_opts(opts)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(_remote.RemoteError) as info:
        stage(f"s3://{bucket}/nothing-here", tmp_path / "a", storage_options=sopts, progress=False)
    assert info.value.permanent and f"s3://{bucket}/nothing-here/index.json" in str(info.value)
    with pytest.raises(_remote.RemoteError) as info2:
        stage(
            "s3://no-such-bucket-feedpipe/ds", tmp_path / "b", storage_options=sopts, progress=False
        )
    assert info2.value.permanent and "s3://no-such-bucket-feedpipe/ds/index.json" in str(
        info2.value
    )
    for text in (str(info.value), repr(info.value), str(info2.value), feedpipe_logs(caplog)):
        assert SECRET not in text and SECRET_KEY not in text
    assert SECRET not in caplog.text  # botocore's DEBUG logs show the key id, never the secret


def test_transient_faults_are_retried(
    tmp_path: Path,
    s3_bucket: tuple[str, dict[str, Any]],
    s3_server: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket, opts = s3_bucket
    contents = make_dataset(tmp_path / "src", shards=3)
    url = upload(tmp_path / "src", bucket, opts)
    caplog.set_level(logging.DEBUG)
    with FaultProxy(s3_server) as proxy:
        proxy.inject("drop", times=2, match="/index.json")
        proxy.inject("503", times=2, match="shard-00001.data")
        proxy.inject("truncate", times=1, match="shard-00002.data", method="GET")
        proxy.inject("500", times=1, match="shard-00000.label")
        result = stage(
            url,
            tmp_path / "dst",
            storage_options=secret_opts(opts, proxy.url),
            workers=4,
            progress=False,
        )
        assert proxy.pending() == 0 and proxy.faults_served == 6
    assert result.copied == len(contents)
    assert_same(tmp_path / "dst", contents)
    assert "retrying" in feedpipe_logs(caplog)
    assert SECRET not in caplog.text and SECRET_KEY not in feedpipe_logs(caplog)


def test_access_denied_fails_at_once_without_leaking(
    tmp_path: Path,
    s3_bucket: tuple[str, dict[str, Any]],
    s3_server: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=2)
    url = upload(tmp_path / "src", bucket, opts)
    caplog.set_level(logging.DEBUG)
    with FaultProxy(s3_server) as proxy:
        proxy.inject("403", times=100, match="shard-00001.data")
        with pytest.raises(_remote.RemoteError) as info:
            stage(
                url,
                tmp_path / "dst",
                storage_options=secret_opts(opts, proxy.url),
                workers=2,
                progress=False,
            )
        hits = [r for r in proxy.requests if "shard-00001.data" in r[1]]
    assert info.value.permanent
    assert f"{url}/shard-00001.data" in str(info.value)
    assert len(hits) == 1  # failed at once: no retries
    for text in (str(info.value), repr(info.value), feedpipe_logs(caplog)):
        assert SECRET not in text and SECRET_KEY not in text
    assert SECRET not in caplog.text
    assert not (tmp_path / "dst" / "index.json").exists()


@pytest.mark.serial  # a 1 s deadline: beside another make test the index read alone took 5 s
def test_retry_gives_up_at_deadline(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], s3_server: str
) -> None:
    bucket, opts = s3_bucket
    make_dataset(tmp_path / "src", shards=1)
    url = upload(tmp_path / "src", bucket, opts)
    with FaultProxy(s3_server) as proxy:
        proxy.inject("500", times=10_000, match="shard-00000.data")
        with pytest.raises(_remote.RemoteError, match=r"still failing after \d+ attempts") as info:
            stage(
                url,
                tmp_path / "dst",
                storage_options=secret_opts(opts, proxy.url),
                progress=False,
                deadline_s=1.0,
            )
    assert not info.value.permanent and "shard-00000.data" in str(info.value)


def test_redact() -> None:
    opts = {
        "key": "AKIAXXXXYYYY",
        "secret": "abc/def+ghi",
        "client_kwargs": {"aws_session_token": "tok123456"},
    }
    text = "s3://user:pw@host/x?X-Amz-Signature=deadbeef&a=1 AKIAXXXXYYYY abc/def+ghi tok123456"
    out = _remote.redact(text, opts)
    for secret in ("pw@", "deadbeef", "AKIAXXXXYYYY", "abc/def+ghi", "tok123456"):
        assert secret not in out
    assert "a=1" in out


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from feedpipe.cli import main

    contents = make_dataset(tmp_path / "src", shards=2)
    assert main(["stage", str(tmp_path / "src"), str(tmp_path / "dst"), "--no-progress"]) == 0
    assert "4 files copied" in capsys.readouterr().out
    assert_same(tmp_path / "dst", contents)
    assert main(["stage", str(tmp_path / "missing"), str(tmp_path / "dst2"), "--no-progress"]) == 1
    assert "missing/index.json" in capsys.readouterr().err


def test_feedpipe_stage_stays_callable_after_its_module_is_imported(tmp_path: Path) -> None:
    """``from feedpipe.stage import stage`` (a public path) bound the module over the function:
    ``feedpipe.stage(src, dst)`` was then "'module' object is not callable"."""
    import feedpipe.stage

    paths = _fixtures(tmp_path)
    feedpipe.stage(paths["mm"], tmp_path / "staged")
    assert len(MemmapDataset(tmp_path / "staged")) == 3


ROOT = Path(__file__).resolve().parent.parent


def test_restage_same_version_keeps_the_index_when_nothing_is_fetched(tmp_path: Path) -> None:
    make_dataset(tmp_path / "src", shards=2, nbytes=5000)
    dst = tmp_path / "dst"
    stage(tmp_path / "src", dst, progress=False)
    result = stage(tmp_path / "src", dst, progress=False)
    assert result.copied == 0
    assert (dst / "index.json").read_bytes() == (tmp_path / "src" / "index.json").read_bytes()
    assert len(MemmapDataset(dst, verify=True)) == 10


def test_stage_from_an_unreachable_host_fails_at_once_in_one_line(tmp_path: Path) -> None:
    """It printed a warning per retry (37 lines over 2 minutes) before its one-line error."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "feedpipe.cli", "stage", "--no-progress"),
            *(f"http://127.0.0.1:{free_port()}/ds", str(tmp_path / "dst")),
        ],
        capture_output=True,
        text=True,
        timeout=100,  # the old retries ran to the 120 s deadline
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0], proc.stderr
    assert not (tmp_path / "dst").exists()


def test_retries_warn_once_per_call(caplog: pytest.LogCaptureFixture) -> None:
    """Transient errors are still retried, but only the first retry of a call is a warning."""
    import logging

    failures = iter(range(4))

    def flaky() -> str:
        if next(failures, None) is not None:
            raise ConnectionResetError("reset by peer")
        return "ok"

    policy = _remote.RetryPolicy(deadline_s=30, base_s=0.001, max_sleep_s=0.002)
    with caplog.at_level(logging.DEBUG, logger="feedpipe.remote"):
        assert _remote.call(flaky, "http://h/x", policy=policy) == "ok"
    retries = [r for r in caplog.records if "transient error" in r.getMessage()]
    assert [r.levelno for r in retries] == [logging.WARNING] + [logging.DEBUG] * 3


def test_no_verify_existing_never_serves_v2_index_over_v1_shards(tmp_path: Path) -> None:
    """v1 and v2 have shards of the same sizes: trusting sizes over another version's files
    wrote v2's index over v1's bytes, and the default open served them."""
    make_dataset(tmp_path / "v1", shards=2, nbytes=5000, seed=1)
    v2 = make_dataset(tmp_path / "v2", shards=2, nbytes=5000, seed=2)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    stage(tmp_path / "v2", dst, progress=False, verify_existing=False)
    for name, data in v2.items():
        assert (dst / name).read_bytes() == data, name
    assert len(MemmapDataset(dst, verify=True)) > 0


def test_no_verify_existing_after_an_interruption_rechecks_crcs(tmp_path: Path) -> None:
    """No index in dst (an interrupted stage): leftovers of the same size are not trusted."""
    make_dataset(tmp_path / "v1", shards=2, nbytes=5000, seed=1)
    v2 = make_dataset(tmp_path / "v2", shards=2, nbytes=5000, seed=2)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    (dst / "index.json").unlink()  # what a stage of v2 killed after its first step leaves
    stage(tmp_path / "v2", dst, progress=False, verify_existing=False)
    for name, data in v2.items():
        assert (dst / name).read_bytes() == data, name
    MemmapDataset(dst, verify=True)


def test_no_verify_existing_still_skips_a_complete_same_version(tmp_path: Path) -> None:
    make_dataset(tmp_path / "v1", shards=2, nbytes=5000, seed=1)
    dst = tmp_path / "dst"
    stage(tmp_path / "v1", dst, progress=False)
    result = stage(tmp_path / "v1", dst, progress=False, verify_existing=False)
    assert result.copied == 0 and result.skipped > 0
