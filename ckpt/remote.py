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

import collections
import contextlib
import datetime
import itertools
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpt import _faults, _layout, _owner
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError, RemoteCheckpointError
from ckpt.policy import KeepLast, Policy
from ckpt.retention import rules
from ckpt.saving import commit
from ckpt.tiers import s3put
from feedpipe.io import RetryPolicy, call, crc32c, is_s3_url, redact, resolve, to_hex
from feedpipe.io.reaper import join_threads
from feedpipe.io.trace import span

__all__ = [
    "STATUS_FILE",
    "RemoteListing",
    "RemoteOptions",
    "RemoteStats",
    "RemoteTier",
    "UploadStatus",
    "list_remote",
    "read_status",
]

log = logging.getLogger("ckpt")
_UPLOADERS = itertools.count()  # numbers the uploaders' thread names
_IDLE_EXIT_S = 5.0  # how long idle upload threads get to exit after a finished close()

STATUS_FILE = _layout.STATUS_FILE
_MIN_PART = 5 << 20  # S3's smallest multipart part (all but the last)
_MAX_PART = 5 << 30  # S3's largest part, and largest single PutObject


@dataclass(frozen=True)
class RemoteOptions:
    """Where and how checkpoints are uploaded.

    ``url``: the remote root (``s3://bucket/run``, any fsspec URL). ``storage_options``: passed to
    fsspec (credentials are redacted from every message). ``threads``: files and multipart parts
    in flight (and read-back ranges). ``block_bytes``: the largest multipart part; a file is
    cut into at least ``threads`` parts (never under S3's 5 MiB minimum), so one large file
    still uses every connection. ``verify``: ``"auto"``, ``"readback"`` or ``"size"``
    (module docstring). ``deadline_s``: how long one transfer keeps retrying transient errors.
    ``grace_s``: remote prefixes without a manifest older than this are garbage-collected (on
    S3 also multipart uploads of a step begun before and never completed).
    ``evict_before_upload``: let local retention delete steps not yet uploaded (opt-out of
    tier-aware retention). ``close_timeout_s``: how long ``close()`` waits for uploads.
    ``on_error``: ``"raise"`` (default) re-raises an upload failure from the manager's next
    ``save``/``wait``/``close``, and the next manager on the directory uploads the step again;
    ``"warn"`` logs a warning instead, training goes on, and the step is uploaded again after each
    later commit until it succeeds. Either way the local copy is kept until uploaded.
    """

    url: str
    storage_options: Mapping[str, Any] | None = None
    threads: int = 8
    block_bytes: int = 16 << 20
    verify: str = "auto"
    deadline_s: float = 300.0
    grace_s: float = 3600.0
    evict_before_upload: bool = False
    close_timeout_s: float | None = 600.0
    on_error: str = "raise"

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "warn"):
            raise ValueError(
                f"RemoteOptions.on_error must be 'raise' or 'warn', not {self.on_error!r}"
            )
        if self.verify not in ("auto", "readback", "size"):
            raise ValueError(
                f"RemoteOptions.verify must be 'auto', 'readback' or 'size', not {self.verify!r}"
            )
        if self.threads < 1 or not _MIN_PART <= self.block_bytes <= _MAX_PART:
            raise ValueError(
                "RemoteOptions needs threads >= 1 and 5 MiB <= block_bytes <= 5 GiB (S3 limits)"
            )


@dataclass
class UploadStatus:
    """One step's upload: ``state`` is pending, uploading, done or failed (with ``reason``)."""

    step: int
    state: str = "pending"
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class RemoteStats:
    """Upload counters and per-step status (``manager.stats.remote``)."""

    uploads: dict[int, UploadStatus] = field(default_factory=dict)
    uploaded_bytes: int = 0
    upload_s: float = 0.0
    failed: int = 0
    remote_evicted: list[int] = field(default_factory=list)
    partial_removed: list[int] = field(default_factory=list)


@dataclass
class RemoteListing:
    """One ``step-N`` prefix on the remote: committed (has a manifest), its newest object time,
    and the names under it that ckpt never writes (``foreign``: such a prefix is never deleted)."""

    step: int
    committed: bool
    newest_mtime: float
    foreign: list[str] = field(default_factory=list)


def _transfer(
    fn: Callable[[], Any],
    url: str,
    what: str,
    policy: RetryPolicy,
    storage_options: Mapping[str, Any] | None,
) -> Any:
    """``feedpipe.io``'s retrying ``call``, its ``RemoteIOError`` raised as
    ckpt's ``RemoteCheckpointError`` with the same message: ckpt raises only ckpt errors."""
    from feedpipe.io import RemoteIOError

    try:
        return call(fn, url, what=what, policy=policy, storage_options=storage_options)
    except RemoteIOError as exc:
        raise RemoteCheckpointError(str(exc), exc.url, permanent=exc.permanent) from exc


def _client_options(options: RemoteOptions) -> dict[str, Any]:
    """``options.storage_options``; for S3 (the caller's values win): a connection pool with
    room for every part and file request in flight (botocore's default of 10 would cap them),
    and no request checksum computed by botocore: every data file goes with its ``Content-MD5``
    (:mod:`ckpt.tiers.s3put`), the manifest is read back, and botocore's checksum would cost the
    event loop thread that carries every transfer a pass over each part."""
    out = dict(options.storage_options or {})
    if is_s3_url(options.url):
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("max_pool_connections", max(10, 2 * options.threads + 2))
        out["config_kwargs"] = config
    return out


def _part_bytes(size: int, block_bytes: int, threads: int) -> int:
    """The multipart part size for a file of ``size`` bytes: at most ``block_bytes``, and small
    enough that the file has ``threads`` parts to send at once, but never under S3's 5 MiB, and
    large enough that the file has at most S3's 10,000 parts."""
    part = max(_MIN_PART, min(block_bytes, -(-size // max(1, threads))))
    return max(part, -(-size // s3put.MAX_PARTS))


def _mtime(info: Mapping[str, Any]) -> float:
    value = info.get("LastModified") or info.get("mtime") or info.get("created") or 0.0
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def list_remote(fs: Any, root: str) -> dict[int, RemoteListing]:
    """Every ``step-N`` prefix below ``root`` (one recursive listing)."""
    fs.invalidate_cache(root)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[int, RemoteListing] = {}
    base = root.rstrip("/") + "/"
    for path, info in found.items():
        rel = path[len(base) :] if path.startswith(base) else path
        head, _, tail = rel.partition("/")
        step = _layout.step_number(head)
        if step is None:
            continue
        entry = out.setdefault(step, RemoteListing(step, False, 0.0))
        entry.committed |= tail == fmt.MANIFEST
        if tail != fmt.MANIFEST and not _layout.is_data_name(tail):
            entry.foreign.append(tail)
        entry.newest_mtime = max(entry.newest_mtime, _mtime(info))
    return out


def read_status(directory: str | os.PathLike[str]) -> dict[int, dict]:
    """The upload status mirrored in ``DIR/upload-status.json`` (empty if none). Only a regular
    file is read (never a symlink; a FIFO never blocks); what is not ckpt's status (not JSON,
    nested too deeply, a step's entry that is not an object) reads as no upload finished."""
    path = Path(directory) / STATUS_FILE
    try:
        fd = fmt.open_regular(path)
    except (OSError, CheckpointError):
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read())
        return {int(k): v for k, v in doc.get("steps", {}).items() if isinstance(v, dict)}
    except (OSError, ValueError, RecursionError, AttributeError, TypeError):
        return {}


class RemoteTier:
    """Uploads committed steps of ``directory`` to ``options.url`` in the background.

    The manager wires it in: ``enqueue`` is an ``on_commit`` listener, ``may_evict`` an evict
    guard. ``retain_local`` is called after each finished upload (local retention may proceed).
    """

    def __init__(
        self,
        directory: Path,
        options: RemoteOptions,
        keep_last: int | Policy | None = 10,
        retain_local: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(keep_last, Policy) or keep_last is None:
            self.policy = keep_last
        elif isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError("keep_last_remote must be an int >= 1, a ckpt.policy object or None")
        else:
            self.policy = KeepLast(keep_last)
        self.directory = directory
        self.options = options
        self._metrics: dict[int, dict] = {}
        self.fs, self.root = resolve(options.url, _client_options(options))
        self.url = redact(options.url, options.storage_options)
        self.stats = RemoteStats()
        self._retain_local = retain_local
        self._policy = RetryPolicy(deadline_s=options.deadline_s, base_s=0.1, max_sleep_s=2.0)
        self._cond = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._busy = False
        self._scanned = False
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._newest_verified: int | None = None
        self._closed = False
        self._names = f"ckpt-upload-{next(_UPLOADERS)}"  # this uploader's threads' names
        self._pool = ThreadPoolExecutor(options.threads, thread_name_prefix=self._names)
        # multipart parts (and local checks) of every file: their own pool, so a file's thread
        # that waits for its parts never holds a worker its parts need
        self._parts = ThreadPoolExecutor(options.threads, thread_name_prefix=f"{self._names}-part")
        self._s3 = s3put.is_s3(self.fs)
        self._kick()  # reconcile with the remote (uploads committed steps never uploaded)

    # ---- queue --------------------------------------------------------------------------
    def enqueue(self, step: int, path: Path | None = None) -> None:
        """Queue ``step`` for upload (an ``on_commit`` listener; returns at once). With
        ``on_error="warn"``, also queue again every step whose upload failed and whose local copy
        is still there."""
        warn = self.options.on_error == "warn"
        local = set(commit.steps(self.directory)) if warn else set()
        with self._cond:
            retry = [
                s
                for s, st in sorted(self.stats.uploads.items())
                if st.state == "failed" and s != step and s in local
            ]
            for again in [*retry, step]:
                self.stats.uploads[again] = UploadStatus(again)
                if again not in self._queue:
                    self._queue.append(again)
        if retry:
            log.info("ckpt: uploading again to %s: steps %s", self.url, retry)
        self._write_status()
        self._kick()

    def _kick(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"{self._names}-queue", daemon=True
                )
                self._thread.start()

    def may_evict(self, step: int) -> bool:
        """Evict guard: a local step may go once it is committed remotely (or if opted out)."""
        if self.options.evict_before_upload:
            return True
        status = self.stats.uploads.get(step)
        return status is not None and status.state == "done"

    def raise_pending(self) -> None:
        """Re-raise the first upload failure since the last call (then forget it)."""
        with self._cond:
            pending, self._error = self._error, None
        if pending is not None:
            step, exc = pending
            reason = redact(str(exc), self.options.storage_options)
            raise CheckpointError(
                f"upload of step {step} to {self.url} failed (the local copy is kept): {reason}"
            ) from exc

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued upload has finished (done or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy or not self._scanned:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"uploads to {self.url} still running after {timeout} s")
                self._cond.wait(0.1 if left is None else min(left, 0.1))

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
            with self._cond:
                left = sorted(set(self._queue) | {
                    s for s, st in self.stats.uploads.items() if st.state == "uploading"
                })  # fmt: skip
            log.warning(
                "ckpt: closing with uploads to %s unfinished after %s s (steps %s); the local "
                "copies are kept and the next manager on %s uploads them",
                self.url, self.options.close_timeout_s, left, self.directory,
            )  # fmt: skip
        finally:
            with self._cond:
                self._closed = True  # an abandoned upload may finish, but nothing new starts
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._parts.shutdown(wait=False, cancel_futures=True)
            # threads cannot be killed: each one still in a transfer is reported by name
            ours = (f"{self._names}_", f"{self._names}-")  # pools: name_N; queue, parts: name-
            mine = [t for t in threading.enumerate() if t.name.startswith(ours)]
            join_threads(mine, f"ckpt upload to {self.url}", _IDLE_EXIT_S if finished else 0.0)

    # ---- background ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed or (self._scanned and not self._queue):
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._busy = True
            step = -1
            try:
                if not self._scanned:
                    self._reconcile()
                else:
                    with self._cond:
                        step = self._queue.popleft()
                    self._upload_one(step)
            except Exception as exc:  # never let the thread die silently: report and go on
                for failed in [step] if step >= 0 else commit.steps(self.directory):
                    self._fail(failed, exc)
            except BaseException:
                with self._cond:
                    self._thread = None
                raise
            finally:
                with self._cond:
                    self._scanned = True
                    self._busy = False
                    self._cond.notify_all()

    def _fail(self, step: int, exc: BaseException) -> None:
        reason = redact(str(exc), self.options.storage_options)
        with self._cond:
            self.stats.uploads[step] = UploadStatus(step, "failed", reason)
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
            remote = _transfer(
                lambda: list_remote(self.fs, self.root),
                self.url,
                "list",
                self._policy,
                self.options.storage_options,
            )
        except Exception as exc:
            for step in local:
                self._fail(step, exc)
            return
        todo = []
        for step in local:
            listing = remote.get(step)
            if listing is not None and listing.committed and self._same_manifest(step):
                self.stats.uploads[step] = UploadStatus(step, "done")
                self._newest_verified = max(step, self._newest_verified or step)
            else:
                todo.append(step)
        with self._cond:
            for step in todo:
                if step not in self._queue:
                    self.stats.uploads.setdefault(step, UploadStatus(step))
                    self._queue.append(step)
        if todo:
            log.info(
                "ckpt: %d committed steps not yet on %s: uploading %s", len(todo), self.url, todo
            )
        self._write_status()
        if self._retain_local is not None:
            self._retain_local()

    def _rpath(self, step: int, name: str = "") -> str:
        return f"{self.root}/{_layout.step_name(step)}" + (f"/{name}" if name else "")

    def _call(self, fn: Callable[[], Any], step: int, name: str, what: str) -> Any:
        return _transfer(
            fn,
            f"{self.options.url.rstrip('/')}/{_layout.step_name(step)}/{name}",
            what,
            self._policy,
            self.options.storage_options,
        )

    def _makedirs(self, rdir: str, step: int, name: str) -> None:
        """Create ``rdir`` where the filesystem has real directories (``file://``, a local path).
        Object stores have none, and s3fs's ``makedirs`` would even create a missing bucket."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if "file" in protocols or "local" in protocols:
            self._call(lambda: self.fs.makedirs(rdir, exist_ok=True), step, name, "mkdir")

    def _remote_manifest(self, step: int) -> bytes | None:
        def get() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(self._rpath(step, fmt.MANIFEST)))
            except FileNotFoundError:
                return None

        result: bytes | None = self._call(get, step, fmt.MANIFEST, "read")
        return result

    def _same_manifest(self, step: int) -> bool:
        local = (_layout.step_dir(self.directory, step) / fmt.MANIFEST).read_bytes()
        return self._remote_manifest(step) == local

    def _upload_one(self, step: int) -> None:
        path = _layout.step_dir(self.directory, step)
        t0 = time.perf_counter()
        with self._cond:
            self.stats.uploads[step] = UploadStatus(step, "uploading")
        self._metrics.pop(step, None)  # a step saved again may carry other metrics
        self._write_status()
        try:
            with commit.reading(path):  # a shared lock: local retention cannot take it meanwhile
                raw = (path / fmt.MANIFEST).read_bytes()
                body = fmt.read_manifest(path)
                existing = self._remote_manifest(step)
                if existing is not None and not _owner.is_ckpt_manifest(existing):
                    raise CheckpointError(
                        f"{self.url}/{_layout.step_name(step)}/{fmt.MANIFEST}: was not written "
                        "by ckpt; refusing to overwrite another tool's checkpoint (give ckpt a "
                        "remote root of its own)"
                    )
                if existing != raw:
                    if existing is not None:  # a different save of this step: un-commit it first
                        self._call(
                            lambda: self.fs.rm_file(self._rpath(step, fmt.MANIFEST)),
                            step, fmt.MANIFEST, "delete",
                        )  # fmt: skip
                    futures = [
                        self._pool.submit(self._put_verified, path, step, rec)
                        for rec in body["files"]
                    ]
                    errors = [f.exception() for f in futures]
                    first = next((e for e in errors if e is not None), None)
                    if first is not None:
                        raise first
                    _faults.pause("upload_manifest")
                    rpath = self._rpath(step, fmt.MANIFEST)
                    self._makedirs(self._rpath(step), step, fmt.MANIFEST)
                    self._call(lambda: self.fs.pipe_file(rpath, raw), step, fmt.MANIFEST, "upload")
                    if self._remote_manifest(step) != raw:
                        raise CorruptCheckpointError(
                            f"{self.url}/{_layout.step_name(step)}/{fmt.MANIFEST}: read back "
                            "differs from the local manifest"
                        )
        except Exception as exc:
            self._fail(step, exc)
            return
        nbytes = sum(rec["size"] for rec in body["files"]) + len(raw)
        dt = time.perf_counter() - t0
        with self._cond:
            self.stats.uploads[step] = UploadStatus(step, "done", "", nbytes, dt)
            self.stats.uploaded_bytes += nbytes
            self.stats.upload_s += dt
            self._newest_verified = max(step, self._newest_verified or step)
        log.info("ckpt: uploaded step %d to %s (%d bytes, %.2f s)", step, self.url, nbytes, dt)
        self._write_status()
        try:
            self._retain_remote()
        except Exception as exc:  # retention failures are reported, the upload stands
            self._fail_retention(step, exc)
        if self._retain_local is not None:
            self._retain_local()

    def _put_verified(self, path: Path, step: int, rec: dict) -> None:
        # never through a symlink, at any component of the name (a symlinked directory too)
        name = rec["name"]
        local, rpath = fmt.inside(path, name), self._rpath(step, name)
        self._makedirs(rpath.rsplit("/", 1)[0], step, name)
        part = _part_bytes(rec["size"], self.options.block_bytes, self.options.threads)
        for attempt in (1, 2):
            try:
                with span("ckpt/upload"):  # in the upload pool's thread
                    vouched = self._send(local, rpath, step, rec, part)
                _faults.pause("upload")
                self._verify_remote(step, rec, vouched)
                return
            except s3put.LocalMismatchError:  # the local file itself: sending again cannot help
                raise
            except CorruptCheckpointError:
                if attempt == 2:
                    raise
                log.warning(
                    "ckpt: %s/%s/%s did not verify; uploading again",
                    self.url,
                    _layout.step_name(step),
                    name,
                )

    def _send(self, local: Path, rpath: str, step: int, rec: dict, part: int) -> bool:
        """Upload one data file; return whether the store vouched for every byte."""
        name = rec["name"]
        if self._s3:
            # the store vouches only for the bytes sent: those very bytes, as read for the
            # upload, are checked against the manifest's CRC32Cs before they go
            check = s3put.ChunkCheck(rec, str(local)) if self.options.verify == "auto" else None
            return s3put.put_file(
                self.fs, local, rpath, size=rec["size"], part_bytes=part, pool=self._parts,
                call=lambda fn, what: self._call(fn, step, name, what), check=check,
            )  # fmt: skip
        self._call(
            lambda: self.fs.put_file(
                str(local), rpath, chunksize=part, max_concurrency=self.options.threads
            ),
            step, name, "upload",
        )  # fmt: skip
        return False

    def _verify_remote(self, step: int, rec: dict, vouched: bool = False) -> None:
        """Check the stored object of ``rec``: its size; then, unless ``verify="size"`` or the
        store vouched for every byte (``verify="auto"`` on S3; its size is checked then), every
        chunk read back."""
        if vouched and self.options.verify == "auto":
            return
        rpath, name = self._rpath(step, rec["name"]), rec["name"]
        where = f"{self.url}/{_layout.step_name(step)}/{name}"
        info = self._call(lambda: self.fs.info(rpath), step, name, "stat")
        if int(info.get("size", -1)) != rec["size"]:
            raise CorruptCheckpointError(
                f"{where}: stored size {info.get('size')} != {rec['size']} bytes"
            )
        if self.options.verify == "size" or rec["size"] == 0:
            return
        chunk = rec["chunk_bytes"]
        starts = list(range(0, rec["size"], chunk))
        ends = [min(s + chunk, rec["size"]) for s in starts]
        flight = self.options.threads  # ranges in flight: bounded memory, threads chunks
        for lo in range(0, len(starts), flight):
            s_, e_ = starts[lo : lo + flight], ends[lo : lo + flight]

            def get(s_: list[int] = s_, e_: list[int] = e_) -> list[bytes]:
                return list(self.fs.cat_ranges([rpath] * len(s_), s_, e_, on_error="raise"))

            pieces = self._call(get, step, name, "read back")
            for i, piece in enumerate(pieces, start=lo):
                actual = to_hex(crc32c(piece))
                if actual != rec["crc32c"][i]:
                    raise CorruptCheckpointError(
                        f"{where}: read back chunk {i} has CRC32C {actual} != {rec['crc32c'][i]}"
                    )

    # ---- remote retention -----------------------------------------------------------------
    def _fail_retention(self, step: int, exc: Exception) -> None:
        reason = redact(str(exc), self.options.storage_options)
        log.log(
            logging.WARNING if self.options.on_error == "warn" else logging.ERROR,
            "ckpt: remote retention after step %d on %s failed: %s",
            step, self.url, reason,
        )  # fmt: skip
        with self._cond:
            if self._error is None and self.options.on_error == "raise":
                self._error = (step, exc)

    def _delete_remote(self, step: int) -> None:
        manifest = self._rpath(step, fmt.MANIFEST)

        def rm_manifest() -> None:  # the manifest goes first: the step stops being a checkpoint
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(manifest)

        def rm_rest() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._rpath(step), recursive=True)

        self._call(rm_manifest, step, fmt.MANIFEST, "delete")
        self._call(rm_rest, step, "", "delete")

    def _retain_remote(self) -> None:
        """Remote retention is ``ckpt.retention.rules.plan``, the rule of the local tier, with every
        remote step counted as restorable: a remote manifest is written only after each data
        file verified, and checking more would download the step. The newest verified upload and
        steps still queued or uploading are never deleted (the evict guard)."""
        listing = self._call(lambda: list_remote(self.fs, self.root), 0, "", "list")
        with self._cond:
            active = set(self._queue) | {
                s for s, st in self.stats.uploads.items() if st.state == "uploading"
            }
        for step, entry in sorted(listing.items()):
            if entry.foreign:
                log.warning(
                    "ckpt: leaving %s/%s alone: ckpt did not write %s",
                    self.url, _layout.step_name(step), ", ".join(entry.foreign[:5]),
                )  # fmt: skip
        listing = {s: e for s, e in listing.items() if not e.foreign}
        committed = sorted(s for s, e in listing.items() if e.committed)
        decision = rules.plan(
            committed,
            self.policy,
            is_restorable=lambda s: True,
            may_evict=lambda s: s != self._newest_verified and s not in active,
            metrics=self._step_metrics,
        )
        for step in decision.delete:
            raw = self._remote_manifest(step)
            if raw is not None and not _owner.is_ckpt_manifest(raw):
                log.warning(
                    "ckpt: leaving %s/%s alone: its manifest was not written by ckpt",
                    self.url, _layout.step_name(step),
                )  # fmt: skip
                continue
            self._delete_remote(step)
            self._metrics.pop(step, None)
            self.stats.remote_evicted.append(step)
        now = time.time()
        for step, entry in listing.items():
            if entry.committed or step in active:
                continue
            if now - entry.newest_mtime > self.options.grace_s:
                self._delete_remote(step)
                self.stats.partial_removed.append(step)
                log.info(
                    "ckpt: removed partial upload %s from %s", _layout.step_name(step), self.url
                )
        if self._s3:  # parts of a file whose uploader died mid-way (no object, still billed)
            try:
                self._abort_stale_uploads(now - self.options.grace_s, active)
            except Exception as exc:  # housekeeping (a store may not list uploads): never fatal
                reason = redact(str(exc), self.options.storage_options)
                log.warning("ckpt: stale multipart uploads on %s: %s", self.url, reason)

    def _abort_stale_uploads(self, before: float, active: set[int]) -> None:
        """Abort the multipart uploads of steps not active here, begun before ``before``."""
        stale = self._call(lambda: s3put.stale_uploads(self.fs, self.root, before), 0, "", "list")
        bucket = self.fs.split_path(self.root)[0]
        for rel, key, upload_id in stale:
            head, _, tail = rel.partition("/")
            step = _layout.step_number(head)
            if step is None or step in active or not _layout.is_data_name(tail):
                continue  # only ckpt's own data files are uploaded in parts

            def abort(k: str = key, u: str = upload_id) -> None:
                with contextlib.suppress(FileNotFoundError):  # already gone: nothing to do
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=k, UploadId=u)

            self._call(abort, step, rel.partition("/")[2], "abort")
            log.info("ckpt: aborted a stale multipart upload of %s/%s", self.url, rel)

    def _step_metrics(self, step: int) -> dict:
        """The metrics of remote ``step``: from its validated remote manifest, read once (a
        committed manifest does not change: it is the same bytes as the local one)."""
        if step not in self._metrics:
            try:
                found = self.read_manifest(step).get("metrics")
            except CorruptCheckpointError as exc:  # a bad manifest has no metric to rank by
                log.warning("ckpt: remote step %d has no readable metrics: %s", step, exc)
                found = None
            # any other failure propagates: this retention pass stops and deletes nothing more
            self._metrics[step] = dict(found) if isinstance(found, dict) else {}
        return self._metrics[step]

    def gc(self) -> None:
        """Apply remote retention and partial-upload garbage collection now."""
        self._retain_remote()

    # ---- restore from the remote ----------------------------------------------------------
    def committed_steps(self, deadline_s: float | None = None) -> list[int]:
        """Steps committed on the remote (listing only; restore verifies). ``deadline_s`` bounds
        the retries (default: ``min(30, RemoteOptions.deadline_s)``)."""
        limit = min(30.0, self.options.deadline_s) if deadline_s is None else deadline_s
        listing = _transfer(
            lambda: list_remote(self.fs, self.root),
            self.url,
            "list",
            RetryPolicy(deadline_s=limit, base_s=0.1, max_sleep_s=2.0),
            self.options.storage_options,
        )
        return sorted(s for s, e in listing.items() if e.committed)

    def read_manifest(self, step: int) -> dict:
        """The validated manifest body of remote ``step`` (``CorruptCheckpointError`` if bad)."""
        import tempfile

        raw = self._remote_manifest(step)
        if raw is None:
            raise CheckpointError(
                f"{self.url}/{_layout.step_name(step)}: no manifest (not a checkpoint)"
            )
        with tempfile.TemporaryDirectory(prefix="ckpt-manifest-") as tmp:
            Path(tmp, fmt.MANIFEST).write_bytes(raw)
            try:
                return fmt.read_manifest(tmp)
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(
                    str(exc).replace(tmp, f"{self.url}/{_layout.step_name(step)}")
                ) from None

    def download(self, step: int) -> Path:
        """Download ``step`` into ``DIR/step-N.tmp-remote-*`` (manifest checked, files fetched);
        the caller verifies the data and publishes or removes the directory."""
        tmp = self.directory / _layout.tmp_name(_layout.step_name(step), "remote")
        tmp.mkdir()
        try:
            raw = self._remote_manifest(step)
            if raw is None:
                raise CheckpointError(
                    f"{self.url}/{_layout.step_name(step)}: no manifest (not a checkpoint)"
                )
            (tmp / fmt.MANIFEST).write_bytes(raw)
            body = fmt.read_manifest(tmp)
            for rec in body["files"]:
                fmt.safe_relpath(rec["name"])
                dest = tmp / rec["name"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                rpath = self._rpath(step, rec["name"])

                def fetch(r: str = rpath, d: Path = dest) -> None:
                    if d.is_symlink():  # never write through a symlink
                        raise CheckpointError(f"{d}: download target is a symlink")
                    self.fs.get_file(r, str(d))

                self._call(fetch, step, rec["name"], "download")
        except BaseException:
            commit.remove_path(tmp)
            raise
        return tmp

    # ---- status file ------------------------------------------------------------------------
    def _write_status(self) -> None:
        with self._cond:
            if self._closed:  # a later manager owns the status file now
                return
            doc = {
                "url": self.url,
                "updated": time.time(),
                "steps": {str(s): asdict(st) for s, st in sorted(self.stats.uploads.items())},
            }
        target = self.directory / STATUS_FILE
        try:  # never into a directory that is not ckpt's yet, nor over another tool's file
            if not _owner.owned(self.directory) or (
                os.path.lexists(target) and not _owner.is_ours(target)
            ):
                return
        except ValueError:  # a malformed marker: the writer refuses it (ckpt._owner)
            return
        tmp = self.directory / _layout.status_tmp_name()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:  # never through a symlink planted under the temp's name, never blocked by a FIFO
            fd = os.open(tmp, flags, 0o644)
        except OSError as exc:
            log.warning("ckpt: cannot write %s (leaving %s alone): %s", target, tmp, exc)
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("ckpt: cannot write %s: %s is not a regular file", target, tmp)
                return
            with os.fdopen(os.dup(fd), "w") as f:
                f.write(json.dumps(doc))
        except OSError as exc:  # the status mirror is informational; never fail an upload for it
            log.warning("ckpt: cannot write %s: %s", target, exc)
            commit.remove_path(tmp)
            return
        finally:
            os.close(fd)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("ckpt: cannot write %s: %s", target, exc)
            commit.remove_path(tmp)
