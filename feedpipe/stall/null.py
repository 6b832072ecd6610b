"""The meter that records nothing: what ``StallMeter(enabled=False)`` returns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from feedpipe.stall.meter import StallMeter
from feedpipe.stall.sinks import Sink

__all__ = ["NullMeter"]


class NullMeter(StallMeter):
    """A meter that records nothing: what ``StallMeter(enabled=False)`` returns."""

    enabled = False

    def __init__(self, enabled: bool = False, trace: bool | Literal["auto"] = False) -> None:
        super().__init__(True, False)

    def wait_begin(self) -> None:
        pass

    def wait_end(self, samples: int = 0, nbytes: int = 0) -> None:
        pass

    def record_batch(  # noqa: PLR0917 - positional on the hot path
        self,
        begin: float,
        end: float,
        samples: int = 0,
        nbytes: int = 0,
        fetch_s: float = -1.0,
        collate_s: float = -1.0,
    ) -> None:
        pass

    def wait_pending(self, begin: float) -> None:
        pass

    def add_stage(self, name: str, seconds: float, nbytes: int = 0) -> None:
        pass

    def pass_begin(self, at: float | None = None) -> None:
        pass

    def pass_end(self) -> None:
        pass

    def set_depth(self, name: str, n: int) -> None:
        pass

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        yield

    def add_sink(self, sink: Sink) -> Sink:
        return sink

    def watch_device(self, device: Any) -> None:
        return None
