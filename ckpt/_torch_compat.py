"""Every touch of torch's private API in ckpt, each named with its reason.

Nothing else in ckpt reaches a ``torch._...`` name: a torch release that moves one of them
breaks this module only.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

__all__ = ["foreach_copy", "is_parameter", "param_flags"]


def foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_copy_(dsts, srcs)``: one kernel launch copies many tensor pairs (a save
    of thousands of small CUDA tensors gathers them with one call per dtype instead of one copy
    each; a restore scatters them back the same way). No public API batches copies."""
    torch._foreach_copy_(list(dsts), list(srcs))


def is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)`` without the metaclass hook's cost for plain tensors:
    ``Parameter.__instancecheck__`` reads the private ``_is_param`` flag of a plain
    ``torch.Tensor``; reading it directly keeps the per-leaf cost of ``flatten`` at one
    attribute fetch for a state of thousands of tensors."""
    if type(t) is torch.Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, torch.nn.Parameter)


def param_flags(ts: Sequence[torch.Tensor]) -> list[Any]:
    """Per tensor, the private ``_is_param`` flag that ``is_parameter`` reads (``False`` where
    unset), in one C loop: with the tensor's type it decides ``is_parameter`` (a
    ``Parameter`` is its own type), so a change of either is seen without a Python call per
    tensor (``ckpt.saving.structure``)."""
    return list(map(getattr, ts, repeat("_is_param"), repeat(False)))
