"""Whether a stall meter's waits are profiler ranges: torch's flag, or a constant stand-in.

A meter reads one flag per batch, ``flag._is_profiler_enabled``: ``torch.autograd.profiler``
itself in ``trace="auto"`` mode (its flag follows ``torch.profiler``), :class:`AlwaysOn` for
``trace=True`` (or while an NVTX recorder is active) and :class:`NeverOn` for ``trace=False``.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["AlwaysOn", "NeverOn", "record_function", "torch_flag"]


class NeverOn:
    """Stand-in for ``torch.autograd.profiler`` when ``trace=False``."""

    _is_profiler_enabled = False


class AlwaysOn:
    """Stand-in for ``torch.autograd.profiler`` when ``trace=True``."""

    _is_profiler_enabled = True


def torch_flag(trace: bool | Literal["auto"]) -> Any:
    """The object whose ``_is_profiler_enabled`` says whether to open ``record_function``
    ranges: torch's profiler module in "auto" mode (if it has the cheap flag), else a constant."""
    if trace is True:
        return AlwaysOn
    if trace != "auto":
        return NeverOn
    try:
        import torch.autograd.profiler as prof
    except ImportError:  # pragma: no cover - torch is a dependency
        return NeverOn
    return prof if hasattr(prof, "_is_profiler_enabled") else NeverOn


def record_function(name: str) -> Any:
    """A ``torch.profiler.record_function`` range (not yet entered)."""
    import torch.profiler

    return torch.profiler.record_function(name)
