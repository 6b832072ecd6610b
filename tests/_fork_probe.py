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


def in_child(
    target: Callable[[], object],
    timeout: float = 60.0,
    started: Callable[[], object] | None = None,
) -> tuple[str, object]:
    """``target()`` in a forked child: ``("ok", value)``, ``("error", text)`` or ``(HANG, None)``
    when no answer came within ``timeout`` (the child is killed); ``started()`` runs in this
    process once the child is forked."""
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():  # "multi-threaded, use of fork() may lead to deadlocks"
        warnings.simplefilter("ignore", DeprecationWarning)
        p = ctx.Process(target=_run, args=(target, there))
        p.start()
    there.close()
    if started is not None:
        started()
    try:
        if not here.poll(timeout):
            return HANG, None
        got: tuple[str, object] = here.recv()
        return got
    except EOFError:
        p.join(10)
        return "error", f"the child died (exit code {p.exitcode})"
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
        here.close()


def fork_while_held(
    enter: Callable[[], Any], target: Callable[[], object], timeout: float = 60.0
) -> tuple[str, object]:
    """:func:`in_child` while another thread is inside ``with enter():``."""

    def hold(pause: Callable[[], None]) -> None:
        with enter():
            pause()

    return fork_during(hold, target, timeout)


def fork_during(
    hold: Callable[[Callable[[], None]], object],
    target: Callable[[], object],
    timeout: float = 60.0,
    go_on_at_fork: bool = False,
) -> tuple[str, object]:
    """:func:`in_child` while another thread runs ``hold(pause)`` and is inside ``pause()``
    (called where the fork should find it: inside a lock, a read, a download); with
    ``go_on_at_fork`` that thread goes on once the child is forked (the child may wait for it
    across processes, as for a download the parent finishes), else once the child answered."""
    got, release = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def pause() -> None:
        got.set()
        release.wait(120)

    def run() -> None:
        try:
            hold(pause)
        except BaseException as exc:  # told to the test, not lost in the thread
            failed.append(exc)
            got.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert got.wait(30), "the other thread never got where the fork should find it"
        if failed:
            raise failed[0]
        return in_child(target, timeout, release.set if go_on_at_fork else None)
    finally:
        release.set()
        t.join(30)
