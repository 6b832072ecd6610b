"""Arguments of the ``feedpipe`` and ``ckpt`` commands: a number that means nothing is an
argparse error (usage line, exit status 2), never a traceback or a silent default.

The types (``positive_int`` ...) are argparse ``type=``: each takes the argument's text and
returns the value or raises ``argparse.ArgumentTypeError`` saying what is expected.
:func:`add_storage_arguments` and :func:`storage_options` are the one ``--endpoint-url``
(and ``--anon``) option group and the fsspec options it makes; :func:`format_bytes` is the one
way a command prints a size. Standard library only.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = [
    "ENDPOINT_HELP",
    "add_storage_arguments",
    "byte_size",
    "format_bytes",
    "milliseconds",
    "non_negative_int",
    "positive_int",
    "storage_options",
]

#: The help of ``--endpoint-url`` unless a command words it for its own argument.
ENDPOINT_HELP = "S3-compatible endpoint (e.g. a MinIO or local server)"

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


def add_storage_arguments(
    parser: argparse.ArgumentParser, *, endpoint_help: str = ENDPOINT_HELP, anon: bool = False
) -> None:
    """``--endpoint-url`` (and, with ``anon``, ``--anon``): the options a command passes to fsspec
    for a URL (:func:`storage_options`)."""
    parser.add_argument("--endpoint-url", default=None, help=endpoint_help)
    if anon:
        parser.add_argument("--anon", action="store_true", help="anonymous (unsigned) S3 access")


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The fsspec ``storage_options`` of :func:`add_storage_arguments`' options (``{}``: none)."""
    options: dict[str, Any] = {}
    if getattr(args, "endpoint_url", None):
        options["client_kwargs"] = {"endpoint_url": args.endpoint_url}
    if getattr(args, "anon", False):
        options["anon"] = True
    return options


def format_bytes(n: float, largest: str = "TiB") -> str:
    """``n`` bytes as text: ``512 B``, ``1.5 KiB``, ... up to the unit ``largest``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == largest:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover - largest is one of the units
