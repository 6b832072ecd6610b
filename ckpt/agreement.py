"""One number agreed by every rank: the minimum over the ranks of ``torch.distributed``.

``Agreement.min(value)`` returns ``value`` on one process (or without ``torch.distributed``
initialized); with several ranks it runs one ``all_reduce(MIN)`` of a one-element CPU tensor
over a gloo group (the default group if its backend is gloo, else a gloo group created on the
first call, itself a collective): every rank must call it at the same point of its loop.
``ckpt.interval`` calls it at the events every rank reaches together (its first
``should_save``, the call after each save), so that every rank answers ``should_save`` alike.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Agreement"]


class Agreement:
    """The minimum of an int over the ranks (module docstring); ``group``: a process group
    (``None``: see the module docstring)."""

    def __init__(self, group: Any = None) -> None:
        self._group = group

    @staticmethod
    def world_size() -> int:
        """The number of ranks (1 unless ``torch.distributed`` is initialized)."""
        if "torch.distributed" not in sys.modules:
            return 1
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return 1
        return int(dist.get_world_size())

    def __getstate__(self) -> dict[str, Any]:
        return {"_group": None}  # a process group belongs to its process

    def min(self, value: int) -> int:
        """The smallest ``value`` of all ranks (``value`` itself on one process)."""
        if self.world_size() < 2:
            return value
        import torch
        import torch.distributed as dist

        if self._group is None:
            gloo = dist.get_backend() == "gloo"
            self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return int(t.item())
