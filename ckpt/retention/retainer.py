"""The manager's retention pass and what it remembers between passes.

``Retainer.retain`` applies ``ckpt.retention.rules.plan`` (the rule ``ckpt gc`` uses) to the local
steps with the manager's evict guards, and deletes what the plan drops. Two caches, keyed by
the step directory's inode (a step replaced under the same name is read again), keep a pass
from re-reading steps: whether a step is restorable (the steps this manager committed or
restored verified are marked good without a read) and the metrics a step was saved with.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ckpt import _layout
from ckpt.errors import CheckpointError
from ckpt.policy import AnyOf, KeepLast, Policy
from ckpt.retention import checks, rules
from ckpt.saving import commit

__all__ = ["Retainer"]

log = logging.getLogger("ckpt")


class Retainer:
    """Retention for one directory: ``evict_guards`` and ``evicted`` are the manager's lists."""

    def __init__(
        self, directory: Path, evict_guards: list[Callable[[int], bool]], evicted: list[int]
    ) -> None:
        self.directory = directory
        self.evict_guards = evict_guards
        self.evicted = evicted
        self.lock = threading.Lock()
        self.checked: dict[int, tuple[int, bool]] = {}  # step -> (dir inode, restorable)
        # step -> (dir inode, metrics)
        self.metric_cache: dict[int, tuple[int, dict[str, float]]] = {}

    def retain(self, policy: Policy | None, strict: bool = False) -> None:
        """Apply ``ckpt.retention.rules.plan`` (the rule ``ckpt gc`` uses) with the evict guards.

        A step that cannot be read for a reason other than its content (EIO, EMFILE, EACCES)
        stops the pass before anything is deleted: raised with ``strict`` (``gc()``), else
        logged, and the next pass tries again."""
        try:
            self.retain_pass(policy)
        except OSError as exc:
            if strict:
                raise
            log.warning("ckpt: retention skipped (nothing deleted), will retry: %r", exc)

    def retain_pass(self, policy: Policy | None) -> None:
        """One retention pass (see ``retain``); an ``OSError`` stops it before any deletion."""
        if policy is None:
            return
        with self.lock:  # the persist and upload threads may both apply retention
            committed = commit.steps(self.directory)
            parts = policy.policies if isinstance(policy, AnyOf) else (policy,)
            if any(isinstance(p, KeepLast) and len(committed) <= p.n for p in parts):
                return  # KeepLast(n) keeps all of at most n steps: nothing to verify
            decision = rules.plan(
                committed,
                policy,
                is_restorable=self.is_restorable,
                may_evict=lambda s: all(guard(s) for guard in self.evict_guards),
                metrics=self.step_metrics,
                latest=commit.read_latest(self.directory),
            )
            for step in decision.delete:
                if commit.evict(self.directory, step):
                    self.evicted.append(step)
                    self.checked.pop(step, None)
                    self.metric_cache.pop(step, None)

    def step_metrics(self, step: int) -> dict[str, float]:
        """The metrics of local ``step`` (its validated manifest), cached by directory inode."""
        path = _layout.step_dir(self.directory, step)
        try:
            ino = os.stat(path).st_ino
        except OSError:
            return {}
        known = self.metric_cache.get(step)
        if known is None or known[0] != ino:
            try:
                known = (ino, checks.metrics(path))
            except (CheckpointError, FileNotFoundError) as exc:  # corrupt or gone: not ranked
                # (another OSError, e.g. EIO, propagates: the pass stops and deletes nothing)
                log.warning("ckpt: retention cannot read the metrics of step %d: %s", step, exc)
                known = (ino, {})
            self.metric_cache[step] = known
        return known[1]

    def is_restorable(self, step: int) -> bool:
        """Steps this manager committed or restored verified count as restorable; any other step
        is checked once (``ckpt.retention.checks.restorable``), keyed by its directory's inode."""
        path = _layout.step_dir(self.directory, step)
        try:
            ino = os.stat(path).st_ino
        except OSError:
            return False
        known = self.checked.get(step)
        if known is not None and known[0] == ino:
            return known[1]
        why = checks.restorable(path)
        if why is not None:
            log.warning("ckpt: retention does not count step %d (not restorable): %s", step, why)
        self.checked[step] = (ino, why is None)
        return why is None

    def mark_good(self, step: int, path: Path) -> None:
        """Record ``step`` (at ``path``) as restorable: committed or verified by this manager."""
        try:
            self.checked[step] = (os.stat(path).st_ino, True)
        except OSError:
            pass
