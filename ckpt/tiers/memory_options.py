"""``MemoryOptions``: where the memory tier lives and how often it persists (``memory=``).

The tier of a checkpoint directory ``DIR`` is the ckpt root ``ROOT/ckpt-mem-<H>`` on a tmpfs
(``ROOT`` is ``/dev/shm`` unless given; ``H`` is a hash of ``DIR``'s real path), so a new process
on the same node finds the tier of the same ``DIR`` without being told, and ``ckpt ls DIR`` /
``ckpt gc DIR`` find it too. This module only names and validates; it touches no file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_ROOT", "PREFIX", "MemoryOptions", "memory_options", "tier_dir"]

DEFAULT_ROOT = "/dev/shm"
PREFIX = "ckpt-mem-"


@dataclass(frozen=True)
class MemoryOptions:
    """The memory tier of a ``CheckpointManager`` (``memory=MemoryOptions(...)``; ``True``: all
    defaults).

    ``root``: the tmpfs directory holding the tier (default ``/dev/shm``; any directory works,
    but only a tmpfs is memory). ``keep``: snapshots kept in memory (the newest ``keep``; one
    more while a save is being written and one while it is copied to the disk: at most
    ``keep + 2``, the figure checked against the tmpfs).
    ``persist_every``: every Nth save (counted from this manager's first) is copied, verified,
    to the disk directory; a persist still waiting when the next one is due is replaced by it
    (training never waits for the disk). ``remote_every``: of those, the steps of every Mth save
    are uploaded to ``remote=`` (``None``: every persisted step; a multiple of
    ``persist_every``). ``persist_on_close``: ``close()`` persists the newest snapshot if the
    disk lacks it, then frees the tier.
    ``replica``: also keep the newest snapshot of rank ``(r + 1) mod W`` on rank ``r``, sent over
    ``torch.distributed`` (``ckpt.tiers.replica``; build the manager on every rank after
    ``init_process_group``; ``restore`` is then collective).
    """

    root: str | os.PathLike[str] = DEFAULT_ROOT
    keep: int = 2
    persist_every: int = 10
    remote_every: int | None = None
    persist_on_close: bool = True
    replica: bool = False

    def __post_init__(self) -> None:
        for name in ("keep", "persist_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryOptions.{name} must be an int >= 1, got {value!r}")
        every = self.remote_every
        if every is not None and (
            isinstance(every, bool)
            or not isinstance(every, int)
            or every < 1
            or every % self.persist_every
        ):
            raise ValueError(
                f"MemoryOptions.remote_every must be None or a multiple of persist_every "
                f"({self.persist_every}), got {every!r}: only persisted steps can be uploaded"
            )


def memory_options(given: bool | MemoryOptions | None) -> MemoryOptions | None:
    """``memory=``'s value as options: ``True`` gives the defaults, ``False``/``None`` none."""
    if given is None or given is False:
        return None
    if given is True:
        return MemoryOptions()
    if not isinstance(given, MemoryOptions):
        raise TypeError(f"memory= takes True or a MemoryOptions, got {type(given).__name__}")
    return given


def tier_dir(directory: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """The memory tier of the checkpoint directory ``directory`` under ``root``."""
    real = os.path.realpath(directory)
    digest = hashlib.sha256(real.encode()).hexdigest()[:16]
    return Path(root) / f"{PREFIX}{digest}"
