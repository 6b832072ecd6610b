"""Shared fixtures: GPU skipping, and a real S3 API server (moto in server mode) on localhost."""

from __future__ import annotations

import os
import signal
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def pytest_configure(config: pytest.Config) -> None:
    """A run started in the background by a non-interactive shell inherits SIGINT ignored
    (POSIX), and Python then installs no KeyboardInterrupt handler, in this process or in the
    Python processes it starts. The Ctrl-C tests need the default, so it is put back."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-order",
        choices=("forward", "reverse"),
        default="forward",
        help="run the collected tests in this order (the GPU suite must pass in one process in "
        "any order: tests/test_gpu_hygiene.py)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--gpu-order") == "reverse":
        items.reverse()
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_cuda_error_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A GPU test that leaves a CUDA runtime error behind fails itself, not the next test (the
    error is cleared here, after the test's garbage is collected: finalizers unregister)."""
    yield
    if "gpu" not in request.keywords or not _cuda_available():
        return
    import gc

    from feedpipe.device import hostreg

    gc.collect()
    err = hostreg.clear_last_error()
    if err:
        pytest.fail(f"{request.node.nodeid} left CUDA runtime error {err} behind for the next call")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3 API server (moto in server mode) on a free localhost port; yields its URL."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec storage_options for s3fs against a local endpoint."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket on the local S3 server: yields ``(bucket_name, storage_options)``."""
    import boto3

    opts = s3_options(s3_server)
    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    yield name, opts
