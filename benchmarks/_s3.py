"""A local S3 API server (moto in server mode, its own process) for the remote benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MOTO_NOTE", "client", "cpu_seconds", "create_bucket", "s3_options", "start_moto"]

MOTO_NOTE = (
    "One moto server process serves every request: its buckets live in that process, and s3fs "
    "addresses one endpoint per filesystem, so keys cannot be spread over several server "
    "processes without a proxy that parses and routes each HTTP request by bucket; the server "
    "CPU column (cores busy, of one GIL-bound process) tells when the server binds."
)


def start_moto(timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``moto_server`` on a free localhost port; return the process and its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # ``python -m moto.server``: no console script needed (a wheel bundle installed with
    # ``pip --target`` has none on PATH)
    exe = f"{sys.executable} -m moto.server"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server ({exe}) did not start within {timeout_s:.0f} s")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, every thread) used so far by process ``pid`` (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec ``storage_options`` for s3fs against the local server (moto takes any key)."""
    return {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def client(endpoint: str) -> Any:
    """A boto3 S3 client for the local server."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    )


def create_bucket(endpoint: str, name: str) -> None:
    """Create bucket ``name`` on the local server."""
    client(endpoint).create_bucket(Bucket=name)
