"""``CheckpointManager``: two-phase asynchronous saves into a local directory, verified restores.

``save`` flattens the state, stages its arrays into a reused staging buffer (the only blocking
work) and returns a ``SaveHandle``; a background thread writes the data file with per-chunk
CRC32C, writes the manifest, commits ``step-N`` atomically, updates ``latest``, calls the
``on_commit`` listeners and applies retention. Background errors are re-raised by the next
``save``/``wait``.

The manager owns one object per concern: the save pipeline (``ckpt.saving.pipeline``: staging,
background write and commit), the restorer (``ckpt.restoring.restorer``: which step, from which
tier), the retention pass (``ckpt.retention.retainer``) and, with ``save_on_preemption``, the
preemption hook (``ckpt.preemption``).

Extension points: ``on_commit`` listeners ``(step, path)`` run in the background after each local
commit; ``evict_guards`` ``(step) -> bool`` may veto the eviction of a step (e.g. until uploaded).
With ``remote=`` (``ckpt.remote``), committed steps are uploaded in the background, local steps
are kept until uploaded, ``steps``/``latest_step`` list the remote steps too, and ``restore``
falls back to the remote copy. With ``memory=`` (``ckpt.tiers.memory``), every save lands in a
tier in shared memory that outlives the process, every Nth is persisted from it to the directory,
and ``restore`` reads the memory tier first. Retention is ``ckpt.retention.rules.plan`` with a
``ckpt.policy`` object built from ``keep_last``/``keep_every``/``keep_best`` (``ckpt gc``'s rule).

Save policy: ``should_save(step)`` (``save_interval_steps``, ``"auto"``: ``ckpt.interval``,
``save_on_steps``, preemption).
Preemption (``save_on_preemption=True``, ``ckpt.preemption``): ``preempted``,
``reached_preemption(step)`` and ``save_and_exit(step, state)``; see docs/guides/preemption.md.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ckpt import _layout
from ckpt import format as fmt
from ckpt._paths import local_path
from ckpt.errors import CheckpointError
from ckpt.interval import AutoInterval, IntervalReport, parse, schedule
from ckpt.policy import KeepBest, Policy, from_options
from ckpt.preemption import PREEMPTED_EXIT_CODE, Preemption, PreemptionOptions
from ckpt.restoring.reader import MapLocation, RestoreStats
from ckpt.restoring.restorer import Restorer, RestoreRequest
from ckpt.retention.retainer import Retainer
from ckpt.saving import commit
from ckpt.saving.flatten import RNG_KEY, rng_state
from ckpt.saving.overlap import Overlap
from ckpt.saving.pipeline import SaveHandle, SavePipeline, SaveStats, WriteOptions
from ckpt.saving.pool import PinnedPool, PoolOptions
from ckpt.takeover import Takeover
from ckpt.tiers.memory import MemoryTier, remote_hooks

if TYPE_CHECKING:
    from ckpt.remote import RemoteOptions, RemoteStats, RemoteTier
    from ckpt.tiers.memory import MemoryStats
    from ckpt.tiers.memory_options import MemoryOptions

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
    memory: MemoryStats | None = None


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

    ``save_interval_steps``/``save_on_steps``: what ``should_save`` answers (``"auto"`` and
    ``mtbf`` seconds: Young-Daly, ``ckpt.interval``, reported by ``interval()``).
    ``save_on_preemption``: ``True`` or ``PreemptionOptions`` to handle SIGTERM and SIGUSR1
    (``ckpt.preemption``). ``memory``: ``True`` or ``MemoryOptions`` (docs/tiers.md).
    ``overlap=True``: ``save`` returns with the device-to-host copies queued; what waits for
    them, and ``editing()`` for edits by hand: ``ckpt.saving.overlap``, docs/overlap.md.
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
        save_interval_steps: int | str | AutoInterval | None = None,
        save_on_steps: Any = (),
        save_on_preemption: bool | PreemptionOptions = False,
        memory: bool | MemoryOptions | None = None,
        overlap: bool = False,
        mtbf: float | None = None,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError("keep_last must be >= 1 or None")
        self.policy: Policy | None = from_options(keep_last, keep_every, keep_best)
        auto = parse(save_interval_steps, mtbf)  # "auto", an AutoInterval, else None
        fixed = None if auto is not None else save_interval_steps
        self.save_interval_steps = None if fixed is None else _step(fixed, "save_interval_steps", 1)
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
        self.stats = ManagerStats()
        self.on_commit: list[Callable[[int, Path], None]] = []
        self.evict_guards: list[Callable[[int], bool]] = []
        self._every = schedule(
            auto, lambda: self.save_interval_steps, self.directory, self.on_commit
        )
        self._takeover = Takeover(self.directory, on_take=self._every.begin)
        self._mutex = threading.Lock()
        self._newest_verified: int | None = None
        self._retainer = Retainer(self.directory, self.evict_guards, self.stats.evicted)
        self.memory = MemoryTier.attach(self.directory, memory, self._committed, self.stats)
        saves_to, saved = self.memory.route() if self.memory else (self.directory, self._committed)
        self._saves = SavePipeline(saves_to, self.pool, self.write_options, self.stats, saved)
        self._overlap = Overlap(enabled=overlap)
        self.remote: RemoteTier | None = None
        if remote is not None:
            self.remote = self._attach_remote(remote, keep_last_remote)
        writer, mem = self._takeover.lock, (self.memory.directory if self.memory else None)
        self._restorer = Restorer(
            self.directory, self.remote, writer, self.ensure_writer, self._downloaded, shm=mem
        )
        if pool is not None and pool.budget_bytes is not None:
            self.pool.reserve(self.pool.buffer_bytes)
        # last: nothing after it may fail and leave handlers installed
        self._preemption = self._hook_preemption(save_on_preemption) if save_on_preemption else None

    def _attach_remote(
        self, remote: str | RemoteOptions, keep_last_remote: int | Policy | None
    ) -> RemoteTier:
        """The remote tier: uploads each commit, vetoes evicting a step not uploaded yet."""
        from ckpt.remote import RemoteOptions, RemoteTier

        options = RemoteOptions(remote) if isinstance(remote, str) else remote
        tier = RemoteTier(
            self.directory, options, keep_last_remote, retain_local=self._retain_if_writer
        )
        self.stats.remote = tier.stats
        enqueue, guard = remote_hooks(self.memory, tier.enqueue, tier.may_evict)  # remote_every
        self.on_commit.append(enqueue)
        self.evict_guards.append(guard)
        return tier

    def _hook_preemption(self, given: bool | PreemptionOptions) -> Preemption:
        """Install the preemption signal handlers (the remote tier stops if that fails)."""
        try:
            return Preemption(given if isinstance(given, PreemptionOptions) else None)
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
            nbytes = self._saves.plan(state_or_nbytes).nbytes
        self.pool.reserve(nbytes)
        return nbytes

    def ensure_writer(self) -> None:
        """Become the directory's writer, once (``ckpt.takeover``: claim it, take its writer
        lock, record the retention policy, finish what a crashed writer left, catch up on
        retention). ``save`` and a restore that publishes a download call it; so does
        ``ckpt.dcp``'s coordinator before any rank writes."""
        self._takeover.take(
            self.policy, self.write_options.lock_timeout_s, self._newest_verified, self._retain
        )

    def _raise_pending(self) -> None:
        self._saves.raise_pending()
        if self.remote is not None:
            self.remote.raise_pending()

    def save(
        self,
        step: int,
        state: Any,
        *,
        rng: bool = False,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` (blocking only for the copy into the staging pool) and persist it
        in the background as ``step-N``. ``rng=True`` also saves the RNG states; ``metadata`` is
        a JSON-able dict and ``metrics`` a dict of finite numbers (``ckpt.format.check_metrics``,
        what ``keep_best`` ranks by), both stored in the manifest. Bad ``metrics`` or
        ``metadata`` raise ``ValueError`` before anything is staged."""
        index = _step(step, "save: step")  # should_save's steps: a NumPy int too
        if metrics is not None:
            metrics = fmt.check_metrics(metrics)
        if metadata is not None:
            _check_json(metadata)
        self._raise_pending()
        self.ensure_writer()
        if rng:
            if not isinstance(state, dict):
                raise ValueError("rng=True needs a dict state (RNG states go under '__rng__')")
            state = {**state, RNG_KEY: rng_state()}
        if self.memory is not None:  # its lock; the first save's size against the tmpfs
            self.memory.prepare(lambda: self._saves.plan(state).nbytes, self.write_options)
        return self._saves.submit(index, state, metadata, metrics, self._overlap)

    def wait_for_snapshot(self, *, host: bool = False) -> None:
        """Make the current CUDA stream (``host=True``: the host) wait for the copies of the
        overlapped saves in flight (docs/overlap.md); returns at once without overlap."""
        self._overlap.wait_for_snapshot(host)

    def editing(self) -> AbstractContextManager[None]:
        """``with manager.editing(): p.mul_(0.5)``: in-place edits after ``wait_for_snapshot()``."""
        return self._overlap.editing()

    def _committed(self, step: int, path: Path) -> None:
        """After a commit (of this manager's save, or adopted): known good, listeners, retention."""
        self._newest_verified = max(step, self._newest_verified or step)
        self._retainer.mark_good(step, path)
        for listener in list(self.on_commit):
            listener(step, path)
        self._retain()

    def wait(self, timeout: float | None = None, *, uploads: bool = False) -> None:
        """Wait for every save in flight (and, with ``uploads=True``, every upload); re-raise the
        first background error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._saves.wait(timeout)
        if self.memory is not None:  # the persists to disk they started
            self.memory.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if uploads and self.remote is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.remote.wait(left)
        self._raise_pending()

    # ---- retention ----------------------------------------------------------------------
    def _retain(self, strict: bool = False) -> None:
        """Apply retention (``ckpt.retention.retainer.Retainer.retain``) with the current policy."""
        self._retainer.retain(self.policy, strict)

    def _retain_if_writer(self) -> None:
        if self._takeover.lock.held:
            self._retain()

    def adopt(self, step: int) -> None:
        """Run the post-commit actions (``on_commit`` listeners such as the upload, retention)
        for ``step``, committed into this directory by another writer such as ``ckpt.dcp``."""
        self.ensure_writer()
        path = _layout.step_dir(self.directory, step)
        if not (path / fmt.MANIFEST).is_file():
            raise CheckpointError(f"{path}: not a committed checkpoint")
        self._committed(step, path)

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
        local = set(commit.steps(self.directory)) | self._restorer.memory_steps()
        return sorted(local | self._restorer.remote_steps(strict=True))

    def latest_step(self) -> int | None:
        """The newest committed step, local or remote (see ``steps``), or ``None``."""
        found = self.steps()
        return found[-1] if found else None

    def metadata(self, step: int) -> dict[str, Any]:
        """The ``metadata`` dict given to ``save`` for ``step`` (read from the local manifest,
        else from the remote's); raises ``CheckpointError`` if the step is not found."""
        meta = self._restorer.manifest(step).get("metadata")
        return dict(meta) if isinstance(meta, dict) else {}

    def metrics(self, step: int) -> dict[str, float]:
        """The ``metrics`` given to ``save`` for ``step`` (``{}`` if none), read like
        ``metadata``: from the validated local manifest, else from the remote's."""
        found = self._restorer.manifest(step).get("metrics")
        return dict(found) if isinstance(found, dict) else {}

    # ---- save policy and preemption -------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save ``step``: a multiple of ``save_interval_steps`` (``"auto"``: call it
        each step, ``ckpt.interval``), one of ``save_on_steps``, or the step a preemption was
        agreed on (``reached_preemption``; with several ranks, call it on every rank for the
        same steps). ``step`` is an int from 0 to ``2**53`` (``ValueError`` otherwise)."""
        step = _step(step, "should_save: step")
        if self.reached_preemption(step):
            return True
        return self._every.should_save(step, self.stats) or step in self.save_on_steps

    def interval(self) -> IntervalReport | None:
        """The ``"auto"`` interval now and its inputs (``ckpt.interval.IntervalReport``)."""
        return self._every.report()

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
        metadata: dict[str, Any] | None = None,
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
        last = self._saves.last_saved
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

    # ---- restoring ------------------------------------------------------------------------
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
        if step is not None:
            step = _step(step, "restore: step")  # the steps save accepts
        if self._saves.busy:
            self.wait()
        if self.memory is not None:  # with a peer replica: the collective exchange
            self.memory.before_restore()
        request = RestoreRequest(into, map_location, mmap, verify, strict)
        s, state, stats = self._restorer.restore(step, request)
        self.stats.last_restore = stats
        if verify:
            self._newest_verified = max(s, self._newest_verified or s)
            self._retainer.mark_good(s, _layout.step_dir(self.directory, s))
        log.info(
            "ckpt: restored step %d (%d bytes, read %.3f s, checksums %.3f s)",
            s, stats.nbytes, stats.read_s, stats.verify_s,
        )  # fmt: skip
        return state

    def fetch(self, step: int) -> Path:
        """Make sure ``DIR/step-N`` holds a verified copy of ``step``, downloading it from the
        remote when the local copy is missing or fails verification; return its path. Meant for
        checkpoints read by other means, such as ``ckpt.dcp.CkptStorageReader``."""
        return self._restorer.fetch(_step(step, "fetch: step"))

    def _downloaded(self, step: int) -> None:
        """A verified download was published as local ``step-N``: it is known uploaded."""
        assert self.remote is not None
        with self._mutex:
            self.remote.stats.uploads.setdefault(step, _done_status(step))

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for saves in flight (and uploads, up to ``RemoteOptions.close_timeout_s``),
        release the writer lock, the writer threads and the memory tier (``MemoryTier.close``)."""
        try:
            try:
                self.wait()
                if self.memory is not None:
                    self.memory.close()
            finally:  # a failed save is raised, but the upload threads stop all the same
                if self.remote is not None:
                    self.remote.close()
            if self.remote is not None:
                self.remote.raise_pending()
        finally:
            if self._preemption is not None:
                self._preemption.close()
            self._overlap.close()
            self._every.end()  # "auto": a clean end of the run (ckpt.runlog)
            self._takeover.lock.release()
            if self.memory is not None:
                self.memory.lock.release()
            self._saves.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self._every.exit(exc[1])  # "auto": an Exception leaving the run is a failure
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
        sign = " (non-negative)" if low == 0 else ""
        raise ValueError(f"{what} must be an int from {low} to 2**53{sign}, got {n!r} ({kind})")
    return step


def _step_list(steps: Any) -> list[int]:
    return [_step(s, "save_on_steps: each step") for s in list(steps if steps is not None else ())]


def _done_status(step: int) -> Any:
    from ckpt.remote import UploadStatus

    return UploadStatus(step, "done")
