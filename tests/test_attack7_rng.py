"""Thread workers' reads of the global RNG states (feedpipe/loader/thread_rng.py) cannot hang
the process: a garbage collection inside one reader's ``torch.get_rng_state`` (its mutex held)
whose finalizer lets the GIL go, while another thread calls torch's generator holding the GIL,
was a deadlock (the CI hang). Each case runs in a child process with a timeout (a hang fails,
never hangs the suite); the choreography is made by events and a 5 s switch interval, no sleep:
without the reader lock the "worker" case hangs every time, without the collector off inside
the reader the "torch" and "feedpipe" cases do (checked by hand on 8841c80~1 and 8841c80)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(__file__).resolve().parent / "_attack7_rng_hang.py"


@pytest.mark.parametrize("waiter", ["worker", "torch", "feedpipe"])
def test_no_hang_when_a_finalizer_lets_the_gil_go_inside_a_read(waiter: str) -> None:
    """The other thread is a second thread worker, the training loop's ``torch.get_rng_state``
    or the loader's state of the global RNG: no hang, and no collection ran inside a thread
    worker's read of torch's state (the collector is off while it holds the mutex)."""
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    try:
        done = subprocess.run(
            [sys.executable, str(_SCRIPT), waiter],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{waiter}: the reads deadlocked (no exit in {exc.timeout} s)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "False", "False"], done.stdout
