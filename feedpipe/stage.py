"""Moved to :mod:`feedpipe.remote.stage`; this public path re-exports it."""

from __future__ import annotations

import sys
import types
from typing import Any

from feedpipe.remote.stage import StageResult, add_arguments, run, stage

__all__ = ["StageResult", "add_arguments", "run", "stage"]


class _CallableModule(types.ModuleType):
    """``feedpipe.stage(...)`` works even after ``import feedpipe.stage`` bound the module (as
    ``feedpipe.convert`` does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> StageResult:
        return stage(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
