"""Moved to :mod:`feedpipe.datasets.convert`; this public path re-exports it."""

from __future__ import annotations

import sys
import types
from typing import Any

from feedpipe.datasets.convert import ConvertResult, add_arguments, convert, run

__all__ = ["ConvertResult", "add_arguments", "convert", "run"]


class _CallableModule(types.ModuleType):
    """``feedpipe.convert(...)`` works even after ``import feedpipe.convert`` bound the module."""

    def __call__(self, *args: Any, **kwargs: Any) -> ConvertResult:
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
