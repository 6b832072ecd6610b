"""``RemoteRetention``: the remote tier's retention pass and its garbage collection.

Remote retention is ``ckpt.retention.rules.plan``, the rule of the local tier, with every remote
step counted as restorable: a remote manifest is written only after each data file verified,
and checking more would download the step. The newest verified upload and steps still queued
or uploading are never deleted (the evict guard), nor is a prefix holding names ckpt never
writes, nor a step whose manifest ckpt did not write. Prefixes without a manifest older than
``grace_s`` are partial uploads and go; on S3 so do multipart uploads of a step that is not
active here, begun before that.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Set

from ckpt import _layout, _owner
from ckpt.errors import CorruptCheckpointError
from ckpt.policy import Policy
from ckpt.retention import rules
from ckpt.tiers import s3put
from ckpt.tiers.listing import RemoteListing, list_remote
from ckpt.tiers.status import RemoteStats
from ckpt.tiers.store import RemoteStore
from ckpt.tiers.upload_queue import UploadQueue

__all__ = ["RemoteRetention"]

log = logging.getLogger("ckpt")


class RemoteRetention:
    """Applies ``policy`` to ``store``'s committed steps, guarded by ``queue`` (its active steps
    and newest verified upload); records what it removed in ``stats``. Each step's metrics (for
    ``KeepBest``) are read once from its validated remote manifest."""

    def __init__(
        self, store: RemoteStore, policy: Policy | None, stats: RemoteStats, queue: UploadQueue
    ) -> None:
        self.store, self.policy, self.stats, self.queue = store, policy, stats, queue
        self._metrics: dict[int, dict[str, float]] = {}

    def forget(self, step: int) -> None:
        """Drop what is known of ``step`` (it is uploaded again: another save may differ)."""
        self._metrics.pop(step, None)

    def apply(self) -> None:
        """One pass (module docstring)."""
        listing = self.store.call(
            lambda: list_remote(self.store.fs, self.store.root), 0, "", "list"
        )
        active = self.queue.active()
        listing = self._ours(listing)
        committed = sorted(s for s, e in listing.items() if e.committed)
        decision = rules.plan(
            committed,
            self.policy,
            is_restorable=lambda s: True,
            may_evict=lambda s: s != self.queue.newest_done and s not in active,
            metrics=self.step_metrics,
        )
        for step in decision.delete:
            self._evict(step)
        now = time.time()
        self._remove_partial(listing, active, now)
        if self.store.is_s3:  # parts of a file whose uploader died mid-way (no object, billed)
            try:
                self._abort_stale_uploads(now - self.store.options.grace_s, active)
            except Exception as exc:  # housekeeping (a store may not list uploads): never fatal
                reason = self.store.redact(str(exc))
                log.warning("ckpt: stale multipart uploads on %s: %s", self.store.url, reason)

    def _ours(self, listing: dict[int, RemoteListing]) -> dict[int, RemoteListing]:
        """The prefixes that hold only what ckpt writes; the others are named and left alone."""
        for step, entry in sorted(listing.items()):
            if entry.foreign:
                log.warning(
                    "ckpt: leaving %s alone: ckpt did not write %s",
                    self.store.where(step), ", ".join(entry.foreign[:5]),
                )  # fmt: skip
        return {s: e for s, e in listing.items() if not e.foreign}

    def _evict(self, step: int) -> None:
        raw = self.store.manifest(step)
        if raw is not None and not _owner.is_ckpt_manifest(raw):
            log.warning(
                "ckpt: leaving %s alone: its manifest was not written by ckpt",
                self.store.where(step),
            )
            return
        self.store.delete_step(step)
        self._metrics.pop(step, None)
        self.stats.remote_evicted.append(step)

    def _remove_partial(
        self, listing: dict[int, RemoteListing], active: Set[int], now: float
    ) -> None:
        for step, entry in listing.items():
            if entry.committed or step in active:
                continue
            if now - entry.newest_mtime > self.store.options.grace_s:
                self.store.delete_step(step)
                self.stats.partial_removed.append(step)
                log.info(
                    "ckpt: removed partial upload %s from %s",
                    _layout.step_name(step), self.store.url,
                )  # fmt: skip

    def _abort_stale_uploads(self, before: float, active: Set[int]) -> None:
        """Abort the multipart uploads of steps not active here, begun before ``before``."""
        store = self.store
        stale = store.call(lambda: s3put.stale_uploads(store.fs, store.root, before), 0, "", "list")
        bucket = store.fs.split_path(store.root)[0]
        for rel, key, upload_id in stale:
            head, _, tail = rel.partition("/")
            step = _layout.step_number(head)
            if step is None or step in active or not _layout.is_data_name(tail):
                continue  # only ckpt's own data files are uploaded in parts

            def abort(k: str = key, u: str = upload_id) -> None:
                with contextlib.suppress(FileNotFoundError):  # already gone: nothing to do
                    store.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=k, UploadId=u)

            store.call(abort, step, tail, "abort")
            log.info("ckpt: aborted a stale multipart upload of %s/%s", store.url, rel)

    def step_metrics(self, step: int) -> dict[str, float]:
        """The metrics of remote ``step``: from its validated remote manifest, read once (a
        committed manifest does not change: it is the same bytes as the local one)."""
        if step not in self._metrics:
            try:
                found = self.store.read_manifest(step).get("metrics")
            except CorruptCheckpointError as exc:  # a bad manifest has no metric to rank by
                log.warning("ckpt: remote step %d has no readable metrics: %s", step, exc)
                found = None
            # any other failure propagates: this retention pass stops and deletes nothing more
            self._metrics[step] = dict(found) if isinstance(found, dict) else {}
        return self._metrics[step]
