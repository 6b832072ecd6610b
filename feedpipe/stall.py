"""Stall counters: how long the training loop waited for input, and which stage is to blame.

This file starts with the minimal interface the loader calls; the stall-counters work extends it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

__all__ = ["StallMeter"]


class StallMeter:
    """Thread-safe, always-on counters shared by one or more loaders.

    Interface used by the loader (keep it stable):
      - ``wait_begin()`` / ``wait_end(samples=0, nbytes=0)`` around the blocking part of ``next()``
      - ``add_stage(name, seconds, nbytes=0)`` from any thread, for per-stage times
        ("fetch", "decode", "collate", "pin", "h2d"); process workers ship their stage times
        back with each batch and the main process adds them.
      - ``set_depth(name, n)`` for queue depths.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wait_start: float | None = None
        self._last_end: float | None = None
        self.stall_s = 0.0
        self.step_s = 0.0
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.stage_s: dict[str, float] = defaultdict(float)
        self.stage_bytes: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = {}

    def wait_begin(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self.step_s += now - self._last_end
        self._wait_start = now

    def wait_end(self, samples: int = 0, nbytes: int = 0) -> None:
        now = time.perf_counter()
        if self._wait_start is not None:
            self.stall_s += now - self._wait_start
        self._wait_start = None
        self._last_end = now
        self.batches += 1
        self.samples += samples
        self.bytes += nbytes

    def add_stage(self, name: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.stage_s[name] += seconds
            self.stage_bytes[name] += nbytes

    def set_depth(self, name: str, n: int) -> None:
        self.depth[name] = n
