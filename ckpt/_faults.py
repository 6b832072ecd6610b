"""Test-only pause points: ``CKPT_TEST_PAUSE="write:0.05,fsync:0.02"`` sleeps a random time up to
the given seconds at each named point, so crash tests can land a SIGKILL inside every phase.

The environment is read on the first call, never at import. Unset, a call costs one dict lookup.
"""

from __future__ import annotations

import os
import random
import time

__all__ = ["pause"]

_points: dict[str, float] | None = None


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
