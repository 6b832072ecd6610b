"""The run log of a checkpoint root: how many runs wrote it and how many ended in a failure.

``DIR/runs.json`` (written only by a manager with ``save_interval_steps="auto"``) holds the
count of runs, the failures seen, the seconds the runs were alive, the run now open and the
last measured costs of a save (``ckpt.interval``)::

    {"tool": "ckpt", "version": 1, "runs": 4, "failures": 1, "alive_s": 7260.5,
     "open": {"pid": 1234, "host": "node-3", "started": 1765000000.0, "alive_s": 12.0},
     "measured": {...}, "interval": {...}}

**How an unclean end is detected.** A run opens the log when it becomes the directory's writer
(under the writer lock, so one run at a time) and closes it in ``CheckpointManager.close``. A
run that finds the log still open was preceded by a run that never reached ``close``: a SIGKILL,
an OOM kill, a segfault, a power loss, ``os._exit``; that counts one failure. A Python exception
that leaves a ``with CheckpointManager(...)`` block counts one too (``fail`` before ``close``);
``SystemExit`` and ``KeyboardInterrupt`` are deliberate stops and do not. A preemption that
``save_and_exit`` handles is a clean end; one without ``save_on_preemption`` kills the process
and counts.

**Alive time.** Each commit records the run's seconds alive so far (``heartbeat``, not fsynced:
only a power loss can lose it, and then only the last update). A killed run's time after its
last commit is not counted, so the observed mean time between failures errs short: saves come
more often, never less.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt import _layout, _owner
from ckpt.errors import CheckpointError
from feedpipe.io import atomic_write
from feedpipe.io.reaper import pid_alive

__all__ = ["RunHistory", "RunLog"]

log = logging.getLogger("ckpt")

_LIMIT = 2**53  # counters and seconds: exact in a float, far beyond any real run


@dataclass(frozen=True)
class RunHistory:
    """What the log says: ``runs`` begun (this one included once open), ``failures`` seen,
    ``alive_s`` over the runs that ended (cleanly or not), ``measured`` costs (may be empty)."""

    runs: int = 0
    failures: int = 0
    alive_s: float = 0.0
    measured: dict[str, Any] | None = None


class RunLog:
    """Reads and writes ``root/runs.json`` (module docstring). ``begin`` under the writer lock;
    ``heartbeat`` from the persist thread; ``end`` from ``close``."""

    def __init__(self, root: Path) -> None:
        self.path = root / _layout.RUNS_FILE
        self._doc: dict[str, Any] | None = None
        self._t0 = 0.0
        self._failed = False

    @property
    def is_open(self) -> bool:
        """Whether this process opened the log (``begin``) and has not closed it yet."""
        return self._doc is not None

    def read(self) -> dict[str, Any]:
        """The log's contents (an empty log if there is none; ``CheckpointError`` naming the
        file if it is not ckpt's or is malformed)."""
        if not os.path.lexists(self.path):
            return {"tool": _owner.TOOL, "version": 1, "runs": 0, "failures": 0, "alive_s": 0.0}
        if not _owner.is_ours(self.path):
            raise CheckpointError(f"{self.path}: was not written by ckpt; move it away")
        try:
            doc = json.loads(self.path.read_bytes())
            _check(doc)
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: unreadable run log ({exc}); remove it") from exc
        return dict(doc)

    def history(self) -> RunHistory:
        """The history as of now: this run's alive time included while it is open; before
        ``begin``, a run left open whose process is gone (on this host) counts as the failure
        that ``begin`` will record."""
        doc = self._doc if self._doc is not None else self.read()
        alive, failures = float(doc["alive_s"]), int(doc["failures"])
        if self._doc is not None:
            alive += time.monotonic() - self._t0
        elif _dead(doc.get("open")):
            failures += 1
            alive += float(doc["open"].get("alive_s", 0.0))
        return RunHistory(int(doc["runs"]), failures, alive, doc.get("measured"))

    def begin(self, record: dict[str, Any]) -> RunHistory:
        """Open a run (call under the writer lock): a log left open by the previous run counts
        one failure. ``record``: the interval options to write down. Returns the history."""
        doc = self.read()
        previous = doc.get("open")
        if isinstance(previous, dict):
            doc["failures"] = int(doc["failures"]) + 1
            doc["alive_s"] = float(doc["alive_s"]) + float(previous.get("alive_s", 0.0))
            log.warning(
                "ckpt: the previous run in %s (pid %s) did not close its manager: counted as "
                "a failure (%d so far)",
                self.path.parent, previous.get("pid"), doc["failures"],
            )  # fmt: skip
        doc["runs"] = int(doc["runs"]) + 1
        doc["open"] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "alive_s": 0.0,
        }
        doc["interval"] = record
        self._t0 = time.monotonic()
        self._write(doc, durable=True)
        self._doc = doc
        return self.history()

    def heartbeat(self, measured: dict[str, Any]) -> None:
        """Record this run's time alive and the latest ``measured`` costs (not fsynced)."""
        doc = self._doc
        if doc is None:
            return
        doc["open"]["alive_s"] = time.monotonic() - self._t0
        doc["measured"] = measured
        self._write(doc, durable=False)

    def fail(self) -> None:
        """Make ``end`` record this run as a failure (an exception is leaving the run)."""
        self._failed = True

    def end(self, measured: dict[str, Any]) -> None:
        """Close the run: a clean end unless ``fail`` was called."""
        doc = self._doc
        if doc is None:
            return
        doc["alive_s"] = float(doc["alive_s"]) + time.monotonic() - self._t0
        doc["failures"] = int(doc["failures"]) + int(self._failed)
        doc["open"] = None
        doc["measured"] = measured
        self._write(doc, durable=True)
        self._doc = None

    def _write(self, doc: dict[str, Any], durable: bool) -> None:
        atomic_write(
            self.path,
            json.dumps(doc, sort_keys=True, allow_nan=False).encode() + b"\n",
            durable=durable,
        )


def _dead(run: Any) -> bool:
    """Whether ``run`` (a log's ``open`` entry) is a process of this host that is gone; a run of
    another host is taken as gone too (its host holds no lock of this one's)."""
    if not isinstance(run, dict):
        return False
    pid = run.get("pid")
    if run.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    return pid != os.getpid() and not pid_alive(pid)


def _check(doc: Any) -> None:
    """``ValueError`` unless ``doc`` has the log's counters."""
    if not isinstance(doc, dict) or doc.get("tool") != _owner.TOOL:
        raise ValueError("not a ckpt run log")
    for key, kind in (("runs", int), ("failures", int), ("alive_s", (int, float))):
        _counter(doc.get(key), key, kind)
    run = doc.get("open")
    if run is not None:
        if not isinstance(run, dict):
            raise ValueError(f"'open' is {run!r:.40}")
        _counter(run.get("alive_s", 0.0), "open.alive_s", (int, float))


def _counter(value: Any, key: str, kind: type | tuple[type, ...]) -> None:
    """``ValueError`` unless ``value`` is a number of ``kind`` in ``[0, 2**53)``: JSON's ``NaN``
    and ``Infinity`` would make the MTBF NaN or infinite (an interval of ``max_steps``), and a
    larger int cannot be divided as a float (``OverflowError`` in ``should_save``)."""
    number = isinstance(value, (int, float)) and isinstance(value, kind)
    if isinstance(value, bool) or not number or not 0 <= value < _LIMIT:
        raise ValueError(f"{key!r} is {value!r:.40}")
