"""Every touch of torch's private API by the stall counters, each named with its reason.

The stall package reads one private flag of torch; it lives here, not in
``feedpipe.loader._torch_compat``, so that ``feedpipe.stall`` does not depend on the loader
(which imports the stall meter): the two subpackages would import each other.
"""

from __future__ import annotations

import torch

__all__ = ["profiler_enabled"]


def profiler_enabled() -> bool:
    """Whether torch's autograd profiler records now (``torch.profiler`` sets the same flag):
    ``torch.autograd.profiler._is_profiler_enabled``, a module global that torch offers no public
    reader of, and the meter asks once per batch (a cheap read, no call into the profiler);
    False if torch lacks it."""
    try:
        return bool(torch.autograd.profiler._is_profiler_enabled)
    except AttributeError:  # pragma: no cover - every torch feedpipe supports has it
        return False
