"""A tiny progress-bar helper over tqdm, shared by the CLI commands.

``progress(total, desc, unit="B")`` returns a tqdm bar on stderr, or a no-op bar when ``enabled``
is False, or when it is None (the default) and stderr is not a terminal: a bar is never drawn
into a log file or a pipe. Byte bars count in binary units (KiB, MiB/s), the unit every feedpipe
summary uses.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

__all__ = ["NullBar", "progress"]


class NullBar:
    """Stands in for a tqdm bar when progress is switched off."""

    n = 0

    def update(self, n: float = 1) -> None:
        self.n += n  # type: ignore[assignment]

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        return None

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> NullBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


def progress(
    total: float | None, desc: str, *, unit: str = "B", enabled: bool | None = None
) -> Any:
    """A tqdm bar (bytes scale to KiB/MiB/GiB), or a :class:`NullBar` when disabled."""
    if enabled is None:
        enabled = _is_terminal(sys.stderr)
    if not enabled:
        return NullBar()
    from tqdm.auto import tqdm

    binary = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit="iB" if binary else unit,  # with unit_divisor=1024: "KiB", "MiB/s"
        unit_scale=binary,
        unit_divisor=1024 if binary else 1000,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=True,
    )


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
