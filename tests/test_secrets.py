"""Issue 16, point 12: a URL's password or signed query string is never printed.

Not in DatasetError / IndexError messages, not in ``repr(MemmapDataset)`` or ``repr(ZarrDataset)``,
not in Zarr or ``stage`` errors, log records, stdout/stderr or files written. URLs come from
hypothesis; the datasets are served by a real HTTP server (fsspec's HTTPFileSystem + aiohttp,
which take the credentials from the URL).
"""

from __future__ import annotations

import functools
import http.server
import json
import logging
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import QuietHandler as _Quiet
from _secrets import LeakCheck
from conftest import free_port
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_stage import make_dataset

from feedpipe import MemmapDataset
from feedpipe.errors import DatasetError
from feedpipe.remote import transfer as _remote
from feedpipe.remote.stage import stage

ROOT = Path(__file__).resolve().parent.parent

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# what a careless user puts in a password: URL sub-delims, ':' and a raw '@' included
passwords = st.text(alphabet=_ALNUM + "-._~!$&'()*+,;=:@", min_size=10, max_size=30).filter(
    lambda p: sum(c in _ALNUM for c in p) >= 6
)
# fsspec reads "::" as its URL-chaining separator, so a URL whose password holds it cannot be
# opened at all (its redaction is still checked by the tests that need no server)
openable_passwords = passwords.filter(lambda p: "::" not in f"user:{p}")
users = st.text(alphabet=_ALNUM + "-._", min_size=1, max_size=12)
tokens = st.text(alphabet=_ALNUM + "-._~%", min_size=10, max_size=40).filter(
    lambda t: sum(c in _ALNUM for c in t) >= 6
)
query_names = st.sampled_from(
    [
        "X-Amz-Signature",
        "X-Amz-Credential",
        "X-Amz-Security-Token",
        "AWSAccessKeyId",
        "Signature",
        "token",
        "access_token",
        "sig",
        "api_key",
        "X-Goog-Signature",
    ]
)
hosts = st.sampled_from(["example.com", "127.0.0.1:9000", "s3.eu-west-1.amazonaws.com"])
schemes = st.sampled_from(["http", "https", "s3", "gs", "HTTP"])
paths = st.lists(st.text(alphabet=_ALNUM + "-_.", min_size=1, max_size=8), max_size=3)


@st.composite
def secret_urls(draw: Any) -> tuple[str, list[str], str]:
    """``(url, secrets, host)``: userinfo and/or credential query parameters."""
    scheme, host = draw(schemes), draw(hosts)
    secrets: list[str] = []
    auth = ""
    if draw(st.booleans()):
        password = draw(passwords)
        secrets.append(password)
        auth = f"{draw(users)}:{password}@"
    path = "/".join(draw(paths))
    query = []
    for _ in range(draw(st.integers(0 if auth else 1, 3))):
        value = draw(tokens)
        secrets.append(value)
        query.append(f"{draw(query_names)}={value}")
    if query and draw(st.booleans()):
        query.insert(draw(st.integers(0, len(query))), "versionId=3&x-id=GetObject")
    url = f"{scheme}://{auth}{host}/{path}" + ("?" + "&".join(query) if query else "")
    return url, secrets, host


contexts = st.sampled_from(
    [
        "{u}",
        "cannot read {u}: permanent error",
        "{u!r}",
        "URL({u!r})",
        "{{'url': {u!r}, 'x': 1}}",
        "json: {j}",
        "(\n{u}\n)",
        "a {u}, b {u}",
    ]
)


@given(secret_urls(), contexts)
def test_redact_removes_every_secret_and_keeps_the_host(
    case: tuple[str, list[str], str], context: str
) -> None:
    url, secrets, host = case
    text = context.format(u=url, j=json.dumps({"url": url}))
    clean = _remote.redact(text)
    for s in secrets:
        assume(s not in context and s not in host)
        assert s not in clean, (text, clean)
    assert host in clean
    assert _remote.redact(clean) == clean


@given(secret_urls())
def test_dataset_error_redacts_its_own_message(case: tuple[str, list[str], str]) -> None:
    url, secrets, _host = case
    leaks = LeakCheck(*secrets)

    def boom() -> None:
        raise DatasetError(f"{url}: shard 3 file is missing")

    leaks.raises(DatasetError, boom)


def test_remote_error_pickles_redacted() -> None:
    """Loader workers send errors to the parent by pickle: it must survive, still redacted."""
    import pickle

    exc = _remote.RemoteError(
        "cannot read http://u:hunter2-secret@h/x", "http://u:hunter2-secret@h/x", permanent=True
    )
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is _remote.RemoteError and back.permanent and str(back) == str(exc)
    LeakCheck("hunter2-secret").exception(back)
    assert "hunter2-secret" not in back.url


@pytest.mark.parametrize(
    "message",
    [
        'Parameter validation failed:\nInvalid bucket name "AKIA0KEY0ID:S3cr3t/Val@ue@bucket": ...',
        "Invalid bucket name 'AKIA0KEY0ID:S3cr3t/Val@ue@bucket'",
        "could not parse (AKIA0KEY0ID:S3cr3t/Val@ue@bucket)",
    ],
)
def test_userinfo_quoted_without_its_scheme_is_redacted(message: str) -> None:
    """Issue 25 item 16: botocore quotes the bucket part of s3://KEY:SECRET@bucket/..."""
    leaks = LeakCheck("S3cr3t/Val@ue", "AKIA0KEY0ID")
    leaks.text("redact", _remote.redact(message))
    assert "***@bucket" in _remote.redact(message)
    leaks.exception(_remote.RemoteError(f"cannot read s3://x: {message}", "s3://x"))
    leaks.exception(DatasetError(message))


@pytest.mark.parametrize(
    "shown",
    [
        "GET https://h/b/x?X-Amz-Date=1&q=wJal%2FrXUtn%2BFEMI%3DK7MDENG",
        "bad credentials wJal%2frXUtn%2bFEMI%3dK7MDENG",
        "form body v=wJal%2FrXUtn%2BFEMI%3DK7MDENG (wJal/rXUtn%2BFEMI%3DK7MDENG)",
        "tokens ['TokenOne1234', 'TokenTwo5678']",
    ],
)
def test_a_secret_shown_url_encoded_or_in_a_list_is_redacted(shown: str) -> None:
    """An AWS secret key holds "/" and "+": a library that puts it in a URL or a form shows
    it percent-encoded, and the plain ``replace`` of the option's value missed it. A secret
    option given as a list (several tokens) was not redacted at all."""
    opts = {"secret": "wJal/rXUtn+FEMI=K7MDENG", "token": ["TokenOne1234", "TokenTwo5678"]}
    out = _remote.redact(shown, opts)
    LeakCheck("rXUtn", "TokenOne", "TokenTwo").text("redact", out)


def test_plain_paths_are_left_alone() -> None:
    for text in (
        "s3://b/ds/year=2024/key=3/part-0",
        "/data/monkey=1",
        "shard-00000.data",
        "at 12:30 user@example.com wrote",
        "s3://***@bucket/ds",
    ):
        assert _remote.redact(text) == text


# ------------------------------------------------------------------ a real HTTP server


@pytest.fixture(scope="module")
def http_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A static HTTP server over a directory holding ``ds`` (a dataset), ``bad`` (junk index)
    and ``arr.zarr`` (a Zarr v3 array); yields ``(host:port, directory)``."""
    root = tmp_path_factory.mktemp("www")
    make_dataset(root / "ds", shards=2, nbytes=5000)
    (root / "bad").mkdir()
    (root / "bad" / "index.json").write_text('{"format": "feedpipe.memmap", "shards": [')
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


_settings = settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_settings
@given(user=users, password=openable_passwords)
def test_memmap_dataset_over_http_never_shows_the_password(
    *,
    http_root: tuple[str, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    user: str,
    password: str,
) -> None:
    hostport, _root = http_root
    leaks = LeakCheck(password)
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="feedpipe")
    base = f"http://{user}:{password}@{hostport}"
    ds = MemmapDataset(f"{base}/ds", cache_dir=tmp_path / "cache")
    leaks.obj(ds)
    leaks.raises(IndexError, lambda: ds[10**6])
    leaks.raises(IndexError, lambda: ds.read_batch([0, 10**6]))
    assert ds[3]["data"].shape == (1000,)  # through the shard cache
    ds.close()
    leaks.raises(NotImplementedError, lambda: MemmapDataset(f"{base}/ds")[0])
    leaks.raises(DatasetError, lambda: MemmapDataset(f"{base}/missing"))
    leaks.raises(DatasetError, lambda: MemmapDataset(f"{base}/bad"))
    leaks.raises(DatasetError, lambda: MemmapDataset(f"{base}/bad", cache_dir=tmp_path / "c2"))
    leaks.captured(capfd)
    leaks.logs(caplog)
    leaks.files(tmp_path)


@_settings
@given(user=users, password=openable_passwords)
def test_stage_over_http_never_shows_the_password(
    *,
    http_root: tuple[str, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    user: str,
    password: str,
) -> None:
    hostport, _root = http_root
    leaks = LeakCheck(password)
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="feedpipe")
    base = f"http://{user}:{password}@{hostport}"
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one per hypothesis example
    dst = tmp_path / "dst"
    result = stage(f"{base}/ds", dst, progress=True, workers=2)  # the bar shows the URL
    assert result.copied == 4
    leaks.raises(DatasetError, lambda: stage(f"{base}/missing", tmp_path / "d2", progress=True))
    leaks.raises(DatasetError, lambda: stage(f"{base}/bad", tmp_path / "d3", progress=False))
    dead = f"http://{user}:{password}@127.0.0.1:{free_port()}/ds"  # unreachable: fails at once
    leaks.raises(DatasetError, lambda: stage(dead, tmp_path / "d4", deadline_s=1.5))
    resets = iter([ConnectionResetError(f"reset while reading {dead}")])

    def flaky() -> None:  # a transient error: retried, and its warning logged
        exc = next(resets, None)
        if exc is not None:
            raise exc

    _remote.call(flaky, dead, policy=_remote.RetryPolicy(deadline_s=5, base_s=0.001))
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    leaks.captured(capfd)
    leaks.logs(caplog)
    leaks.files(tmp_path)


def test_feedpipe_stage_and_inspect_never_print_the_password(
    http_root: tuple[str, Path], tmp_path: Path
) -> None:
    hostport, _root = http_root
    password = "Pa55-w0rd@with:odd;chars"
    leaks = LeakCheck(password)
    for where in ("missing", "bad"):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from feedpipe.cli import main; sys.exit(main(sys.argv[1:]))",
                "stage",
                f"http://me:{password}@{hostport}/{where}",
                str(tmp_path / where),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 1, proc.stderr
        assert "***" in proc.stderr
        leaks.text("stdout", proc.stdout)
        leaks.text("stderr", proc.stderr)
    for where, rc in (("ds", 0), ("missing", 1)):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from feedpipe.cli import main; sys.exit(main(sys.argv[1:]))",
                "inspect",
                f"http://me:{password}@{hostport}/{where}",
                "--verify",
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == rc, proc.stderr
        assert "***" in proc.stdout + proc.stderr
        leaks.text("inspect stdout", proc.stdout)
        leaks.text("inspect stderr", proc.stderr)


def test_zarr_over_http_never_shows_the_password(
    http_root: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    zarr = pytest.importorskip("zarr")
    from feedpipe import ZarrDataset

    hostport, root = http_root
    if not (root / "arr.zarr").exists():
        z = zarr.create_array(store=str(root / "arr.zarr"), shape=(6, 4), chunks=(2, 4), dtype="f4")
        z[:] = np.arange(24, dtype="f4").reshape(6, 4)
    password = "zarr-S3cret!pass"
    leaks = LeakCheck(password)
    caplog.set_level(logging.DEBUG, logger="feedpipe")
    base = f"http://me:{password}@{hostport}"
    ds = ZarrDataset(f"{base}/arr.zarr", backend="zarr")
    leaks.obj(ds)
    leaks.raises(IndexError, lambda: ds.read_batch([0, 99]))
    leaks.raises(DatasetError, lambda: ZarrDataset(f"{base}/nothing.zarr", backend="zarr"))
    leaks.raises(DatasetError, lambda: ZarrDataset(f"{base}/ds", backend="zarr"))
    leaks.logs(caplog)


def test_memmap_dataset_repr_of_a_presigned_url_hides_the_signature() -> None:
    """The redaction happens before the network: a dead presigned URL's error is clean too."""
    sig = "deadbeefcafebabe0123456789abcdef"
    leaks = LeakCheck(sig, "AKIAFEEDPIPE0SECRET")
    url = (
        f"http://127.0.0.1:{free_port()}/ds?X-Amz-Credential=AKIAFEEDPIPE0SECRET"
        f"&X-Amz-Signature={sig}"
    )
    leaks.text("redact", _remote.redact(url))
    leaks.raises(ValueError, lambda: _remote.resolve("s4://me:" + sig + "@host/ds"))


def test_a_long_input_url_is_redacted_before_it_is_cut(tmp_path: Path) -> None:
    """convert(fn) names a failing input by its repr cut to 80 characters: cut first, a long
    token in the URL's userinfo lost its "@" and was shown."""
    from feedpipe.datasets.convert_fn import convert_fn

    token = "gldt-" + "Zq9" * 22
    url = f"https://deploy-token-user:{token}@gitlab.example.com/group/data/shard-0.tar"
    leaks = LeakCheck(token[:12], "Zq9Zq9")
    exc = leaks.raises(
        DatasetError,
        lambda: convert_fn(_fails, [url], tmp_path / "o", num_workers=1, progress_bar=False),
    )
    assert "failed on input 0 ('https://***@gitlab.example.com" in str(exc)


def _fails(item: object) -> None:
    raise ValueError("cannot fetch")


@pytest.fixture
def http_ds(tmp_path: Path) -> Iterator[str]:
    """A static HTTP server over a directory holding the dataset ``ds``; yields host:port."""
    make_dataset(tmp_path / "www" / "ds", shards=2, nbytes=5000)
    handler = functools.partial(_Quiet, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("password", ["S3cret/99x", "S3cret#99x", "S3cret?99x", "S3c@ret/99x"])
def test_a_password_with_a_raw_slash_or_hash_is_redacted(
    tmp_path: Path, http_ds: str, password: str
) -> None:
    """Unencoded '/', '#' or '?' in a password ended the userinfo match: the error showed it."""
    assert "99x" not in _remote.redact(f"http://me:{password}@h/x")
    leaks = LeakCheck(password, "99x")
    leaks.raises(
        DatasetError,
        lambda: stage(f"http://me:{password}@{http_ds}/ds", tmp_path / "d", deadline_s=2),
    )


def test_third_party_debug_logs_never_show_the_password(
    tmp_path: Path, http_ds: str, caplog: pytest.LogCaptureFixture
) -> None:
    """fsspec logs every HTTP URL it opens at DEBUG, userinfo included."""
    leaks = LeakCheck("Pw0rdSecret")
    caplog.set_level(logging.DEBUG)  # the root logger: every library
    stage(f"http://me:Pw0rdSecret@{http_ds}/ds", tmp_path / "d", progress=False)
    MemmapDataset(f"http://me:Pw0rdSecret@{http_ds}/ds", cache_dir=tmp_path / "c")[0]
    assert any(r.name.startswith("fsspec") for r in caplog.records)
    leaks.logs(caplog)
