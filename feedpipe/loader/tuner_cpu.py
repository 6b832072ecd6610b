"""``ProcessCPU``: the CPU time of one loader's worker processes, read per process.

``getrusage(RUSAGE_CHILDREN)`` counts every child this process reaped (another loader's
workers, a validation loader's, any ``subprocess.run``), and only once reaped; so the tuner
reads each of *its own* live workers instead: on Linux ``/proc/<pid>/stat`` (user + system
time of all the worker's threads, and of the children it reaped, in clock ticks of
``os.sysconf("SC_CLK_TCK")``). A worker is known by its pid and its start time, so a pid the
OS reuses for another process is never read as the old worker's, nor, within a pass (the
start time of each watched pid is the one first read), as a worker at all.

A non-persistent worker exits at the end of its pass, before the loop sees the pass end: the
last reading of each worker is kept (:meth:`ProcessCPU.sample`, which the tuner takes after a
delivery at most every ``Tuner.sample_s``), so its CPU up to that reading still counts once it
is gone.

Where ``/proc`` is missing (macOS, Windows), nothing is read (:attr:`ProcessCPU.available` is
False): the tuner then takes the workers' busy time as their CPU (an upper bound: busy time
includes waiting on I/O), and never another process's CPU.
"""

from __future__ import annotations

import os
from collections.abc import Collection

__all__ = ["ProcessCPU", "WorkerKey", "cpu_between", "read_stat"]

#: a worker process: (pid, start time in clock ticks since boot)
WorkerKey = tuple[int, int]

_PROC = "/proc"


def _ticks_per_s() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 100.0


def read_stat(pid: int, root: str = _PROC) -> tuple[WorkerKey, float] | None:
    """``((pid, start time), CPU seconds)`` of process ``pid`` from ``<root>/<pid>/stat``: its
    user and system time and its reaped children's; None where it is gone or unreadable."""
    try:
        with open(f"{root}/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # the name (field 2) is in parentheses and may hold spaces or ')': split after the last
    fields = text[text.rfind(b")") + 2 :].split()
    try:  # fields 14-17 (utime, stime, cutime, cstime) and 22 (starttime), counted from 1
        ticks = sum(int(v) for v in fields[11:15])
        start = int(fields[19])
    except (IndexError, ValueError):
        return None
    return (pid, start), ticks / _ticks_per_s()


class ProcessCPU:
    """The CPU seconds of the worker processes :meth:`watch` names, the last reading of each
    kept after it exits (module docstring)."""

    def __init__(self, root: str = _PROC) -> None:
        self._root = root
        self.available = os.path.isdir(f"{root}/self")
        self._pids: tuple[int, ...] = ()
        self._seen: dict[WorkerKey, float] = {}
        self._start: dict[int, int] = {}  # each watched pid's start time, at its first reading

    @property
    def pids(self) -> tuple[int, ...]:
        """The worker processes of the pass in progress."""
        return self._pids

    def watch(self, pids: Collection[int]) -> None:
        """The worker processes of a new pass (those of earlier passes are forgotten once a
        reading no longer needs them: :meth:`snapshot` reads only the watched)."""
        self._pids = tuple(pids)
        self._start = {}
        self.sample()

    def sample(self) -> None:
        """Read each watched worker's CPU now; one that is gone keeps its last reading."""
        if not self.available:
            return
        seen = {}
        for pid in self._pids:
            got = read_stat(pid, self._root)
            # a pid the OS gave another process since (another start time) is not this worker
            if got is not None and self._start.setdefault(pid, got[0][1]) == got[0][1]:
                seen[got[0]] = got[1]
        # keep the last reading of the watched workers that are gone; drop older passes' (and
        # a gone worker whose pid a new one of this pass took)
        keep = {k: v for k, v in self._seen.items() if self._start.get(k[0]) == k[1]}
        self._seen = {**keep, **seen}

    def snapshot(self) -> dict[WorkerKey, float] | None:
        """A reading now, per worker (None where the OS does not tell)."""
        if not self.available:
            return None
        self.sample()
        return dict(self._seen)


def cpu_between(
    new: dict[WorkerKey, float] | None, old: dict[WorkerKey, float] | None
) -> float | None:
    """CPU seconds the workers of ``new`` ran since ``old`` (a worker absent from ``old``
    started since: it counts from zero); None where either reading is unknown or ``new``
    holds no worker."""
    if new is None or old is None or not new:
        return None
    return sum(v - old.get(k, 0.0) for k, v in new.items())
