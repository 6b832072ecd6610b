"""The one retention rule, shared by ``CheckpointManager``, ``ckpt gc`` and the remote tier.

``plan`` applies a ``ckpt.policy`` object (``KeepLast``, ``KeepEvery``, ``KeepBest``, or any
``AnyOf`` of them) to the committed steps. Only restorable steps count (the policies'
rules are in ``ckpt.policy``); the newest restorable step is kept whatever the
policy, and so is the step ``latest`` names (the last one saved, which is not the newest after
a save of a lower step, e.g. resuming from an earlier step after a loss spike: it was deleted
right after its commit, leaving ``latest`` dangling). A step no
policy keeps is deleted only if every guard allows it (the upload guard: never delete a local
step whose upload has not finished). With no policy (``None``) nothing is deleted.

The remote tier applies the same ``plan`` to its committed remote steps, each counted as
restorable (its manifest is written only after every data file verified).

Whether a local step is restorable and the metrics it was saved with are read from disk by
``ckpt.retention.checks`` (the callers pass them in): this rule reads nothing, so the remote tier
applies it without importing the restore path.

``record(root, policy)`` writes the manager's policy to ``DIR/retention.json`` (under the writer
lock, when it becomes the writer), and ``recorded(root)`` reads it back: ``ckpt gc`` without
flags applies exactly the policy the manager applied, and refuses to run without one (it never
falls back to a default of its own).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt import _layout, _owner
from ckpt.errors import CheckpointError
from ckpt.policy import AnyOf, KeepLast, Policy, StepView, from_record, to_record
from feedpipe.io import atomic_write

if TYPE_CHECKING:  # at run time from __getattr__, on first use
    from ckpt.retention.checks import metrics, restorable

__all__ = ["Plan", "metrics", "plan", "record", "recorded", "restorable"]

_CHECKS = ("metrics", "restorable")


def __getattr__(name: str) -> Callable[[Path], object]:
    """``restorable`` and ``metrics`` live in ``ckpt.retention.checks`` (they read the step on
    disk); they stay reachable here, imported on first use so this rule imports no restore path."""
    if name not in _CHECKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ckpt.retention import checks

    found: Callable[[Path], object] = getattr(checks, name)
    return found


@dataclass
class Plan:
    """What retention does: ``keep`` maps each kept step to why, ``delete`` lists the others."""

    keep: dict[int, str] = field(default_factory=dict)
    delete: list[int] = field(default_factory=list)


def plan(
    steps: Sequence[int],
    policy: Policy | None,
    *,
    is_restorable: Callable[[int], bool],
    may_evict: Callable[[int], bool],
    metrics: Callable[[int], Mapping[str, float]] | None = None,
    latest: int | None = None,
) -> Plan:
    """Decide which of the committed ``steps`` to keep and which to delete (module docstring).

    ``is_restorable`` is asked only about steps a policy would keep; ``metrics`` (a step's saved
    metrics) only by ``KeepBest``; ``may_evict`` about each step that would be deleted.
    ``latest``: the step the directory's ``latest`` names (kept).
    """
    out = Plan()
    if policy is None:
        out.keep = {s: "no retention policy" for s in steps}
        return out
    view = StepView(steps, is_restorable, metrics)
    out.keep = AnyOf(policy, KeepLast(1)).select(view)
    if latest is not None and latest in view.newest_first and latest not in out.keep:
        out.keep[latest] = "named by latest (the last step saved)"
    for step in view.newest_first:
        if step in out.keep:
            continue
        if not may_evict(step):
            out.keep[step] = "upload not finished"
        else:
            out.delete.append(step)
    out.delete.sort()
    return out


def record(root: Path, policy: Policy | None) -> None:
    """Write ``policy`` to ``root/retention.json`` unless it holds that already (call under the
    writer lock). A custom ``Policy`` is recorded as such: ``ckpt gc`` then needs flags. A file
    of that name that ckpt did not write is a ``CheckpointError``, never overwritten."""
    path = root / _layout.RETENTION_FILE
    rules = to_record(policy)
    body: dict[str, object] = {"tool": _owner.TOOL, "version": 1, "policy": rules}
    if rules is None:
        body["custom"] = repr(policy)[:200]
    text = json.dumps(body, sort_keys=True).encode() + b"\n"
    if os.path.lexists(path):
        if not _owner.is_ours(path):
            raise CheckpointError(
                f"{path}: was not written by ckpt; refusing to overwrite it (move it away)"
            )
        if path.read_bytes() == text:
            return
    atomic_write(path, text)


def recorded(root: Path) -> Policy | None:
    """The policy recorded in ``root/retention.json``; ``CheckpointError`` naming the file when
    there is none, it is not ckpt's, or the manager's policy could not be recorded."""
    path = root / _layout.RETENTION_FILE
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{path}: no retention policy recorded (written by CheckpointManager when it saves); "
            "give --keep-last/--keep-every/--keep-best"
        )
    if not _owner.is_ours(path):
        raise CheckpointError(f"{path}: was not written by ckpt; refusing to read a policy from it")
    body = json.loads(path.read_bytes())
    if body.get("policy") is None:
        raise CheckpointError(
            f"{path}: the manager's policy {body.get('custom', '?')} is a custom one that cannot "
            "be recorded; give --keep-last/--keep-every/--keep-best"
        )
    try:
        return from_record(body["policy"])
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
