"""The remote tier: background upload of committed checkpoints to an fsspec URL (S3, GCS, ...).

After each local commit the step is queued; a background thread uploads its data files in
parallel (large files as multipart, ``RemoteOptions.block_bytes`` per part, every part in
flight at once), verifies each one
against the manifest, and only then writes the manifest. The remote commit is rename-free: a
``URL/step-N/`` prefix without ``manifest.json`` is not a checkpoint, and deleting a step removes
its manifest first. Verification (``RemoteOptions.verify``):

- ``"auto"`` (default): on S3 the bytes read for the upload are checked against the manifest's
  CRC32Cs as they are sent (a file changed since its commit fails the upload). Every part
  goes with its ``Content-MD5`` (S3 rejects a body that does not match) and the store's ETags,
  its MD5s of the bytes it received, must equal the MD5s of the bytes sent, with the stored
  size (:mod:`ckpt.tiers.s3put`): the store vouches for every byte without a second transfer.
  Where it cannot (not S3, or ETags that are not MD5s, as with SSE-KMS), the file is read
  back as with ``"readback"``.
- ``"readback"``: every chunk is read back from the store and its CRC32C compared with the
  manifest's (end to end; costs one download of the data).
- ``"size"``: only the stored object sizes are compared (weakest).

Transient errors are retried with backoff under ``deadline_s``, permanent ones fail at once
(``feedpipe.io.call``); failures are kept in the stats and raised by the manager's next
``save``/``wait`` (``on_error="warn"``: logged, and retried after the next commit); the local
copy is never evicted before its upload is done (unless ``evict_before_upload``). Messages
never contain credentials (``feedpipe.io.redact``).
Upload status is mirrored to ``DIR/upload-status.json`` for ``ckpt ls``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt import _layout
from ckpt.errors import CheckpointError
from ckpt.policy import KeepLast, Policy
from ckpt.saving import commit
from ckpt.tiers.options import RemoteOptions
from ckpt.tiers.remote_retention import RemoteRetention
from ckpt.tiers.status import RemoteStats, StatusMirror, UploadStatus
from ckpt.tiers.store import RemoteStore
from ckpt.tiers.upload_queue import UploadQueue
from ckpt.tiers.uploader import StepUploader
from feedpipe.io.reaper import join_threads

__all__ = ["RemoteTier"]

log = logging.getLogger("ckpt")
_UPLOADERS = itertools.count()  # numbers the uploaders' thread names
_IDLE_EXIT_S = 5.0  # how long idle upload threads get to exit after a finished close()


def _policy(keep_last: int | Policy | None) -> Policy | None:
    if isinstance(keep_last, Policy) or keep_last is None:
        return keep_last
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError("keep_last_remote must be an int >= 1, a ckpt.policy object or None")
    return KeepLast(keep_last)


class RemoteTier:
    """Uploads committed steps of ``directory`` to ``options.url`` in the background.

    The manager wires it in: ``enqueue`` is an ``on_commit`` listener, ``may_evict`` an evict
    guard. ``retain_local`` is called after each finished upload (local retention may proceed).

    It owns four objects, one concern each: the ``store`` (the remote root and every request to
    it), the ``queue`` (steps waiting, each step's status, the worker thread), the ``uploader``
    (one step, verified, then committed remotely) and the ``retention`` (remote retention and
    garbage collection); the ``mirror`` writes the status to ``DIR/upload-status.json``.
    """

    def __init__(
        self,
        directory: Path,
        options: RemoteOptions,
        keep_last: int | Policy | None = 10,
        retain_local: Callable[[], None] | None = None,
    ) -> None:
        self.policy = _policy(keep_last)
        self.directory = directory
        self.options = options
        self.store = RemoteStore(options)
        self.fs, self.root, self.url = self.store.fs, self.store.root, self.store.url
        self.stats = RemoteStats()
        self._retain_local = retain_local
        self._error: tuple[int, BaseException] | None = None
        self._names = f"ckpt-upload-{next(_UPLOADERS)}"  # this uploader's threads' names
        self._pool = ThreadPoolExecutor(options.threads, thread_name_prefix=self._names)
        # multipart parts (and local checks) of every file: their own pool, so a file's thread
        # that waits for its parts never holds a worker its parts need
        self._parts = ThreadPoolExecutor(options.threads, thread_name_prefix=f"{self._names}-part")
        self.uploader = StepUploader(self.store, self._pool, self._parts)
        self.mirror = StatusMirror(directory, self.url)
        self.queue = UploadQueue(
            self.stats.uploads, self._names, self._reconcile, self._upload_one, self._on_error
        )
        self.retention = RemoteRetention(self.store, self.policy, self.stats, self.queue)
        self.queue.start()  # reconcile with the remote (uploads committed steps never uploaded)

    @property
    def closed(self) -> bool:
        """True once ``close`` ran (a later manager owns the directory's uploads)."""
        return self.queue.closed

    # ---- the manager's interface ---------------------------------------------------------
    def enqueue(self, step: int, path: Path | None = None) -> None:
        """Queue ``step`` for upload (an ``on_commit`` listener; returns at once). With
        ``on_error="warn"``, also queue again every step whose upload failed and whose local copy
        is still there."""
        warn = self.options.on_error == "warn"
        local = set(commit.steps(self.directory)) if warn else set()
        with self.queue.lock:
            retry = [s for s in self.queue.failed() if s != step and s in local]
            self.queue.put([*retry, step], reset=True)
        if retry:
            log.info("ckpt: uploading again to %s: steps %s", self.url, retry)
        self._write_status()
        self.queue.start()

    def may_evict(self, step: int) -> bool:
        """Evict guard: a local step may go once it is committed remotely (or if opted out)."""
        if self.options.evict_before_upload:
            return True
        status = self.stats.uploads.get(step)
        return status is not None and status.state == "done"

    def raise_pending(self) -> None:
        """Re-raise the first upload failure since the last call (then forget it)."""
        with self.queue.lock:
            pending, self._error = self._error, None
        if pending is not None:
            step, exc = pending
            reason = self.store.redact(str(exc))
            raise CheckpointError(
                f"upload of step {step} to {self.url} failed (the local copy is kept): {reason}"
            ) from exc

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued upload has finished (done or failed)."""
        self.queue.wait(timeout, self.url)

    def close(self) -> None:
        """Wait (up to ``close_timeout_s``) for uploads, then stop the upload threads. Uploads
        still running then are abandoned with a warning: the local copies stay, and the next
        manager on this directory uploads them. Each thread left in a transfer (a hung put) is
        named in a ``StuckWorkerWarning``: threads cannot be killed, so the bound of ``close()``
        is "returns and reports" (``feedpipe.io.reaper``)."""
        finished = False
        try:
            self.wait(self.options.close_timeout_s)
            finished = True
        except TimeoutError:
            log.warning(
                "ckpt: closing with uploads to %s unfinished after %s s (steps %s); the local "
                "copies are kept and the next manager on %s uploads them",
                self.url, self.options.close_timeout_s, sorted(self.queue.active()),
                self.directory,
            )  # fmt: skip
        finally:
            self.queue.close()  # an abandoned upload may finish, but nothing new starts
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._parts.shutdown(wait=False, cancel_futures=True)
            # threads cannot be killed: each one still in a transfer is reported by name
            ours = (f"{self._names}_", f"{self._names}-")  # pools: name_N; queue, parts: name-
            mine = [t for t in threading.enumerate() if t.name.startswith(ours)]
            join_threads(mine, f"ckpt upload to {self.url}", _IDLE_EXIT_S if finished else 0.0)

    def gc(self) -> None:
        """Apply remote retention and partial-upload garbage collection now."""
        self.retention.apply()

    # ---- the worker's steps (on the queue's thread) ---------------------------------------
    def _on_error(self, step: int | None, exc: Exception) -> None:
        for failed in [step] if step is not None else commit.steps(self.directory):
            self._fail(failed, exc)

    def _fail(self, step: int, exc: BaseException) -> None:
        reason = self.store.redact(str(exc))
        with self.queue.lock:
            self.queue.mark(step, UploadStatus(step, "failed", reason))
            self.stats.failed += 1
            if self._error is None and self.options.on_error == "raise":
                self._error = (step, exc)
        if self.options.on_error == "warn":
            log.warning(
                "ckpt: upload of step %d to %s failed (the local copy is kept; it is uploaded "
                "again after the next commit): %s",
                step, self.url, reason,
            )  # fmt: skip
        else:
            log.error("ckpt: upload of step %d to %s failed: %s", step, self.url, reason)
        self._write_status()

    def _reconcile(self) -> None:
        """On start: mark steps already committed remotely as done, queue the others."""
        local = commit.steps(self.directory)
        try:
            remote = self.store.listing()
        except Exception as exc:
            for step in local:
                self._fail(step, exc)
            return
        todo = []
        for step in local:
            listing = remote.get(step)
            if listing is not None and listing.committed and self._same_manifest(step):
                self.queue.mark(step, UploadStatus(step, "done"))
            else:
                todo.append(step)
        self.queue.put(todo, reset=False)
        if todo:
            log.info(
                "ckpt: %d committed steps not yet on %s: uploading %s", len(todo), self.url, todo
            )
        self._write_status()
        if self._retain_local is not None:
            self._retain_local()

    def _same_manifest(self, step: int) -> bool:
        local = (_layout.step_dir(self.directory, step) / _layout.MANIFEST).read_bytes()
        return self.store.manifest(step) == local

    def _upload_one(self, step: int) -> None:
        t0 = time.perf_counter()
        self.queue.mark(step, UploadStatus(step, "uploading"))
        self.retention.forget(step)  # a step saved again may carry other metrics
        self._write_status()
        try:
            nbytes = self.uploader.upload(step, _layout.step_dir(self.directory, step))
        except Exception as exc:
            self._fail(step, exc)
            return
        dt = time.perf_counter() - t0
        with self.queue.lock:
            self.queue.mark(step, UploadStatus(step, "done", "", nbytes, dt))
            self.stats.uploaded_bytes += nbytes
            self.stats.upload_s += dt
        log.info("ckpt: uploaded step %d to %s (%d bytes, %.2f s)", step, self.url, nbytes, dt)
        self._write_status()
        try:
            self.retention.apply()
        except Exception as exc:  # retention failures are reported, the upload stands
            self._fail_retention(step, exc)
        if self._retain_local is not None:
            self._retain_local()

    def _fail_retention(self, step: int, exc: Exception) -> None:
        reason = self.store.redact(str(exc))
        log.log(
            logging.WARNING if self.options.on_error == "warn" else logging.ERROR,
            "ckpt: remote retention after step %d on %s failed: %s",
            step, self.url, reason,
        )  # fmt: skip
        with self.queue.lock:
            if self._error is None and self.options.on_error == "raise":
                self._error = (step, exc)

    def _write_status(self) -> None:
        uploads = self.queue.snapshot()
        if uploads is not None:  # once closed, a later manager owns the status file
            self.mirror.write(uploads)

    # ---- restore from the remote ----------------------------------------------------------
    def committed_steps(self, deadline_s: float | None = None) -> list[int]:
        """Steps committed on the remote (listing only; restore verifies). ``deadline_s`` bounds
        the retries (default: ``min(30, RemoteOptions.deadline_s)``)."""
        limit = min(30.0, self.options.deadline_s) if deadline_s is None else deadline_s
        return sorted(s for s, e in self.store.listing(limit).items() if e.committed)

    def read_manifest(self, step: int) -> dict[str, Any]:
        """The validated manifest body of remote ``step`` (``CorruptCheckpointError`` if bad)."""
        return self.store.read_manifest(step)

    def download(self, step: int) -> Path:
        """Download ``step`` into ``DIR/step-N.tmp-remote-*`` (manifest checked, files fetched);
        the caller verifies the data and publishes or removes the directory."""
        tmp = self.directory / _layout.tmp_name(_layout.step_name(step), "remote")
        tmp.mkdir()
        try:
            self.store.download(step, tmp)
        except BaseException:
            commit.remove_path(tmp)
            raise
        return tmp
