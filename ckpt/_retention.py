"""The one retention rule, shared by ``CheckpointManager``, ``ckpt gc`` and the remote tier.

Walking the committed steps from newest to oldest, the first ``keep_last`` steps that are
*restorable* are kept. A step that is not restorable is never counted, so a bad step never
displaces a good one; it is kept (not deleted) when it is newer than the oldest kept good step,
and deleted like any other step when it is older. A step older than the kept ones is deleted only
if every guard allows it (the upload guard: never delete a local step whose upload has not
finished). With ``keep_last=None`` nothing is deleted.

The remote tier applies the same ``plan`` to its committed remote steps, each counted as
restorable (its manifest is written only after every data file verified).

``restorable(path)`` is the check both local callers use: ``ckpt._reader.verify_step``, which
runs the validator a restore runs (tree, entries, types, sizes) and checks every file size and
chunk checksum, without building a tensor. A step written through DCP is checked the same way (DCP's
planner, not ckpt, rebuilds its tree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Plan", "plan", "restorable"]


@dataclass
class Plan:
    """What retention does: ``keep`` maps each kept step to why, ``delete`` lists the others."""

    keep: dict[int, str] = field(default_factory=dict)
    delete: list[int] = field(default_factory=list)


def plan(
    steps: Sequence[int],
    keep_last: int | None,
    *,
    is_restorable: Callable[[int], bool],
    may_evict: Callable[[int], bool],
) -> Plan:
    """Decide which of the committed ``steps`` to keep and which to delete (module docstring).

    ``is_restorable`` is asked about the newest steps only, until ``keep_last`` good ones are
    found; ``may_evict`` is asked about each step that would be deleted.
    """
    out = Plan()
    if keep_last is None:
        out.keep = {s: "keep_last=None" for s in steps}
        return out
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1 or None")
    good = 0
    for step in sorted(steps, reverse=True):
        if good < keep_last:
            if is_restorable(step):
                good += 1
                newest = "newest valid checkpoint"
                out.keep[step] = newest if good == 1 else f"one of the newest {keep_last} valid"
            else:
                out.keep[step] = "not restorable, not counted"
        elif not may_evict(step):
            out.keep[step] = "upload not finished"
        else:
            out.delete.append(step)
    out.delete.sort()
    return out


def restorable(path: Path) -> str | None:
    """``None`` if the step in ``path`` restores with every checksum verified, else why not.

    Data files are read once for their checksums; no tensor is built and nothing touches a device.
    """
    from ckpt import _commit
    from ckpt._reader import verify_step
    from ckpt.errors import CheckpointError

    try:
        with _commit.reading(path):
            verify_step(path)
    except Exception as exc:  # any failure, typed or not, means "cannot be restored"
        return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return None
