"""Run a function in a child forked while another thread of this process holds a lock, and
tell a hang (no answer in time) from an answer: the attack10 tests' one fork harness."""

from __future__ import annotations

import multiprocessing as mp
import threading
import warnings
from collections.abc import Callable
from typing import Any

HANG = "hang"


def _run(target: Callable[[], object], conn: Any) -> None:
    try:
        conn.send(("ok", target()))
    except BaseException as exc:  # the child's error comes back, named
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def in_child(target: Callable[[], object], timeout: float = 60.0) -> tuple[str, object]:
    """``target()`` in a forked child: ``("ok", value)``, ``("error", text)`` or ``(HANG, None)``
    when no answer came within ``timeout`` (the child is killed)."""
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():  # "multi-threaded, use of fork() may lead to deadlocks"
        warnings.simplefilter("ignore", DeprecationWarning)
        p = ctx.Process(target=_run, args=(target, there))
        p.start()
    there.close()
    try:
        if not here.poll(timeout):
            return HANG, None
        got: tuple[str, object] = here.recv()
        return got
    except EOFError:
        return "error", f"the child died (exit code {p.join(10) or p.exitcode})"
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
        here.close()


def fork_while_held(
    enter: Callable[[], Any], target: Callable[[], object], timeout: float = 60.0
) -> tuple[str, object]:
    """:func:`in_child` while another thread is inside ``with enter():``."""
    got, release = threading.Event(), threading.Event()

    def hold() -> None:
        with enter():
            got.set()
            release.wait(120)

    t = threading.Thread(target=hold)
    t.start()
    assert got.wait(30), "the holding thread never got the lock"
    try:
        return in_child(target, timeout)
    finally:
        release.set()
        t.join(30)
