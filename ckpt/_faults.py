"""Test-only fault points.

- ``CKPT_TEST_PAUSE="write:0.05,fsync:0.02"`` sleeps a random time up to the given seconds at each
  named point (``pause``), so crash tests can land a SIGKILL inside every phase.
- ``CKPT_TEST_KILL_AFTER=k`` SIGKILLs the process right after the k-th filesystem operation of the
  commit protocol (``fs_op``: every mkdir, rename, exchange, unlink, removal and directory fsync),
  so a test can kill between every pair of operations.
- ``CKPT_TEST_NO_EXCHANGE=1`` makes ``renameat2(RENAME_EXCHANGE)`` look unsupported, so the
  fallback protocol is tested on a filesystem that has it.

The environment is read on use, never at import. Unset, a call costs a dict lookup or two.
"""

from __future__ import annotations

import os
import random
import signal
import time

from feedpipe.io.env import env_flag

__all__ = ["exchange_allowed", "fs_op", "pause"]

_points: dict[str, float] | None = None
_ops = 0


def _load() -> dict[str, float]:
    spec = os.environ.get("CKPT_TEST_PAUSE", "")
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, seconds = part.partition(":")
        out[name] = float(seconds or 0.01)
    return out


def pause(point: str) -> None:
    """Sleep up to the configured time at ``point`` (no-op unless ``CKPT_TEST_PAUSE`` names it)."""
    global _points
    if _points is None:
        _points = _load()
    limit = _points.get(point)
    if limit:
        time.sleep(random.uniform(0.0, limit))


def fs_op(what: str) -> None:
    """Count one filesystem operation (``what`` names it); SIGKILL the process right after the
    ``CKPT_TEST_KILL_AFTER``-th one."""
    global _ops
    limit = os.environ.get("CKPT_TEST_KILL_AFTER")
    if not limit:
        return
    _ops += 1
    trace = os.environ.get("CKPT_TEST_OP_TRACE")
    if trace:  # the harness learns what the k-th operation was
        with open(trace, "a") as f:
            f.write(f"{_ops} {what}\n")
    if _ops >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


def exchange_allowed() -> bool:
    """Whether ``renameat2(RENAME_EXCHANGE)`` may be used (tests can force the fallback)."""
    return not env_flag("CKPT_TEST_NO_EXCHANGE")
