"""``Source``: what ``feedpipe convert`` reads records from (its kinds:
:mod:`feedpipe.datasets.convert_sources`, :mod:`~feedpipe.datasets.tables`,
:mod:`~feedpipe.datasets.tar_source`). A source is picklable: the parts of a conversion read it
in worker processes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Source"]


class Source:
    """A picklable record source: layout, side fields, and records by range."""

    kind = ""
    shape: tuple[int | None, ...] | None = None  # None: bytes layout; (None, ...): ragged
    dtype = "uint8"
    records = True  # False: no records column (dict samples without "data")
    fields: dict[str, Any]
    extra: dict[str, Any]
    length = 0
    est_bytes = 0

    def fingerprint(self) -> Any:
        raise NotImplementedError

    def read(self, a: int, b: int) -> tuple[Any, dict[str, Any]]:
        """Records ``a..b-1``: an array (fixed) or a list of bytes or arrays, plus the side-field
        columns (arrays, or lists for variable-length fields)."""
        raise NotImplementedError
