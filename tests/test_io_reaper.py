"""feedpipe.io.reaper: ask, wait, terminate, kill, reap, within the bound; report what outlives
it. Real processes (multiprocessing, fork) and a real interpreter exit."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _procs import alive, run_python, wait_gone

from feedpipe.io.reaper import Bound, StuckWorkerWarning, Workers, end_processes, join_threads

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc")

FAST = Bound(grace=0.3, term=0.3, kill=5.0)
ROOT = Path(__file__).resolve().parent.parent


def _hang(deaf: bool, stop: Any, ready: Any) -> None:
    if deaf:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while stop is None or not stop.is_set():
        time.sleep(0.01)


def _start(deaf: bool, stop: Any = None) -> Any:
    """A hung worker, returned once it runs its loop (deaf: once SIGTERM is ignored). Not
    waiting let a loaded machine SIGTERM it (after the 0.3 s grace) before it got that far:
    it died of SIGTERM where the test expects SIGKILL."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hang, args=(deaf, stop, ready), name=f"deaf={deaf}")
    p.start()
    assert ready.wait(60), f"worker {p.name} did not start in 60 s"
    return p


@pytest.mark.parametrize(
    ("deaf", "asked", "code"),
    [(False, True, 0), (False, False, -signal.SIGTERM), (True, False, -signal.SIGKILL)],
)
def test_each_step_ends_the_worker_it_should(deaf: bool, asked: bool, code: int) -> None:
    """Asked: exits by itself. Hung: SIGTERM. Hung and deaf to SIGTERM: SIGKILL. All reaped."""
    stop = mp.get_context("fork").Event()
    p = _start(deaf, stop)
    assert end_processes([p], "test worker", ask=stop.set if asked else None, bound=FAST) == []
    assert p.exitcode == code
    assert alive([p.pid]) == []  # reaped: not even a zombie


class _Unkillable:
    """Stands for a process in uninterruptible sleep (which a test cannot make): SIGKILL
    does not end it."""

    name, pid, sentinel = "reader-7", 424242, -1

    def is_alive(self) -> bool:
        return True

    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


def test_a_worker_that_outlives_sigkill_is_reported_by_name_and_pid() -> None:
    with pytest.warns(StuckWorkerWarning, match=r"test worker reader-7 \(pid 424242\)"):
        left = end_processes([_Unkillable()], "test worker", bound=Bound(0.05, 0.05, 0.05))
    assert [p.pid for p in left] == [424242]


def test_workers_end_when_their_owner_is_collected() -> None:
    class Owner:
        pass

    owner = Owner()
    workers = Workers("test worker", owner, bound=FAST)
    p = _start(deaf=True)
    workers.add([p])
    del owner
    gc.collect()
    assert p.exitcode == -signal.SIGKILL and workers.pids == []


def test_a_stuck_thread_is_reported_and_left() -> None:
    release = threading.Event()
    t = threading.Thread(target=release.wait, name="stuck-io", daemon=True)
    t.start()
    try:
        with pytest.warns(StuckWorkerWarning, match=r"test thread stuck-io \(native id \d+\)"):
            assert join_threads([t], "test", 0.05) == [t]
    finally:
        release.set()
        t.join()


_EXIT_SCRIPT = textwrap.dedent(
    """
    import weakref

    class Early:
        pass

    # a finalizer made before multiprocessing is imported: weakref's exit hook then runs after
    # multiprocessing's, which joins the (non-daemon) worker first
    early = Early()
    weakref.finalize(early, print)

    import multiprocessing as mp, signal, time
    from feedpipe.io.reaper import Bound, Workers

    def hang():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(1e9)

    class Owner:
        pass

    if __name__ == "__main__":
        owner = Owner()  # never closed: interpreter exit must end its worker
        workers = Workers("test worker", owner, bound=Bound(0.2, 0.2, 5.0))
        p = mp.get_context("fork").Process(target=hang)  # not a daemon: joined at exit
        p.start()
        workers.add([p])
        print(p.pid, flush=True)
    """
)


def test_interpreter_exit_ends_a_deaf_hung_worker(tmp_path: Path) -> None:
    """multiprocessing joins its children at exit without a timeout: a hung worker deaf to
    SIGTERM would hold the interpreter forever; the reaper's exit hook runs first."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    proc = run_python(script, timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert wait_gone([int(proc.stdout.split()[0])], 2.0) == []


def test_a_forked_child_leaves_its_parents_workers_alone() -> None:
    """A forked child inherits the owner's Workers (and its exit hooks), not its processes."""
    workers = Workers("test worker", bound=FAST)
    p = _start(deaf=False)
    workers.add([p])
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: never back into pytest
        code = 1
        try:
            code = 0 if workers.end() == [] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert p.is_alive()  # untouched by the child
    workers.end()
    assert p.exitcode == -signal.SIGTERM


def _hang_with_children(deaf: bool, pids: Any, ready: Any) -> None:
    """A worker that ran a subprocess, whose own child runs one too (a grandchild), then hangs."""
    if deaf:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen(['sleep', '1000']); print(p.pid, flush=True); time.sleep(1e9)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    pids[0], pids[1] = child.pid, int(child.stdout.readline())
    ready.set()
    child.wait()


@pytest.mark.parametrize("deaf", [False, True])
def test_a_killed_worker_takes_its_own_children_with_it(deaf: bool) -> None:
    """A worker that started processes of its own (a decoder subprocess, a pool): terminating
    or killing it leaves no orphan, however deep (they were reparented to init, running)."""
    ctx = mp.get_context("fork")
    pids, ready = ctx.Array("i", 2), ctx.Event()
    p = ctx.Process(target=_hang_with_children, args=(deaf, pids, ready), name="decoder")
    p.start()
    try:
        assert ready.wait(20)
        assert end_processes([p], "test worker", bound=FAST) == []
        assert wait_gone(pids[:], 5.0) == []
    finally:
        for pid in alive(pids[:]):
            os.kill(pid, signal.SIGKILL)


_ORPHAN_TEST = textwrap.dedent(
    """
    import subprocess, sys

    def test_orphan():
        # a child that starts a process and exits at once: the process is orphaned
        subprocess.run(
            [sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep', '60'])"],
            check=True,
        )
    """
)


def test_the_leftover_check_catches_an_orphaned_grandchild(tmp_path: Path) -> None:
    """tests/conftest.py's session check walks the processes descended from pytest: an orphan
    (its parent exited) is still found, and named with the test that made it."""
    tests = Path(__file__).resolve().parent
    for name in ("conftest.py", "_procs.py"):
        (tmp_path / name).write_text((tests / name).read_text())
    (tmp_path / "test_orphan.py").write_text(_ORPHAN_TEST)
    (tmp_path / "torch.py").write_text("raise ImportError('not needed here')\n")  # saves seconds
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-q",
            "-p",
            "no:hypothesispytest",
            str(tmp_path / "test_orphan.py"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FEEDPIPE_TEST_LEFTOVER_GRACE_S": "0.5"},
    )
    for pid in re.findall(r"pid (\d+) \(sleep 60\)", proc.stdout + proc.stderr):
        os.kill(int(pid), signal.SIGKILL)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert re.search(r"pid \d+ \(sleep 60\), left by test_orphan.py::test_orphan", proc.stdout)


_KEEP: list[Any] = []


def _rank(pid: Any) -> None:
    """A multiprocessing child (a rank) whose workers' owner is still referenced when it
    returns: multiprocessing then runs no atexit hook, only its own finalizers."""

    class Owner:
        pass

    owner = Owner()
    workers = Workers("test worker", owner, bound=FAST)
    p = _start(deaf=True)
    workers.add([p])
    pid.value = p.pid
    _KEEP.append(owner)  # held by a trainer object, a global, a cycle...


def test_a_multiprocessing_child_ends_its_workers_when_it_exits() -> None:
    """Found: in a process started by multiprocessing (torch.multiprocessing.spawn's ranks),
    the exit hook never ran (no atexit there): multiprocessing terminated the daemonic worker
    and joined it without a timeout, so a worker deaf to SIGTERM held the rank forever."""
    ctx = mp.get_context("fork")
    pid = ctx.Value("i", 0)
    rank = ctx.Process(target=_rank, args=(pid,))
    rank.start()
    try:
        rank.join(20)
        assert rank.exitcode == 0, "the rank hung at exit"
        assert wait_gone([pid.value], 5.0) == []
    finally:
        if rank.is_alive():
            rank.kill()
            rank.join()
        for left in alive([pid.value]):
            os.kill(left, signal.SIGKILL)
