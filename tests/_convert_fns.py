"""Functions for tests/test_convert_fn.py: importable by worker processes and ``--fn``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np


def tokens(item: Any) -> Iterator[dict[str, Any]]:
    """``item % 5`` records of 16 int32 tokens (none for multiples of 5: filtered)."""
    item = int(item)  # from the CLI, inputs are strings
    rng = np.random.default_rng(item)
    for j in range(item % 5):
        yield {"data": rng.integers(0, 50_000, 16, dtype=np.int32), "doc": item * 10 + j}


def blobs(item: Any) -> list[bytes]:
    """Variable-length bytes records."""
    item = int(item)
    return [bytes([item % 256]) * (item % 7 + j) for j in range(2)]


def slow_tokens(item: Any) -> Iterator[dict[str, Any]]:
    """``tokens``, slowly (a crash test kills the run in the middle)."""
    time.sleep(float(os.environ.get("FEEDPIPE_TEST_SLEEP", "0.02")))
    yield from tokens(item)


def shape_changes(item: int) -> np.ndarray:
    """Records whose shape changes at input 8."""
    return np.zeros(4 if item < 8 else 5, np.float32)


def fails_on_13(item: int) -> np.ndarray:
    if item == 13:
        raise ValueError("bad input")
    return np.full(3, item, np.int64)


def fails_from_env(item: Any) -> Iterator[dict[str, Any]]:
    """``tokens``, failing on inputs >= $FEEDPIPE_TEST_FAIL_AT (unset: never)."""
    if int(item) >= int(os.environ.get("FEEDPIPE_TEST_FAIL_AT", "1000000")):
        raise RuntimeError("injected failure")
    yield from tokens(item)


def hangs_on_0_fails_on_1(item: int) -> np.ndarray:
    """Input 0 never returns (a stuck read); input 1 fails a moment later."""
    if item == 0:
        time.sleep(1e9)
    if item == 1:
        time.sleep(0.5)
        raise ValueError("bad input 1")
    return np.full(3, item, np.int64)


def dies_on_7(item: Any) -> np.ndarray:
    """The worker process dies on input 7 (as a crash in native code or the OOM killer would)."""
    if int(item) == 7:
        os._exit(3)
    return np.full(3, int(item), np.int64)


def dies_on_3_others_slow(item: Any) -> np.ndarray:
    """Input 3's worker dies at once while the other workers are inside slow inputs."""
    if int(item) == 3:
        os._exit(3)
    time.sleep(0.4)
    return np.full(3, int(item), np.int64)


def scalars(item: Any) -> Iterator[dict[str, Any]]:
    """``item % 4`` records of scalar fields only: no ``data`` key, no variable-length field."""
    item = int(item)
    for j in range(item % 4):
        yield {"doc": item * 10 + j, "score": np.float32(item + j / 4)}


def scalars_failing_from_env(item: Any) -> Iterator[dict[str, Any]]:
    """``scalars``, failing on inputs >= $FEEDPIPE_TEST_FAIL_AT (unset: never)."""
    if int(item) >= int(os.environ.get("FEEDPIPE_TEST_FAIL_AT", "1000000")):
        raise RuntimeError("injected failure")
    yield from scalars(item)
