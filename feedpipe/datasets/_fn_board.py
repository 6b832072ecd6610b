"""Which input each ``convert(fn)`` pool worker is converting, so that the error of a worker
that died (killed, out of memory, a crash in native code) names the input it was on.

One ``(pid, input number)`` pair per worker in shared memory, written with no system call and
no wait (a worker killed at any instant leaves its last input there), read by the parent.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from feedpipe.datasets._fn_task import Task, describe_input, fn_name
from feedpipe.errors import DatasetError
from feedpipe.io.reaper import pid_alive

__all__ = ["POOL_END_S", "WorkerBoard", "post", "take_seat"]

POOL_END_S = 2.0  # how long a broken pool's error waits for the pool to end its workers
_SEAT: Any = None  # a pool worker's (board, index) where it posts its current input number


def take_seat(board: Any, seats: Any) -> None:
    """In a pool worker's start: claim the next free pair of ``board``."""
    global _SEAT
    with seats.get_lock():
        seat = seats.value
        seats.value += 1
    board[2 * seat] = os.getpid()
    _SEAT = (board, 2 * seat + 1)


def post(number: int) -> None:
    """In a pool worker: it now converts input ``number`` (a no-op outside a pool)."""
    if _SEAT is not None:
        _SEAT[0][_SEAT[1]] = number


class WorkerBoard:
    """The parent's side: the shared pairs, and the error for a pool broken by a dead worker."""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.board = ctx.Array("q", [-1] * (2 * workers), lock=False)
        self.seats = ctx.Value("i", 0)

    def seat_args(self) -> tuple[Any, Any]:
        """What a worker's initializer passes to :func:`take_seat`."""
        return (self.board, self.seats)

    def error(
        self, fn: Callable[[Any], Any], tasks: Sequence[Task], procs: Sequence[Any] = ()
    ) -> DatasetError:
        """The error for a pool broken by a worker that died: it names the function and the
        input(s) that worker was on (see :meth:`culprits`)."""
        shown = [describe_input(tasks, n) for n in sorted(self.culprits(procs))]
        return DatasetError(
            f"{fn_name(fn)}: a worker process died (killed, out of memory or crashed) while "
            f"converting {' or '.join(shown or ['an unknown input'])}; nothing was published"
        )

    def culprits(self, procs: Sequence[Any] = ()) -> list[int]:
        """The inputs of the workers that died. The pool ends its other workers with SIGTERM
        once one dies: those (``procs`` tells their exit codes, after a bounded wait for them
        to end) are not named when another worker died otherwise. None dead: every input in
        flight."""
        codes = _exit_codes(procs)
        posted = self._posted()
        dead = {pid: n for pid, n in posted.items() if not pid_alive(pid)}
        ended = (None, -signal.SIGTERM)  # the pool's own SIGTERM, or unknown
        numbers = [n for pid, n in dead.items() if codes.get(pid) not in ended]
        return numbers or list(dead.values()) or list(posted.values())

    def _posted(self) -> dict[int, int]:
        """pid -> input number, of the workers that posted one."""
        pairs = {int(self.board[i]): int(self.board[i + 1]) for i in range(0, len(self.board), 2)}
        return {pid: n for pid, n in pairs.items() if pid > 0 and n >= 0}


def _exit_codes(procs: Sequence[Any]) -> dict[int, int | None]:
    end = time.monotonic() + POOL_END_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    return {p.pid: p.exitcode for p in procs}
