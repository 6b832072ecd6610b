"""``CheckpointManager``: two-phase asynchronous saves into a local directory, verified restores.

``save`` flattens the state, stages its arrays into a reused staging buffer (the only blocking
work) and returns a ``SaveHandle``; a background thread writes the data file with per-chunk
CRC32C, writes the manifest, commits ``step-N`` atomically, updates ``latest``, calls the
``on_commit`` listeners and applies retention. Background errors are re-raised by the next
``save``/``wait``.

Extension points: ``on_commit`` listeners ``(step, path)`` run in the background after each local
commit; ``evict_guards`` ``(step) -> bool`` may veto the eviction of a step (e.g. until uploaded).
With ``remote=`` (``ckpt.remote``), committed steps are uploaded in the background, local steps
are kept until uploaded, ``steps``/``latest_step`` list the remote steps too, and ``restore``
falls back to the remote copy. Retention is ``ckpt.retention.rules.plan`` with a ``ckpt.policy``
object built from ``keep_last``/``keep_every``/``keep_best`` (the rule ``ckpt gc`` uses).

Save policy: ``should_save(step)`` (``save_interval_steps``, ``save_on_steps``, preemption).
Preemption (``save_on_preemption=True``, ``ckpt.preemption``): ``preempted``,
``reached_preemption(step)`` and ``save_and_exit(step, state)``; see docs/guides/preemption.md.
"""

from __future__ import annotations

import collections
import json
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ckpt import _faults, _layout, _owner
from ckpt import format as fmt
from ckpt._paths import local_path
from ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DcpCheckpointError,
    LockedError,
    RemoteCheckpointError,
)
from ckpt.policy import KeepBest, Policy, from_options
from ckpt.preemption import PREEMPTED_EXIT_CODE, Preemption, PreemptionOptions
from ckpt.restoring.reader import MapLocation, RestoreStats, read_checkpoint
from ckpt.retention import rules
from ckpt.retention.retainer import Retainer
from ckpt.saving import commit
from ckpt.saving import plan as saveplan
from ckpt.saving.flatten import RNG_KEY, Leaf, flatten, rng_state
from ckpt.saving.pool import Buffer, PinnedPool, PoolOptions
from feedpipe.io.trace import span

if TYPE_CHECKING:
    from ckpt.remote import RemoteOptions, RemoteStats, RemoteTier

__all__ = [
    "CheckpointManager",
    "ManagerStats",
    "PoolOptions",
    "RestoreStats",
    "SaveHandle",
    "SaveStats",
    "WriteOptions",
]

log = logging.getLogger("ckpt")
_RELISTS = 20  # restore: listings tried while the steps listed vanish (concurrent retention)


@dataclass(frozen=True)
class WriteOptions:
    """How the background phase writes: writer threads, checksum chunk size, lock wait."""

    threads: int = 2
    chunk_bytes: int = fmt.CHUNK_BYTES
    lock_timeout_s: float = 10.0


@dataclass
class SaveStats:
    """Timings of one save. ``blocked_s`` is what the training loop paid; ``durable_s`` runs from
    the ``save`` call to the committed, fsynced ``step-N``."""

    step: int
    nbytes: int = 0
    blocked_s: float = 0.0
    backpressure_s: float = 0.0
    stage_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    durable_s: float = 0.0


@dataclass
class ManagerStats:
    """Counters over the manager's life plus the last save and restore."""

    saves: int = 0
    failed: int = 0
    backpressure_waits: int = 0
    backpressure_s: float = 0.0
    evicted: list[int] = field(default_factory=list)
    last_save: SaveStats | None = None
    last_restore: RestoreStats | None = None
    remote: RemoteStats | None = None


class SaveHandle:
    """A save in flight: ``done()``, ``result(timeout)`` (the committed path, or the error)."""

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self.path: Path | None = None
        self.error: BaseException | None = None
        self._event = threading.Event()

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> Path:
        """Wait until committed; return the step directory or raise the background error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout} s")
        if self.error is not None:
            raise CheckpointError(f"save of step {self.step} failed: {self.error}") from self.error
        assert self.path is not None
        return self.path


@dataclass
class _Job:
    handle: SaveHandle
    buf: Buffer
    body: dict
    t0: float


class CheckpointManager:
    """Asynchronous checkpoints of step ``N`` into ``directory/step-N`` (see module docstring).

    ``directory`` is local (a ``file://`` URL is accepted); any other URL raises ``ValueError``:
    give it as ``remote=`` instead.

    Retention (``ckpt.policy``; a step is kept if any policy keeps it, only restorable steps
    count, the newest restorable step is always kept, ``None`` turns a policy off and with
    every policy off nothing is deleted): ``keep_last``: the newest N steps; ``keep_every``:
    every multiple of N, for good; ``keep_best``: ``(metric, k, "min" | "max")`` or a
    ``KeepBest``, the k best steps by a metric given to ``save(metrics=)``.

    ``pool``: staging pool sizing (call ``reserve`` or give ``pool.budget_bytes`` to keep
    allocation out of the first save). ``write``: background writer settings. ``remote``: a URL
    or ``RemoteOptions`` to upload every committed step to; ``keep_last_remote``: the remote
    tier's retention, an int (that many newest steps), a ``ckpt.policy`` object or ``None``.

    ``save_interval_steps``/``save_on_steps``: what ``should_save`` answers.
    ``save_on_preemption``: ``True`` or ``PreemptionOptions`` to handle SIGTERM and SIGUSR1
    (``ckpt.preemption``).
    """

    PREEMPTED_EXIT_CODE = PREEMPTED_EXIT_CODE

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int | None = 3,
        *,
        pool: PoolOptions | None = None,
        write: WriteOptions | None = None,
        remote: str | RemoteOptions | None = None,
        keep_last_remote: int | Policy | None = 10,
        keep_every: int | None = None,
        keep_best: KeepBest | tuple[str, int, str] | None = None,
        save_interval_steps: int | None = None,
        save_on_steps: Any = (),
        save_on_preemption: bool | PreemptionOptions = False,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError("keep_last must be >= 1 or None")
        self.policy: Policy | None = from_options(keep_last, keep_every, keep_best)
        if save_interval_steps is not None:
            save_interval_steps = _step(save_interval_steps, "save_interval_steps", low=1)
        self.save_interval_steps = save_interval_steps
        self.save_on_steps = frozenset(_step_list(save_on_steps))
        self.directory = local_path(
            directory,
            "CheckpointManager",
            "give a local directory and the URL as remote=, e.g. "
            "CheckpointManager('/local/ckpt', remote='s3://bucket/run')",
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.write_options = write or WriteOptions()
        self.pool = PinnedPool(pool)
        self._stager = saveplan.Stager()
        self.stats = ManagerStats()
        self.on_commit: list[Callable[[int, Path], None]] = []
        self.evict_guards: list[Callable[[int], bool]] = []
        self._lock = commit.WriterLock(self.directory)
        self._mutex = threading.Lock()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._inflight: list[SaveHandle] = []
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._newest_verified: int | None = None
        self._retainer = Retainer(self.directory, self.evict_guards, self.stats.evicted)
        self._checked = self._retainer.checked  # step -> (dir inode, restorable)
        self._last_saved: SaveHandle | None = None  # the newest save asked for
        self._preemption: Preemption | None = None
        self.remote: RemoteTier | None = None
        if remote is not None:
            from ckpt.remote import RemoteOptions, RemoteTier

            options = RemoteOptions(remote) if isinstance(remote, str) else remote
            self.remote = RemoteTier(
                self.directory, options, keep_last_remote, retain_local=self._retain_if_writer
            )
            self.stats.remote = self.remote.stats
            self.on_commit.append(self.remote.enqueue)
            self.evict_guards.append(self.remote.may_evict)
        if pool is not None and pool.budget_bytes is not None:
            self.pool.reserve(self.pool.buffer_bytes)
        if save_on_preemption:  # last: nothing after it may fail and leave handlers installed
            given = save_on_preemption
            try:
                self._preemption = Preemption(
                    given if isinstance(given, PreemptionOptions) else None
                )
            except BaseException:
                if self.remote is not None:
                    self.remote.close()
                raise

    # ---- saving -------------------------------------------------------------------------
    def reserve(self, state_or_nbytes: Any) -> int:
        """Allocate the staging buffers now for a state like this one (or that many bytes)."""
        if isinstance(state_or_nbytes, int):
            nbytes = state_or_nbytes
        else:
            leaves: list[Leaf] = []
            flatten(state_or_nbytes, leaves)
            nbytes = self._stager.plan(leaves).nbytes
        self.pool.reserve(nbytes)
        return nbytes

    def ensure_writer(self) -> None:
        """Become the directory's writer, once: claim it (``ckpt._owner.claim_root``: a directory
        holding entries ckpt did not write is refused, naming them, and nothing is written),
        take its writer lock, record the retention policy (``ckpt gc`` applies it), remove the
        leftovers of interrupted saves and catch up on retention. ``save`` and a restore that
        publishes a download call it; so does ``ckpt.dcp``'s coordinator before any rank
        writes."""
        if not self._lock.held:
            _owner.claim_root(self.directory)
            self._lock.acquire(self.write_options.lock_timeout_s)
            try:
                rules.record(self.directory, self.policy)
            except BaseException:
                self._lock.release()
                raise
            removed = commit.remove_leftovers(self.directory)
            if removed:
                log.info(
                    "ckpt: removed %d leftovers of interrupted saves in %s",
                    len(removed),
                    self.directory,
                )
            if self._newest_verified is not None:
                self._retain()  # catch up on retention interrupted by a crash, before adding

    def _raise_pending(self) -> None:
        with self._mutex:
            pending, self._error = self._error, None
        if pending is not None:
            step, exc = pending
            raise CheckpointError(
                f"{self.directory}: background save of step {step} failed: {exc}"
            ) from exc
        if self.remote is not None:
            self.remote.raise_pending()

    def save(
        self,
        step: int,
        state: Any,
        *,
        rng: bool = False,
        metadata: dict | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` (blocking only for the copy into the staging pool) and persist it
        in the background as ``step-N``. ``rng=True`` also saves the RNG states; ``metadata`` is
        a JSON-able dict and ``metrics`` a dict of finite numbers (``ckpt.format.check_metrics``,
        what ``keep_best`` ranks by), both stored in the manifest. Bad ``metrics`` or
        ``metadata`` raise ``ValueError`` before anything is staged."""
        index = _index(step)  # should_save's steps: a NumPy int too, nothing beyond 2**53
        if index is None or not 0 <= index <= _MAX_STEP:
            kind = type(step).__name__
            raise ValueError(
                f"save: step must be a non-negative int up to 2**53, got {step!r} ({kind})"
            )
        step = index
        if metrics is not None:
            metrics = fmt.check_metrics(metrics)
        if metadata is not None:
            _check_json(metadata)
        self._raise_pending()
        self.ensure_writer()
        t0 = time.perf_counter()
        stats = SaveStats(step)
        leaves: list[Leaf] = []
        if rng:
            if not isinstance(state, dict):
                raise ValueError("rng=True needs a dict state (RNG states go under '__rng__')")
            state = {**state, RNG_KEY: rng_state()}
        tree = flatten(state, leaves)
        plan = self._stager.plan(leaves)  # the last save's plan when the leaves match it
        entries, nbytes = list(plan.entries), plan.nbytes  # entries are never modified
        buf, stats.backpressure_s = self.pool.acquire(nbytes)
        try:
            s0 = time.perf_counter()
            _faults.pause("stage")
            with span("ckpt/stage"):
                plan.stage(leaves, buf)
            stats.stage_s = time.perf_counter() - s0
        except BaseException:
            self.pool.release(buf)
            raise
        stats.nbytes = nbytes
        stats.blocked_s = time.perf_counter() - t0
        body = fmt.new_manifest(
            step=step,
            created=time.time(),
            nbytes=nbytes,
            tree=tree,
            entries=entries,
            files=[],
            metadata=metadata,
            metrics=metrics,
        )
        handle = SaveHandle(step, stats)
        with self._mutex:
            self.stats.saves += 1
            if stats.backpressure_s:
                self.stats.backpressure_waits += 1
                self.stats.backpressure_s += stats.backpressure_s
            self.stats.last_save = stats
            self._jobs.append(_Job(handle, buf, body, t0))
            self._inflight.append(handle)
            self._last_saved = handle
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._persist_loop, name="ckpt-persist", daemon=False
                )
                self._thread.start()
        return handle

    def _persist_loop(self) -> None:
        while True:
            with self._mutex:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            self._persist(job)

    def _persist(self, job: _Job) -> None:
        handle, stats, step = job.handle, job.handle.stats, job.handle.step
        released = False
        tmp: Path | None = None
        try:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.write_options.threads, thread_name_prefix="ckpt-write"
                )
            w0 = time.perf_counter()
            tmp = commit.make_tmp(self.directory, step)
            data = job.buf.view()[: job.body["nbytes"]]
            rec = fmt.write_file(
                tmp / _layout.DATA_FILE, data, self._executor, self.write_options.chunk_bytes
            )
            self.pool.release(job.buf)
            released = True
            stats.write_s = time.perf_counter() - w0
            c0 = time.perf_counter()
            job.body["files"] = [rec]
            fmt.write_manifest(tmp, job.body)
            with span("ckpt/commit"):
                handle.path = commit.publish(tmp, self.directory, step)
            tmp = None
            commit.write_latest(self.directory, step)
            stats.commit_s = time.perf_counter() - c0
            stats.durable_s = time.perf_counter() - job.t0
            self._newest_verified = max(step, self._newest_verified or step)
            self._mark_good(step, handle.path)
            for listener in list(self.on_commit):
                listener(step, handle.path)
            self._retain()
        except BaseException as failure:
            exc: BaseException = failure
            if handle.path is not None:  # committed; an on_commit listener or retention failed
                exc = CheckpointError(
                    f"step {step} was committed to {handle.path}, but a post-commit action "
                    f"failed: {failure!r}"
                )
                exc.__cause__ = failure
            handle.error = exc
            with self._mutex:
                self.stats.failed += 1
                if self._error is None:
                    self._error = (step, exc)
            log.error("ckpt: save of step %d in %s failed: %s", step, self.directory, exc)
        finally:
            if not released:
                self.pool.release(job.buf)
            if tmp is not None:
                commit.remove_path(tmp)
            with self._mutex:
                if handle in self._inflight:
                    self._inflight.remove(handle)
            handle._event.set()

    def wait(self, timeout: float | None = None, *, uploads: bool = False) -> None:
        """Wait for every save in flight (and, with ``uploads=True``, every upload); re-raise the
        first background error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._mutex:
                pending = list(self._inflight)
            if not pending:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pending[0]._event.wait(left):
                raise TimeoutError(f"{self.directory}: saves still running after {timeout} s")
        if uploads and self.remote is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.remote.wait(left)
        self._raise_pending()

    # ---- retention ----------------------------------------------------------------------
    def _retain(self, strict: bool = False) -> None:
        """Apply retention (``ckpt.retention.retainer.Retainer.retain``) with the current policy."""
        self._retainer.retain(self.policy, strict)

    def _mark_good(self, step: int, path: Path) -> None:
        self._retainer.mark_good(step, path)

    def _retain_if_writer(self) -> None:
        if self._lock.held:
            self._retain()

    def adopt(self, step: int) -> None:
        """Run the post-commit actions (``on_commit`` listeners such as the upload, retention)
        for ``step``, committed into this directory by another writer such as ``ckpt.dcp``."""
        self.ensure_writer()
        path = _layout.step_dir(self.directory, step)
        if not (path / fmt.MANIFEST).is_file():
            raise CheckpointError(f"{path}: not a committed checkpoint")
        self._newest_verified = max(step, self._newest_verified or step)
        self._mark_good(step, path)
        for listener in list(self.on_commit):
            listener(step, path)
        self._retain()

    def gc(self) -> list[int]:
        """Apply retention now (taking the writer lock); returns the steps evicted."""
        self.ensure_writer()
        before = len(self.stats.evicted)
        self._retain(strict=True)
        return self.stats.evicted[before:]

    # ---- reading ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending: the local ``step-N`` directories and, with a remote tier,
        the steps committed there (listing only; ``restore`` verifies). Raises
        ``CheckpointError`` if the remote cannot be listed: a step there may be the newest."""
        return sorted(set(commit.steps(self.directory)) | self._remote_steps(strict=True))

    def latest_step(self) -> int | None:
        """The newest committed step, local or remote (see ``steps``), or ``None``."""
        found = self.steps()
        return found[-1] if found else None

    def metadata(self, step: int) -> dict:
        """The ``metadata`` dict given to ``save`` for ``step`` (read from the local manifest,
        else from the remote's); raises ``CheckpointError`` if the step is not found."""
        meta = self._manifest(step).get("metadata")
        return dict(meta) if isinstance(meta, dict) else {}

    def metrics(self, step: int) -> dict[str, float]:
        """The ``metrics`` given to ``save`` for ``step`` (``{}`` if none), read like
        ``metadata``: from the validated local manifest, else from the remote's."""
        found = self._manifest(step).get("metrics")
        return dict(found) if isinstance(found, dict) else {}

    def _manifest(self, step: int) -> dict:
        path = _layout.step_dir(self.directory, step)
        if not (path / fmt.MANIFEST).is_file() and step in self._remote_steps():
            assert self.remote is not None
            return self.remote.read_manifest(step)
        with commit.reading(path):
            return fmt.read_manifest(path)

    # ---- save policy and preemption -------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save ``step``: a multiple of ``save_interval_steps``, one of
        ``save_on_steps``, or the step a preemption was agreed on (``reached_preemption``; with
        several ranks, call it on every rank for the same steps). ``step`` is an int from 0 to
        ``2**53`` (``ValueError`` otherwise)."""
        step = _step(step, "should_save: step")
        if self.reached_preemption(step):
            return True
        if self.save_interval_steps is not None and step % self.save_interval_steps == 0:
            return True
        return step in self.save_on_steps

    @property
    def preempted(self) -> bool:
        """Whether this process received a preemption signal (or ``notify_preemption``);
        local, no collective. ``reached_preemption`` is the decision all ranks share."""
        return self._preemption is not None and self._preemption.signalled is not None

    def reached_preemption(self, step: int) -> bool:
        """Whether to save ``step`` and exit now, the same answer on every rank (one
        ``all_reduce`` every ``PreemptionOptions.sync_every`` steps with several ranks; see
        ``ckpt.preemption``). Always ``False`` without ``save_on_preemption``."""
        return self._preemption is not None and self._preemption.reached(step)

    def notify_preemption(self) -> None:
        """Record a preemption notice that did not come as a signal (a cloud provider's
        notice): the hook for such watchers, callable from any thread."""
        if self._preemption is None:
            raise CheckpointError(f"{self.directory}: construct with save_on_preemption=True")
        self._preemption.notify()

    def save_and_exit(
        self,
        step: int,
        state: Any,
        *,
        rng: bool = False,
        metadata: dict | None = None,
        metrics: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> NoReturn:
        """Save ``step`` (unless it was the last step saved and that save has not failed), wait
        until it is committed locally and, with a remote tier, uploaded, within ``timeout`` (default
        ``PreemptionOptions.deadline_s``), close the manager and raise
        ``SystemExit(PREEMPTED_EXIT_CODE)``. A save that fails or misses the deadline raises
        its error instead (exit status 1); the steps committed before stay intact."""
        options = self._preemption.options if self._preemption else PreemptionOptions()
        limit = options.deadline_s if timeout is None else timeout
        if not 0 < limit < float("inf"):  # checked before saving: inf overflows the waits
            raise ValueError(f"save_and_exit: timeout must be a finite number > 0, got {limit!r}")
        deadline = time.monotonic() + limit
        last = self._last_saved
        if last is None or last.step != step or last.error is not None:  # a failed save: again
            last = self.save(step, state, rng=rng, metadata=metadata, metrics=metrics)
        self.wait(max(0.0, deadline - time.monotonic()), uploads=True)
        last.result(0)  # never exit as "committed" unless this save committed
        log.warning(
            "ckpt: step %d is committed%s; exiting with status %d",
            step, " and uploaded" if self.remote is not None else "", options.exit_code,
        )  # fmt: skip
        if self._preemption is not None:  # from here on a SIGTERM exits with the same status
            self._preemption.close(options.exit_code)
        self.close()
        raise SystemExit(options.exit_code)

    def restore(
        self,
        step: int | None = None,
        into: Any = None,
        map_location: MapLocation = None,
        mmap: bool = False,
        verify: bool = True,
        *,
        strict: bool = True,
    ) -> Any:
        """Load step ``step`` (default: the newest that verifies, falling back past corrupt ones
        with a warning) and return its nested state; with ``into``, also load it into those
        objects (``load_state_dict``, in-place tensor copies, RNG states), all or nothing
        (``ckpt.restore_plan``). ``strict``: as torch's ``load_state_dict``, keys of ``into``
        not saved and saved keys ``into`` lacks are an error; with ``strict=False`` they are
        skipped and listed in ``stats.last_restore.incompatible_keys``. ``verify=False`` skips
        checksums (sizes are still checked); ``mmap=True`` maps data files lazily."""
        with self._mutex:
            busy = bool(self._inflight)
        if busy:
            self.wait()
        skipped: list[tuple[int, str]] = []
        remote = self._remote_steps(strict=step is None)  # unlisted, a newer step would be missed
        # re-list while a step vanishes under us: another manager's retention deleted it after
        # the listing, so a newer step exists; only a writer that deletes every listed step
        # before this reader can open it, _RELISTS times in a row, makes this give up
        for _attempt in range(_RELISTS):
            vanished = False
            local = set(commit.steps(self.directory))
            candidates = [step] if step is not None else sorted(local | remote, reverse=True)
            for s in candidates:
                if any(s == done for done, _ in skipped):
                    continue
                path = _layout.step_dir(self.directory, s)
                try:
                    if s not in local and s in remote:
                        state, stats = self._restore_remote(
                            s, map_location, mmap, into, strict=strict
                        )
                    else:
                        try:
                            with commit.reading(path):
                                state, _, stats = read_checkpoint(
                                    path,
                                    map_location=map_location,
                                    mmap=mmap,
                                    verify=verify,
                                    into=into,
                                    strict=strict,
                                )
                        except CorruptCheckpointError as exc:
                            if s not in remote:
                                raise
                            log.warning("ckpt: step %d: %s; fetching the remote copy", s, exc)
                            state, stats = self._restore_remote(
                                s, map_location, mmap, into, strict=strict
                            )
                except CorruptCheckpointError as exc:
                    if step is not None:
                        raise
                    log.warning("ckpt: skipping step %d: %s", s, exc)
                    skipped.append((s, str(exc)))
                    continue
                except DcpCheckpointError:
                    raise  # not corrupt: never fall back to an older step because of it
                except CheckpointError as exc:
                    gone = not path.is_dir() if s in local else s not in self._remote_steps()
                    if step is not None or not gone:
                        raise  # only corruption falls back; a step deleted under us is re-listed
                    log.warning("ckpt: step %d vanished while restoring (%s); re-listing", s, exc)
                    vanished = True
                    continue
                stats.skipped = skipped
                self.stats.last_restore = stats
                if verify:
                    self._newest_verified = max(s, self._newest_verified or s)
                    self._mark_good(s, path)
                log.info(
                    "ckpt: restored step %d (%d bytes, read %.3f s, checksums %.3f s)",
                    s, stats.nbytes, stats.read_s, stats.verify_s,
                )  # fmt: skip
                return state
            if not vanished:
                break
        detail = "; ".join(f"step {s}: {why}" for s, why in skipped) or "no committed steps"
        if vanished:
            detail = (
                f"every listed step was deleted before it could be opened, {_RELISTS} times in "
                "a row: another manager's retention deletes steps faster than this reader opens "
                "them"
            )
        raise CheckpointError(f"{self.directory}: no valid checkpoint to restore ({detail})")

    def _remote_steps(self, strict: bool = False) -> set[int]:
        """Steps committed on the remote; a failed listing raises if ``strict``, else it is
        logged (the remote is then only a fallback that is unavailable)."""
        if self.remote is None:
            return set()
        try:
            return set(self.remote.committed_steps())
        except Exception as exc:
            if strict:
                raise CheckpointError(
                    f"cannot list the remote tier {self.remote.url} of {self.directory}: {exc}"
                ) from exc
            log.warning("ckpt: cannot list %s: %s", self.remote.url, exc)
        return set()

    def fetch(self, step: int) -> Path:
        """Make sure ``DIR/step-N`` holds a verified copy of ``step``, downloading it from the
        remote when the local copy is missing or fails verification; return its path. Meant for
        checkpoints read by other means, such as ``ckpt.dcp.CkptStorageReader``."""
        path = _layout.step_dir(self.directory, step)
        try:
            with commit.reading(path):
                for rec in fmt.read_manifest(path)["files"]:
                    fmt.verify_file(path, rec)
            return path
        except CheckpointError as exc:
            if self.remote is None:
                raise
            log.warning("ckpt: step %d: %s; fetching the remote copy", step, exc)
        self.ensure_writer()  # publishing the download needs the writer lock
        tmp = self._download(step, CheckpointError)
        try:
            for rec in fmt.read_manifest(tmp)["files"]:
                fmt.verify_file(tmp, rec)
            self._publish_download(tmp, step)
        finally:
            commit.remove_path(tmp)
        return path

    def _download(self, step: int, error: type[CheckpointError]) -> Path:
        """Download remote ``step`` into a temp dir here. A failure that outlived the retries
        (the copy may still be there) is a ``CheckpointError``, never a reason to fall back to
        an older step; other failures (a missing or forbidden object) become ``error``."""
        assert self.remote is not None
        try:
            return self.remote.download(step)
        except RemoteCheckpointError as exc:
            if not exc.permanent:
                raise CheckpointError(
                    f"step {step}: cannot download the remote copy: {exc}"
                ) from exc
            raise error(f"step {step}: remote copy unavailable: {exc}") from exc
        except CheckpointError:
            raise
        except Exception as exc:
            raise error(f"step {step}: remote copy unavailable: {exc}") from exc

    def _publish_download(self, tmp: Path, step: int) -> None:
        """Commit a verified download as local ``step-N``, known uploaded (writer lock held)."""
        assert self.remote is not None
        commit.publish(tmp, self.directory, step)
        if step >= max(commit.steps(self.directory), default=step):
            commit.write_latest(self.directory, step)
        with self._mutex:
            self.remote.stats.uploads.setdefault(step, _done_status(step))

    def _restore_remote(
        self,
        step: int,
        map_location: MapLocation,
        mmap: bool,
        into: Any = None,
        strict: bool = True,
    ) -> tuple[Any, RestoreStats]:
        """Download ``step`` to a temp dir, verify every checksum, load, keep it as ``step-N``."""
        assert self.remote is not None
        try:
            self.ensure_writer()  # to publish the downloaded copy; not required to restore
        except LockedError:
            pass
        tmp = self._download(step, CorruptCheckpointError)
        try:
            state, _, stats = read_checkpoint(
                tmp, map_location=map_location, mmap=mmap, into=into, strict=strict
            )
            stats.path = f"{self.remote.url}/{_layout.step_name(step)}"
            if self._lock.held:
                self._publish_download(tmp, step)
        finally:
            commit.remove_path(tmp)
        return state, stats

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for saves in flight (and uploads, up to ``RemoteOptions.close_timeout_s``),
        release the writer lock and the writer threads."""
        try:
            try:
                self.wait()
            finally:  # a failed save is raised, but the upload threads stop all the same
                if self.remote is not None:
                    self.remote.close()
            if self.remote is not None:
                self.remote.raise_pending()
        finally:
            if self._preemption is not None:
                self._preemption.close()
            self._lock.release()
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_json(metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        json.dumps(metadata, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata is not JSON-able: {exc}") from None


def _index(n: Any) -> int | None:
    """``n`` as an int if it is an integer (a NumPy integer too, not a bool), else ``None``."""
    if isinstance(n, bool) or type(n).__name__ == "bool_":
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


_MAX_STEP = 2**53  # the largest step a JSON reader holds exactly; anything beyond means nothing


def _step(n: Any, what: str, low: int = 0) -> int:
    """``n`` as an int from ``low`` to ``_MAX_STEP`` (a NumPy integer too; not a bool or a
    float), else ``ValueError`` naming ``what`` and the value."""
    step = _index(n)
    if step is None or not low <= step <= _MAX_STEP:
        kind = type(n).__name__
        raise ValueError(f"{what} must be an int from {low} to 2**53, got {n!r} ({kind})")
    return step


def _step_list(steps: Any) -> list[int]:
    return [_step(s, "save_on_steps: each step") for s in list(steps if steps is not None else ())]


def _done_status(step: int) -> Any:
    from ckpt.remote import UploadStatus

    return UploadStatus(step, "done")
