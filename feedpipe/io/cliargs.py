"""Argument types for the ``feedpipe`` and ``ckpt`` commands: a number that means nothing is an
argparse error (usage line, exit status 2), never a traceback or a silent default.

Each function is an argparse ``type=``: it takes the argument's text and returns the value or
raises ``argparse.ArgumentTypeError`` saying what is expected. Standard library only.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["byte_size", "milliseconds", "non_negative_int", "positive_int"]

_DAY_MS = 86_400_000
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _integer(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--workers``, ``--batch-size``)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (a count of rows to print, batches to drop)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def milliseconds(text: str) -> float:
    """A time in milliseconds: finite, 0 to one day (``nan``, ``inf``, ``-5`` and ``1e308``,
    which no sleep can take, are refused)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of milliseconds, got {text!r}"
        ) from None
    if not 0 <= value <= _DAY_MS:  # False for nan
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds from 0 to {_DAY_MS} (a day), got {text!r}"
        )
    return value


def byte_size(text: str) -> int:
    """A finite, positive size in bytes: ``1048576``, ``64KiB``, ``256MiB``, ``1.5G``, ``2TB``
    (binary units; ``B``, ``iB`` and case are optional)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 256MiB, 64KiB or 1048576, got {text!r}"
        ) from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a finite size of at least 1 byte, got {text!r}")
    return int(value)
