"""Adversarial tests of ckpt's retention policies and preemption handling (issue 20, 1-2)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ckpt import format as fmt
from ckpt.preemption import Preemption


@pytest.fixture(autouse=True)
def _keep_handlers():  # type: ignore[no-untyped-def]
    """Each test leaves SIGTERM/SIGUSR1 as it found them: a ``save_and_exit`` whose
    ``SystemExit`` a test catches leaves its exiting handler installed (ckpt.preemption)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_metric_name_with_trailing_newline_is_rejected() -> None:
    """``$`` in the name pattern matched before a trailing newline: ``"loss\\n"`` passed."""
    with pytest.raises(ValueError, match="bad metric name"):
        fmt.check_metrics({"loss\n": 1.0})


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


def test_save_on_steps_takes_numpy_integers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``save_on_steps=np.arange(...)`` (a careless but natural spelling) was refused."""
    np = pytest.importorskip("numpy")
    from ckpt import CheckpointManager

    with CheckpointManager(
        tmp_path, save_on_steps=np.array([5, 5, 20]), save_interval_steps=np.int64(7)
    ) as manager:
        assert [s for s in range(25) if manager.should_save(s)] == [0, 5, 7, 14, 20, 21]
    with pytest.raises(ValueError, match="save_on_steps"):
        CheckpointManager(tmp_path, save_on_steps=[np.int64(-1)])
    with pytest.raises(ValueError, match="save_on_steps"):
        CheckpointManager(tmp_path, save_on_steps=[1.5])


def test_a_transient_read_error_does_not_unrank_the_best_step(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An ``OSError`` reading the best step's manifest (EIO, EMFILE) made it 'unranked', and
    the same retention pass deleted it: the remote tier stops the pass instead, so must this."""
    import errno

    import torch

    from ckpt import CheckpointManager
    from ckpt.retention import checks as _retention

    state = {"w": torch.zeros(2)}
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 1, "min")) as m:
        for step, loss in [(0, 0.1), (1, 0.5), (2, 0.9), (3, 0.8)]:
            m.save(step, state, metrics={"loss": loss})
            m.wait()
        assert m.steps() == [0, 3]
    real = _retention.metrics

    def flaky(path):  # type: ignore[no-untyped-def]
        if path.name.endswith("0"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(_retention, "metrics", flaky)
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 1, "min")) as m:
        with pytest.raises(OSError):
            m.gc()
        assert m.steps() == [0, 3]
    monkeypatch.setattr(_retention, "metrics", real)
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 1, "min")) as m:
        assert m.gc() == [] and m.steps() == [0, 3]


def test_keep_best_ranks_large_int_metrics_exactly() -> None:
    """Int metrics (up to 2**63 are accepted) were ranked as floats: 2**62 and 2**62 + 1 tied,
    so "max" kept the newer, smaller one."""
    from ckpt.policy import KeepBest, StepView

    saved = {0: {"n": 2**62 + 1}, 1: {"n": 2**62}}
    view = StepView(saved, lambda s: True, lambda s: saved[s])
    assert list(KeepBest("n", 1, "max").select(view)) == [0]
    assert list(KeepBest("n", 1, "min").select(view)) == [1]


def test_close_after_a_failed_save_still_stops_the_remote_tier(tmp_path, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    """``close()`` re-raises a background save's error; it skipped ``remote.close()`` then,
    leaving the upload thread running (and applying remote retention) after the writer lock
    was released to the next manager."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.errors import CheckpointError
    from ckpt.remote import RemoteOptions

    bucket, options = s3_bucket
    remote = RemoteOptions(f"s3://{bucket}/close", storage_options=options)
    before = signal.getsignal(signal.SIGTERM)
    m = CheckpointManager(tmp_path, remote=remote, save_on_preemption=True)

    def boom(step, path):  # type: ignore[no-untyped-def]
        raise RuntimeError("listener failed")

    m.on_commit.append(boom)
    m.save(0, {"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="listener failed"):
        m.close()
    assert m.remote is not None and m.remote.closed
    assert signal.getsignal(signal.SIGTERM) == before
    assert not m._lock.held


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


@pytest.mark.parametrize("spec", ["loss:0:min", "loss:\u00b2:min", "loss:-1:max"])
def test_gc_bad_keep_best_names_the_flag(tmp_path, capsys, spec: str) -> None:  # type: ignore[no-untyped-def]
    """``--keep-best loss:0:min`` was refused as 'KeepBest.k ...', and a Unicode digit ('²',
    which ``str.isdigit`` accepts) as 'invalid literal for int()': neither named the flag."""
    from ckpt import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["gc", str(tmp_path), "--keep-best", spec])
    assert exited.value.code == 2
    assert "--keep-best" in capsys.readouterr().err


def test_a_transient_error_verifying_a_keep_every_step_does_not_delete_it(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch
) -> None:
    import errno

    import torch

    from ckpt import CheckpointManager
    from ckpt.restoring import reader as _reader

    state = {"w": torch.zeros(2)}
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for step in (0, 5, 10, 11, 12):
            m.save(step, state)
        m.wait()
    real = _reader.verify_step

    def flaky(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path.name == "step-10":
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_reader, "verify_step", flaky)
    with CheckpointManager(tmp_path, keep_last=1, keep_every=10) as m:  # its pass only warns
        with pytest.raises(OSError, match="Too many open files"):
            m.gc()  # an explicit gc says why it stopped
        assert 10 in m.steps()
        m.save(13, state)
        m.wait()  # retention after a save skips the pass too; the save itself is fine
        assert 10 in m.steps() and 13 in m.steps()


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


def test_an_infinite_deadline_is_refused_up_front() -> None:
    """``deadline_s=inf`` was accepted, then ``save_and_exit`` died of ``OverflowError`` in its
    wait, with the save still in flight."""
    from ckpt.preemption import PreemptionOptions

    with pytest.raises(ValueError, match="deadline_s"):
        PreemptionOptions(deadline_s=float("inf"))
    with pytest.raises(ValueError, match="deadline_s"):
        PreemptionOptions(deadline_s=float("nan"))


def test_save_and_exit_refuses_an_infinite_timeout_before_saving(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from ckpt import CheckpointManager

    with CheckpointManager(tmp_path) as m:
        with pytest.raises(ValueError, match="timeout"):
            m.save_and_exit(0, {"w": torch.zeros(1)}, timeout=float("inf"))
        assert m.steps() == []
