"""The benchmarks' shaping proxy shapes each connection; the ckpt uploader uses every thread."""

from __future__ import annotations

import http.server
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.remote import RemoteOptions


def _load_proxy() -> object:
    """benchmarks/_shaping_proxy.py, loaded by path: putting benchmarks/ on sys.path would let its
    ``datasets.py`` shadow Hugging Face's ``datasets`` for every later test in the process."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "_shaping_proxy.py"
    spec = importlib.util.spec_from_file_location("_bench_shaping_proxy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


start_proxy = _load_proxy().start_proxy  # type: ignore[attr-defined]

BODY = b"x" * (2 << 20)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.read() == BODY
    return time.perf_counter() - t0


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_proxy_holds_each_connection_to_its_rtt_and_bandwidth(server: str) -> None:
    proc, endpoint = start_proxy(server, rtt_s=0.05, mbps=20.0)
    try:
        one = _get(endpoint)
        # handshake + request/response round trips + 2 MiB at 20 MB/s on this connection
        assert one >= 0.1 + len(BODY) / 20e6
        # four connections at once: each has its own 20 MB/s, so together they take about as
        # long as one (not four times as long, as one shared link would)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_get, args=(endpoint,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert time.perf_counter() - t0 < 2.5 * one
    finally:
        proc.kill()
        proc.wait(30)


def test_uploader_cuts_one_large_file_into_a_part_per_thread() -> None:
    from ckpt.tiers.s3put import part_bytes as _part_bytes

    block = RemoteOptions("s3://b/r").block_bytes
    threads = RemoteOptions("s3://b/r").threads
    # one 64 MiB data file: every thread gets a part (the old fixed 16 MiB parts: only 4)
    assert -(-(64 << 20) // _part_bytes(64 << 20, block, threads)) == threads
    assert _part_bytes(1 << 30, block, threads) == block  # large files: the configured part
    assert _part_bytes(1 << 20, block, threads) == 5 << 20  # never below S3's minimum
