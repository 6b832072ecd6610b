"""A tiny progress-bar helper over tqdm, shared by the CLI commands.

``progress(total, desc, unit="B")`` returns a tqdm bar, or a no-op bar when ``enabled`` is False
(tqdm itself disables the bar when stderr is not a terminal if ``enabled`` is None).
"""

from __future__ import annotations

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
    """A tqdm bar (byte units scale to kB/MB/GB), or a :class:`NullBar` when disabled."""
    if enabled is False:
        return NullBar()
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
        leave=True,
    )
