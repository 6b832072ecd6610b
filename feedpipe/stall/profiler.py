"""Profiler ranges of a stall meter: whether waits are ranges, and the ranges themselves.

A meter asks one flag per batch, :attr:`WaitRanges.active` (a function): torch's profiler flag
(``feedpipe.stall._torch_compat.profiler_enabled``, which follows ``torch.profiler``) in
``trace="auto"`` mode, always on for ``trace=True`` (or while an NVTX recorder is active) and
always off for ``trace=False``. :class:`WaitRanges` opens and closes the ranges of a wait and
of a user region: NVTX (:mod:`feedpipe.io.trace`) and torch's ``record_function``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from feedpipe.io import trace as _trace
from feedpipe.stall import _torch_compat

__all__ = ["WaitRanges", "always_on", "flag_of", "never_on", "record_function", "torch_flag"]


def never_on() -> bool:
    """The flag of ``trace=False``."""
    return False


def always_on() -> bool:
    """The flag of ``trace=True`` (and of an active NVTX recorder)."""
    return True


def torch_flag(trace: bool | Literal["auto"]) -> Callable[[], bool]:
    """The function that says whether to open ``record_function`` ranges: torch's profiler flag
    in "auto" mode, else a constant."""
    if trace is True:
        return always_on
    if trace != "auto":
        return never_on
    return _torch_compat.profiler_enabled


class _Asked(Mapping[str, bool]):
    """A flag that only a function knows: each lookup calls it."""

    def __init__(self, check: Callable[[], bool]) -> None:
        self._check = check

    def __getitem__(self, key: str) -> bool:
        return bool(self._check())

    def __iter__(self) -> Iterator[str]:
        return iter(("on",))

    def __len__(self) -> int:
        return 1


def flag_of(check: Callable[[], bool]) -> tuple[Mapping[str, Any], str]:
    """``(mapping, key)`` with ``mapping[key] == check()`` at every moment, for a loop that asks
    once per batch: a dict lookup instead of a call for the meter's own flags (``trace=True``,
    ``False``, or torch's profiler flag in "auto" mode); any other function is called."""
    if check is always_on:
        return {"on": True}, "on"
    if check is never_on:
        return {"on": False}, "on"
    if check is _torch_compat.profiler_enabled:
        return _torch_compat.profiler_flag
    return _Asked(check), "on"


def record_function(name: str) -> Any:
    """A ``torch.profiler.record_function`` range (not yet entered)."""
    import torch.profiler

    return torch.profiler.record_function(name)


class WaitRanges:
    """The profiler ranges of one meter: the open wait's, and user regions'.

    ``active()`` is the flag loaders read once per batch: on while either kind of range is
    wanted. ``torch_on()`` is torch's own flag (``record_function`` ranges only while it is on).
    """

    def __init__(self, trace: bool | Literal["auto"]) -> None:
        self.torch_on = torch_flag(trace)
        #: the recorder of feedpipe.io.trace when one is active (trace != False)
        self.nvtx = _trace.recorder() if trace is not False else None
        self.active: Callable[[], bool] = always_on if self.nvtx is not None else self.torch_on
        self.current: tuple[Any] | None = None  # the open range(s) of the current wait

    @property
    def is_open(self) -> bool:
        return self.current is not None

    def open(self, name: str) -> None:
        """Open the wait's ranges: NVTX "feedpipe/wait" and, while torch's profiler records,
        ``record_function(name)``."""
        if self.nvtx is not None:
            self.nvtx.push("feedpipe/wait")
        rf = None
        if self.torch_on():
            rf = record_function(name)
            rf.__enter__()
        self.current = (rf,)

    def close(self) -> None:
        """Close the wait's ranges (nothing when none is open)."""
        if self.current is None:
            return
        (rf,), self.current = self.current, None
        if rf is not None:
            rf.__exit__(None, None, None)
        if self.nvtx is not None:
            self.nvtx.pop()

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """A user region's ranges: ``feedpipe.region.NAME`` for torch's profiler,
        ``feedpipe/region/NAME`` for NVTX."""
        rf = record_function(f"feedpipe.region.{name}") if self.torch_on() else None
        nvtx = self.nvtx
        if nvtx is not None:
            nvtx.push(f"feedpipe/region/{name}")
        if rf is not None:
            rf.__enter__()
        try:
            yield
        finally:
            if rf is not None:
                rf.__exit__(None, None, None)
            if nvtx is not None:
                nvtx.pop()
