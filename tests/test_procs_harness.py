"""The kill harness of tests/_procs.py: a child left running is SIGKILLed and reaped on the way
out, markers are read, a stop returns the exit status, report lines parse."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from _procs import alive, child_env, key_lines, python_child, read_marker, stop

_CHILD = "import time; print('ready', flush=True); time.sleep(60)"


def test_a_child_left_running_is_killed_and_reaped() -> None:
    with python_child(code=_CHILD) as proc:
        read_marker(proc, "ready")
        pid = proc.pid
    assert proc.returncode == -signal.SIGKILL and alive([pid]) == []


def test_stop_returns_the_exit_status() -> None:
    with python_child(code=_CHILD) as proc:
        read_marker(proc, "ready")
        assert stop(proc, signal.SIGTERM) == -signal.SIGTERM


def test_a_wrong_marker_fails_and_still_reaps() -> None:
    with pytest.raises(AssertionError, match="waited for 'go'"), python_child(code=_CHILD) as p:
        read_marker(p, "go")
    assert p.returncode == -signal.SIGKILL


def test_child_env_puts_this_checkout_and_tests_on_the_path() -> None:
    env = child_env(EXTRA="1")
    here = Path(__file__).resolve().parent
    assert env["EXTRA"] == "1"
    assert {str(here), str(here.parent)} <= set(env["PYTHONPATH"].split(os.pathsep))


def test_key_lines() -> None:
    assert key_lines("WORKERS 1 2\nAFTER\nRAISED x y\n") == {
        "WORKERS": "1 2",
        "AFTER": "",
        "RAISED": "x y",
    }
