"""Argument values that more than one part of feedpipe accepts.

``integer(value)``: whether ``value`` is an integer of any integral type (``int``, ``np.int64``:
torch's own settings take them, through ``operator.index``), never a bool or a float. The
loader's ``"auto"`` settings and ``feedpipe.headspace``'s counts ask it.
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["integer"]


def integer(value: Any) -> bool:
    """Whether ``value`` is an integer (``operator.index`` takes it), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True
