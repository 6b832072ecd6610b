"""Every touch of torch's private API by the stall counters, each named with its reason.

The stall package reads one private flag of torch; it lives here, not in
``feedpipe.loader._torch_compat``, so that ``feedpipe.stall`` does not depend on the loader
(which imports the stall meter): the two subpackages would import each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.autograd.profiler

__all__ = ["profiler_enabled"]


#: Whether torch's autograd profiler records now (``torch.profiler`` sets the same flag):
#: ``torch.autograd.profiler._is_profiler_enabled``, a module global that torch offers no public
#: reader of, and the meter asks once per batch. A C-level ``getattr`` bound once (no Python frame
#: per call: the hot path's cost); False if torch lacks the flag.
profiler_enabled: Callable[[], bool] = (
    functools.partial(getattr, torch.autograd.profiler, "_is_profiler_enabled")
    if hasattr(torch.autograd.profiler, "_is_profiler_enabled")
    else bool  # bool() is False: every torch feedpipe supports has the flag
)
