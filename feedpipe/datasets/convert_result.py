"""``ConvertResult``: what a conversion produced, shared by ``convert`` and ``convert(fn)``.

It lives below both (:mod:`feedpipe.datasets.convert` dispatches to
:mod:`feedpipe.datasets.convert_fn`, which returns one too), so neither imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass

from feedpipe.format import Index

__all__ = ["ConvertResult"]


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion produced."""

    path: str
    records: int
    bytes: int
    shards: int
    seconds: float
    resumed_parts: int

    @classmethod
    def of(cls, path: str, index: Index, seconds: float, resumed_parts: int) -> ConvertResult:
        """The result of a conversion that wrote ``index`` at ``path``."""
        return cls(
            path, index.num_records, index.total_bytes, len(index.shards), seconds, resumed_parts
        )

    def summary(self) -> str:
        mib = self.bytes / (1 << 20)
        rate = mib / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"{self.path}: {self.records} records, {mib:.1f} MiB in {self.shards} shards, "
            f"{self.seconds:.1f} s ({rate:.0f} MiB/s)"
            + (f", {self.resumed_parts} parts resumed" if self.resumed_parts else "")
        )
