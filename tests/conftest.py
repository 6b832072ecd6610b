"""Shared fixtures: GPU skipping, a real S3 API server (moto in server mode) on localhost with a
``proxy`` to inject faults in front of it, the stall meter's fake ``clock``, and the leftover
check: no test may leave a process or a /dev/shm entry of ours behind. Helper functions shared
by several test files live in tests/_helpers.py (data, states) and tests/_procs.py (processes)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from _procs import alive, descendants, describe, proc_listing, shm_entries, wait_gone

if TYPE_CHECKING:  # the helpers import torch and feedpipe: only fixtures that use them do
    from _faultproxy import FaultProxy
    from _helpers import FakeClock

# processes still exiting get this long before they count as left behind (a test of the check
# itself shortens it)
LEFTOVER_GRACE_S = float(os.environ.get("FEEDPIPE_TEST_LEFTOVER_GRACE_S", "5.0"))


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


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The stall meter's clock, replaced by a ``FakeClock`` that the test advances."""
    from _helpers import FakeClock

    from feedpipe.stall import meter as stall_mod

    c = FakeClock()
    monkeypatch.setattr(stall_mod, "_perf", c)
    return c


@pytest.fixture
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    """A ``FaultProxy`` in front of the S3 server (inject faults with ``proxy.inject``)."""
    from _faultproxy import FaultProxy

    with FaultProxy(s3_server) as p:
        yield p


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket on the local S3 server: yields ``(bucket_name, storage_options)``."""
    import s3fs
    from _helpers import s3_options

    opts = s3_options(s3_server)
    name = f"test-{uuid.uuid4().hex[:12]}"
    # made through s3fs, the client stack the tests use: a boto3 create_bucket here was seen
    # answered 200 without reaching the server (no request logged), then a 404 for the test
    fs = s3fs.S3FileSystem(**opts)
    fs.call_s3("create_bucket", Bucket=name)
    fs.invalidate_cache()
    assert fs.exists(name), f"bucket {name} not visible on {s3_server}"
    yield name, opts


# ------------------------------------------------------------------------ leftover check
class _Seen:
    """What each test left running: ``{pid: test id}`` and ``{/dev/shm name: test id}``, by the
    test after which each was first seen (with pytest-xdist, per worker: its own descendants)."""

    pids: dict[int, str] = {}
    shm: dict[str, str] = {}
    ever: set[int] = {os.getpid()}  # this process and every descendant seen (shm names' pids)
    listing: frozenset[str] = frozenset()  # /proc's pids at the last look


def _record(nodeid: str) -> tuple[list[int], list[str]]:
    """Note the processes and shm entries that appeared since the last test; the new ones."""
    new_pids: list[int] = []
    listing = proc_listing()
    if listing != _Seen.listing:  # else no process started or ended anywhere: nothing new
        _Seen.listing = listing
        now = descendants()
        _Seen.ever.update(now)
        _Seen.pids = {p: t for p, t in _Seen.pids.items() if p in now}  # a reused pid is new
        new_pids = [p for p in alive(now) if p not in _Seen.pids]
        for pid in new_pids:
            _Seen.pids[pid] = nodeid
    new_shm = [n for n in shm_entries(_Seen.ever) if n not in _Seen.shm]
    for name in new_shm:
        _Seen.shm[name] = nodeid
    return new_pids, new_shm


def _report(pids: list[int], shm: list[str]) -> str:
    lines = [
        f"  {describe(p)}, left by {_Seen.pids.get(p, 'no test (session set-up or teardown)')}"
        for p in pids
    ]
    lines += [f"  /dev/shm/{n}, left by {_Seen.shm.get(n, '?')}" for n in shm]
    return "\n".join(lines)


def _leftovers(pids: list[int]) -> tuple[list[int], list[str]]:
    """Those of ``pids`` still alive after the grace period, and our shm entries still there."""
    left = wait_gone(pids, LEFTOVER_GRACE_S)
    shm = sorted(shm_entries(_Seen.ever))
    return left, shm


@pytest.fixture(autouse=True)
def _no_leftovers_per_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Attribute new processes/shm entries to the test that made them; a ``serial`` test must
    leave none (the session-level check below covers the others)."""
    yield
    new_pids, new_shm = _record(request.node.nodeid)
    if request.node.get_closest_marker("serial") and (new_pids or new_shm):
        left = wait_gone(new_pids, LEFTOVER_GRACE_S)
        shm = [n for n in new_shm if n in shm_entries(_Seen.ever)]
        if left or shm:
            pytest.fail(f"{request.node.nodeid} left behind:\n{_report(left, shm)}", False)


def _adopt_orphans() -> None:
    """Make this process the child subreaper of its descendants (Linux): a process orphaned
    under it (a killed worker's own child, a double fork) is reparented here, not to init, so
    the walk below still finds it. The flag is not inherited by children."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_child_subreaper = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: orphans go to init
        pass


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers_per_session() -> Iterator[None]:
    """Fail the session (an error at the teardown of its last test) when a process descended
    from this one (orphans included: :func:`_adopt_orphans`), or a /dev/shm entry of ours,
    outlives every test by LEFTOVER_GRACE_S."""
    _adopt_orphans()
    yield
    _record("no test (session teardown)")
    left, shm = _leftovers(list(descendants()))
    if left or shm:
        msg = f"processes/shared memory left behind when the session ended:\n{_report(left, shm)}"
        print(msg, file=sys.stderr)
        pytest.fail(msg, False)


@pytest.fixture
def _keep_handlers():  # type: ignore[no-untyped-def]
    """Each test leaves SIGTERM/SIGUSR1 as it found them: a ``save_and_exit`` whose
    ``SystemExit`` a test catches leaves its exiting handler installed (ckpt.preemption)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, h in before.items():
        signal.signal(s, h)
