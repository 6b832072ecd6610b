"""Preemption (docs/guides/preemption.md): SIGTERM/SIGUSR1 become a save at the next step
boundary, agreed by every rank, durable (and uploaded) before a distinct exit status; a resume
is bitwise identical to a run that was never interrupted."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import _faults
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.preemption import PREEMPTED_EXIT_CODE, Preemption, PreemptionOptions

WORKER = Path(__file__).with_name("_ckpt_preempt_train.py")
ROOT = Path(__file__).resolve().parents[1]


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


@pytest.fixture(autouse=True)
def _keep_handlers() -> Any:
    """Every test leaves SIGTERM/SIGUSR1 as it found them (and checks the manager did too)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    after = [signal.getsignal(s) for s in before]
    for s, h in before.items():
        signal.signal(s, h)
    left = [h for h in after if isinstance(getattr(h, "__self__", None), Preemption)]
    assert not left, "a manager left its signal handler installed"


# ---- signals in one process --------------------------------------------------------------------
def test_sigterm_sets_preempted_and_the_process_survives(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_on_preemption=True) as m:
        assert not m.preempted and not m.reached_preemption(0)
        os.kill(os.getpid(), signal.SIGTERM)  # SIG_DFL before us: not chained, we survive
        assert m.preempted
        assert m.reached_preemption(1) and m.should_save(1)
        assert m.reached_preemption(2)  # once agreed it stays agreed


def test_sigusr1_too_and_a_second_signal_changes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_on_preemption=True) as m:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert m._preemption is not None and m._preemption.signalled == signal.SIGUSR1
        assert m.reached_preemption(5)


def test_previous_python_handler_is_chained_and_restored_on_close(tmp_path: Path) -> None:
    seen: list[int] = []

    def previous(signum: int, frame: Any) -> None:
        seen.append(signum)

    signal.signal(signal.SIGUSR1, previous)
    m = CheckpointManager(tmp_path, save_on_preemption=True)
    assert signal.getsignal(signal.SIGUSR1) != previous
    os.kill(os.getpid(), signal.SIGUSR1)
    assert m.preempted and seen == [signal.SIGUSR1]
    m.close()
    assert signal.getsignal(signal.SIGUSR1) == previous
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sig_ign_before_us_is_not_called_and_comes_back(tmp_path: Path) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    m = CheckpointManager(tmp_path, save_on_preemption=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert m.preempted
    m.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_close_leaves_a_handler_installed_after_ours_alone(tmp_path: Path) -> None:
    def later(signum: int, frame: Any) -> None:
        pass

    m = CheckpointManager(tmp_path, save_on_preemption=True)
    signal.signal(signal.SIGTERM, later)
    m.close()
    assert signal.getsignal(signal.SIGTERM) == later
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_off_the_main_thread_is_refused_and_installs_nothing(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(tmp_path, save_on_preemption=True)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert "main thread" in str(errors[0])
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_without_save_on_preemption_nothing_is_installed(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert not m.preempted and not m.reached_preemption(0)
        with pytest.raises(CheckpointError, match="save_on_preemption=True"):
            m.notify_preemption()


def test_notify_preemption_is_the_hook_for_cloud_notices(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_on_preemption=True) as m:
        t = threading.Thread(target=m.notify_preemption)  # e.g. a metadata-server watcher
        t.start()
        t.join(10)
        assert m.preempted and m.reached_preemption(3)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        PreemptionOptions(sync_every=0)
    with pytest.raises(ValueError, match="deadline_s"):
        PreemptionOptions(deadline_s=0)


# ---- save_and_exit -----------------------------------------------------------------------------
def test_signal_before_the_first_save_saves_and_exits(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, save_on_preemption=True)
    os.kill(os.getpid(), signal.SIGTERM)
    assert m.reached_preemption(0)
    with pytest.raises(SystemExit) as info:
        m.save_and_exit(0, _state(0))
    assert info.value.code == PREEMPTED_EXIT_CODE == CheckpointManager.PREEMPTED_EXIT_CODE == 75
    with CheckpointManager(tmp_path) as again:  # closed: the lock is free; the step verifies
        assert again.restore()["step"] == 0


def test_signal_during_a_save_does_not_disturb_it(tmp_path: Path, monkeypatch: Any) -> None:
    real = _faults.pause

    def signalled(point: str) -> None:  # a real SIGTERM lands inside staging and inside writing
        if point in ("stage", "write"):
            os.kill(os.getpid(), signal.SIGTERM)
        real(point)

    monkeypatch.setattr(_faults, "pause", signalled)
    m = CheckpointManager(tmp_path, save_on_preemption=True)
    m.save(3, _state(3))
    assert m.reached_preemption(3)
    with pytest.raises(SystemExit):
        m.save_and_exit(3, _state(3))  # step 3 already saved: only waits for it
    assert m.stats.saves == 1
    got = ckpt.load(tmp_path / "step-3")
    assert torch.equal(got["w"], _state(3)["w"])


def test_save_and_exit_waits_for_the_upload(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    from ckpt.remote import RemoteOptions, RemoteTier

    bucket, options = s3_bucket
    remote = RemoteOptions(f"s3://{bucket}/run", storage_options=options)
    with (  # the with block closes the manager once more
        pytest.raises(SystemExit) as info,
        CheckpointManager(tmp_path, remote=remote, save_on_preemption=True) as m,
    ):
        m.save(1, _state(1))
        m.notify_preemption()
        m.save_and_exit(2, _state(2))
    assert info.value.code == PREEMPTED_EXIT_CODE
    tier = RemoteTier(tmp_path / "other", remote, None)
    try:
        assert 2 in tier.committed_steps()
    finally:
        tier.close()


def test_save_and_exit_past_its_deadline_raises_not_exits(tmp_path: Path, monkeypatch: Any) -> None:
    release = threading.Event()
    real = _faults.pause

    def slow(point: str) -> None:
        if point == "write":
            release.wait(20)
        real(point)

    monkeypatch.setattr(_faults, "pause", slow)
    m = CheckpointManager(tmp_path, save_on_preemption=PreemptionOptions(deadline_s=0.3))
    m.notify_preemption()
    try:
        with pytest.raises(TimeoutError):
            m.save_and_exit(4, _state(4))
    finally:
        release.set()
        m.close()
    assert (tmp_path / "step-4").is_dir()  # the save finished afterwards, nothing was lost


# ---- a real training process -------------------------------------------------------------------
_SECOND_SIGTERM = """
import os, signal, sys, time
import torch
from ckpt.manager import CheckpointManager
m = CheckpointManager(sys.argv[1], save_on_preemption=True)
try:
    m.save_and_exit(0, {"w": torch.zeros(4)})
finally:  # a second notice arrives while the process winds down (threads, atexit, cleanup)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


def test_a_sigterm_after_save_and_exit_still_exits_with_its_status(tmp_path: Path) -> None:
    """Issue 25 item 15: ``save_and_exit`` put ``SIG_DFL`` back, so a second SIGTERM while the
    process exited killed it (-15) instead of the promised status 75."""
    run = subprocess.run(
        [sys.executable, "-c", _SECOND_SIGTERM, str(tmp_path)],
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == PREEMPTED_EXIT_CODE, run.stderr
    assert (tmp_path / "step-0" / "manifest.json").is_file()


def test_a_caught_save_and_exit_leaves_later_managers_as_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    m = CheckpointManager(tmp_path / "a", save_on_preemption=True)
    with pytest.raises(SystemExit):
        m.save_and_exit(0, _state(0))
    with CheckpointManager(tmp_path / "b", save_on_preemption=True) as again:
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not chained to the exiting handler
        assert again.preempted
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _launch(directory: Path, out: Path, steps: int, sync_every: int = 1, **env: str) -> Any:
    progress = directory.with_suffix(".progress")
    cmd = [sys.executable, str(WORKER), str(directory), str(steps), str(out), str(progress)]
    cmd += [str(sync_every), "0.03"]
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen(cmd, env=full, stderr=subprocess.PIPE, text=True), progress


def _wait_progress(progress: Path, at_least: int, proc: Any, timeout: float = 180.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            step = int(progress.read_text() or -1)
        except (FileNotFoundError, ValueError):
            step = -1
        if step >= at_least:
            return step
        time.sleep(0.01)
    raise TimeoutError(f"{progress}: no step {at_least} in {timeout} s")


def _same(a: Path, b: Path) -> None:
    x, y = ckpt.load(a), ckpt.load(b)
    flat_x: list[tuple[str, Any]] = []
    flat_y: list[tuple[str, Any]] = []
    _walk(x, "", flat_x)
    _walk(y, "", flat_y)
    assert [k for k, _ in flat_x] == [k for k, _ in flat_y]
    for (key, u), (_, v) in zip(flat_x, flat_y, strict=True):
        if isinstance(u, torch.Tensor):
            assert u.dtype == v.dtype and torch.equal(u, v), key  # bitwise
        else:
            assert u == v, key


def _walk(node: Any, key: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(node, dict):
        for k in sorted(node, key=str):
            _walk(node[k], f"{key}/{k}", out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _walk(v, f"{key}/{i}", out)
    else:
        out.append((key, node))


def test_real_sigterm_then_resume_is_bitwise_identical(tmp_path: Path) -> None:
    steps = 40
    run, progress = _launch(tmp_path / "run", tmp_path / "run.out", steps)
    _in_process("clean", tmp_path, steps)  # meanwhile, the uninterrupted run, in this process
    at = _wait_progress(progress, 13, run)  # past the save of step 10, before that of 20
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == PREEMPTED_EXIT_CODE, err
    saved = max(int(p.name[5:]) for p in (tmp_path / "run").glob("step-*"))
    assert at <= saved < steps and saved % 10 != 0  # the step at the signal, not a periodic one
    _in_process("run", tmp_path, steps)  # the resume: the same code, in this process
    _same(tmp_path / "clean.out", tmp_path / "run.out")


def _in_process(tag: str, tmp_path: Path, steps: int) -> None:
    threads = torch.get_num_threads()
    args = [tmp_path / tag, steps, tmp_path / f"{tag}.out", tmp_path / f"{tag}.p", 1, 0]
    try:
        _worker().main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)


def _worker() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ckpt_preempt_train", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ranks(tmp_path: Path, world: int, steps: int, sync_every: int, tag: str) -> list[Any]:
    from tests._dist import free_port

    port = str(free_port())
    return [
        _launch(
            tmp_path / f"{tag}{r}",
            tmp_path / f"{tag}{r}.out",
            steps,
            sync_every,
            RANK=str(r),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for r in range(world)
    ]


def test_one_signalled_rank_of_three_all_save_the_same_step(tmp_path: Path) -> None:
    world, sync_every = 3, 4
    procs = _ranks(tmp_path, world, 200, sync_every, "rank")
    _wait_progress(procs[1][1], 5, procs[1][0])
    procs[1][0].send_signal(signal.SIGTERM)  # only rank 1 is told
    saved = []
    for r, (proc, _) in enumerate(procs):
        _, err = proc.communicate(timeout=240)  # a deadlock guard (gloo's own is 180 s)
        assert proc.returncode == PREEMPTED_EXIT_CODE, f"rank {r}: {err}"
        saved.append(max(int(p.name[5:]) for p in (tmp_path / f"rank{r}").glob("step-*")))
    assert len(set(saved)) == 1, saved  # every rank saved the same step
    assert saved[0] % sync_every == 0 and saved[0] < 200


@pytest.mark.slow
def test_multi_rank_preempted_resume_is_bitwise_identical(tmp_path: Path) -> None:
    world, steps = 2, 40
    clean = _ranks(tmp_path, world, steps, 2, "clean")
    for proc, _ in clean:
        assert proc.wait(120) == 0
    run = _ranks(tmp_path, world, steps, 2, "run")
    _wait_progress(run[0][1], 13, run[0][0])
    run[0][0].send_signal(signal.SIGTERM)
    assert [p.wait(60) for p, _ in run] == [PREEMPTED_EXIT_CODE] * world
    resumed = _ranks(tmp_path, world, steps, 2, "run")
    assert [p.wait(120) for p, _ in resumed] == [0] * world
    for r in range(world):
        _same(tmp_path / f"clean{r}.out", tmp_path / f"run{r}.out")


@pytest.mark.usefixtures("_keep_handlers")
def test_two_managers_closed_in_creation_order_leave_sigterm_fatal() -> None:
    """Two managers with save_on_preemption, closed A then B: B put back A's (closed) handler,
    which swallowed every later SIGTERM, so the process could no longer be terminated."""
    code = textwrap.dedent(
        """
        import os, signal, sys, tempfile, time
        from ckpt import CheckpointManager
        d = tempfile.mkdtemp()
        a = CheckpointManager(os.path.join(d, "a"), save_on_preemption=True)
        b = CheckpointManager(os.path.join(d, "b"), save_on_preemption=True)
        a.close()
        b.close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        sys.exit(3)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr


@pytest.mark.usefixtures("_keep_handlers")
def test_closed_preemption_forwards_to_the_handler_before_it() -> None:
    """A user handler chained over a closed Preemption still reaches the original handler, and
    the closed one records nothing."""
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        a = Preemption()
        b = Preemption()
        a.close()
        b.close()
        assert signal.getsignal(signal.SIGUSR1) is not None
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        assert a.signalled is None and b.signalled is None
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.usefixtures("_keep_handlers")
def test_notify_is_logged_as_a_local_notice(caplog: pytest.LogCaptureFixture) -> None:
    """``notify()`` (signum 0) was logged as 'another rank'; an unknown number raised."""
    p = Preemption()
    try:
        p.notify()
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert p.reached(7)
        assert "another rank" not in caplog.text
        q = Preemption()
        try:
            q.notify(12345)
            assert q.reached(1)
        finally:
            q.close()
    finally:
        p.close()


@pytest.mark.usefixtures("_keep_handlers")
def test_a_signal_that_cannot_be_handled_installs_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``signals=(SIGTERM, SIGKILL)``: SIGKILL cannot be caught, and the SIGTERM handler
    installed before it was left behind, owned by nobody, swallowing every later SIGTERM."""
    from ckpt import CheckpointManager
    from ckpt.preemption import PreemptionOptions

    before = signal.getsignal(signal.SIGTERM)
    options = PreemptionOptions(signals=(signal.SIGTERM, signal.SIGKILL))
    with pytest.raises((OSError, ValueError)):
        CheckpointManager(tmp_path, save_on_preemption=options)
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.usefixtures("_keep_handlers")
def test_save_and_exit_retried_after_a_failed_save_saves_again(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``save_and_exit`` skipped the save when ``step`` was the last step *asked* to be saved,
    even if that save had failed: a retry after 'disk full' exited 75, 'committed', with
    nothing saved."""
    import errno

    import torch

    from ckpt import CheckpointManager
    from ckpt import format as fmt
    from ckpt.errors import CheckpointError

    state = {"w": torch.zeros(2)}
    m = CheckpointManager(tmp_path, save_on_preemption=True)
    try:
        m.save(0, state)
        m.wait()
        real = fmt.write_file

        def full(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(fmt, "write_file", full)
        with pytest.raises(CheckpointError, match="No space left"):
            m.save_and_exit(1, state, timeout=10)
        assert m.steps() == [0]
        with pytest.raises(CheckpointError, match="No space left"):  # still full: no exit 75
            m.save_and_exit(1, state, timeout=10)
        monkeypatch.setattr(fmt, "write_file", real)
        with pytest.raises(SystemExit) as exited:
            m.save_and_exit(1, state, timeout=10)
        assert exited.value.code == CheckpointManager.PREEMPTED_EXIT_CODE
        assert m.steps() == [0, 1]
    finally:
        m.close()


@pytest.mark.usefixtures("_keep_handlers")
def test_a_signal_listed_twice_is_handled_once() -> None:
    """``signals=(SIGTERM, SIGTERM)`` chained our handler to itself: the signal raised
    ``RecursionError`` wherever the main thread was, and ``close()`` left the handler in."""
    from ckpt.preemption import PreemptionOptions

    before = signal.getsignal(signal.SIGTERM)
    p = Preemption(PreemptionOptions(signals=(signal.SIGTERM, signal.SIGTERM)))
    try:
        signal.raise_signal(signal.SIGTERM)
        assert p.signalled == signal.SIGTERM
    finally:
        p.close()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.usefixtures("_keep_handlers")
def test_an_infinite_deadline_is_refused_up_front() -> None:
    """``deadline_s=inf`` was accepted, then ``save_and_exit`` died of ``OverflowError`` in its
    wait, with the save still in flight."""
    from ckpt.preemption import PreemptionOptions

    with pytest.raises(ValueError, match="deadline_s"):
        PreemptionOptions(deadline_s=float("inf"))
    with pytest.raises(ValueError, match="deadline_s"):
        PreemptionOptions(deadline_s=float("nan"))


@pytest.mark.usefixtures("_keep_handlers")
def test_save_and_exit_refuses_an_infinite_timeout_before_saving(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from ckpt import CheckpointManager

    with CheckpointManager(tmp_path) as m:
        with pytest.raises(ValueError, match="timeout"):
            m.save_and_exit(0, {"w": torch.zeros(1)}, timeout=float("inf"))
        assert m.steps() == []
