"""Every touch of torch's private API by the stall counters, each named with its reason.

The stall package reads one private flag of torch; it lives here, not in
``feedpipe.loader._torch_compat``, so that ``feedpipe.stall`` does not depend on the loader
(which imports the stall meter): the two subpackages would import each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler

__all__ = ["profiler_enabled", "profiler_flag"]


#: Whether torch's autograd profiler records now (``torch.profiler`` sets the same flag):
#: ``torch.autograd.profiler._is_profiler_enabled``, a module global that torch offers no public
#: reader of, and the meter asks once per batch. A C-level ``getattr`` bound once (no Python frame
#: per call: the hot path's cost); False if torch lacks the flag.
profiler_enabled: Callable[[], bool] = (
    functools.partial(getattr, torch.autograd.profiler, "_is_profiler_enabled")
    if hasattr(torch.autograd.profiler, "_is_profiler_enabled")
    else bool  # bool() is False: every torch feedpipe supports has the flag
)


#: The same flag as a subscript, ``profiler_flag[0][profiler_flag[1]]``: torch's module
#: namespace and the global's name (torch rebinds the global, so the namespace always holds the
#: current value). A loader's per-batch check then costs a dict lookup, not a call.
profiler_flag: tuple[dict[str, Any], str] = (
    (vars(torch.autograd.profiler), "_is_profiler_enabled")
    if hasattr(torch.autograd.profiler, "_is_profiler_enabled")
    else ({"on": False}, "on")
)
