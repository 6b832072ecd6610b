"""Where a warning about a loader's arguments should point: the user's line that built the
loader or assigned its setting, not feedpipe's or torch's frames in between (Python's default
filter shows a warning once per place, and a user's filter by module matches that place)."""

from __future__ import annotations

import inspect
import os

import torch.utils.data

__all__ = ["user_stacklevel"]

# frames skipped: feedpipe's and torch.utils.data's (its ``__setattr__`` runs an assigned
# ``loader.device``)
_INNER = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (os.path.dirname(os.path.abspath(__file__)), torch.utils.data.__file__)
)


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside feedpipe and torch, for a warning issued
    by this function's caller."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and frame.f_code.co_filename.startswith(_INNER):
        frame, level = frame.f_back, level + 1
    return max(level, 1)  # this frame counted in place of the user's
