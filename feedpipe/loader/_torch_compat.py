"""Every place feedpipe reaches into torch's private data-loading internals, with the reason.

Checked against torch 2.11 (the GPU machine) and 2.13 (the development machine). Each function
degrades to doing nothing (or to torch's own behaviour) when the internal it needs is missing.

1. ``get_worker_info()`` in thread workers. torch keeps the worker info in the module global
   ``torch.utils.data._utils.worker._worker_info``, one per process, so a thread cannot have its
   own. :func:`install_worker_info_shim` swaps the *code* of torch's ``get_worker_info`` (the
   function object stays, so ``from torch.utils.data import get_worker_info`` done before still
   sees the change) for one that returns the calling thread's info first, then the global.
   torch's own ``default_collate`` is the one caller shown no thread's info
   (:func:`_shim_worker_info`): it would stack every batch into a new shared-memory block.
   Outside feedpipe's threads it returns exactly what torch's does, also in a process forked
   from a worker thread (the child forgets the thread's info).
2. Showing the user's dataset (not feedpipe's timing proxy) in ``get_worker_info().dataset`` of
   process workers: :func:`unwrap_worker_dataset` replaces the same global inside the worker.
3. Worker deaths. torch registers its workers' pids with a C-level SIGCHLD handler that raises
   ``RuntimeError`` in the main thread *wherever it happens to be*, including the user's
   ``except`` block. :func:`adopt_workers` takes feedpipe's process workers out of that table;
   feedpipe's own handler (:func:`_on_sigchld`) raises only while the main thread is inside the
   loader's ``next()`` (the pass is over then anyway), and leaves a note that every loader's
   next ``next()`` reads (a death seen inside another loader's ``next()`` counts too).
   :func:`waiting_on`, :func:`tasks_of`, :func:`has_workers` and :func:`stop_workers` read
   and stop torch's iterator for ``WorkerError`` messages.
4. Shutdown. :func:`end_workers` ends a torch iterator's worker processes within
   :data:`feedpipe.io.reaper.DEFAULT_BOUND` (ask through torch's ``_workers_done_event`` and
   ``_index_queues``, wait, terminate, kill, reap), then calls its ``_shutdown_workers()`` for
   torch's own bookkeeping (whose joins then return at once). torch alone would join each hung
   worker 5 s, one after the other, never send SIGKILL, and do nothing at all at interpreter
   exit (``python_exit_status``), leaving a worker that ignores SIGTERM to block exit.
   :func:`shutdown_iterator` runs it from a ``weakref.finalize`` on the loader (persistent
   workers: the workers go when the loader goes, at garbage collection, in a reference cycle
   the user made, or at interpreter exit), and the loader's iterator runs it when a pass of
   non-persistent workers is dropped.
5. ``torch.utils.data.DataLoader``'s own private members, which the ``DataLoader`` subclass
   reads as torch's iterators do: :func:`index_sampler` (``_index_sampler``: the batch sampler
   with automatic batching, else the sampler), :func:`auto_collation` (``_auto_collation``),
   :func:`len_called` / :func:`set_len_called` (``_IterableDataset_len_called``, behind torch's
   warning when an IterableDataset yields more than its ``len()``), torch's
   :class:`ExceptionWrapper` (re-raises a worker's exception with its traceback text) and its
   recursive :func:`pin_memory`. Each is covered by tests/test_torch_compat.py on the pinned torch.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import dataloader as _dataloader
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import worker as _worker
from torch.utils.data._utils.pin_memory import pin_memory

from feedpipe.io.reaper import DEFAULT_BOUND, Bound, at_exit, end_processes

__all__ = [
    "ExceptionWrapper",
    "Guard",
    "WorkerDiedError",
    "adopt_workers",
    "auto_collation",
    "dead_workers",
    "end_workers",
    "has_workers",
    "index_sampler",
    "install_worker_info_shim",
    "len_called",
    "make_worker_info",
    "pin_memory",
    "set_len_called",
    "set_thread_worker_info",
    "shutdown_iterator",
    "stop_workers",
    "tasks_of",
    "thread_worker_info",
    "unwrap_worker_dataset",
    "waiting_on",
    "worker_pids",
    "workers_running",
]


class _Local(threading.local):
    info: Any = None  # a class default: a thread that never set it reads it without a miss


_LOCAL = _Local()


# ------------------------------------------------------------------------------ 1. worker info
def thread_worker_info() -> Any:
    """The ``WorkerInfo`` of the current feedpipe worker thread, or None."""
    return _LOCAL.info


def set_thread_worker_info(info: Any) -> None:
    """Set (or clear, with None) the calling thread's ``WorkerInfo``."""
    _LOCAL.info = info


_SHIM_SOURCE = """
def get_worker_info():
    info = _feedpipe_thread_worker_info()
    return _worker_info if info is None else info
"""

# torch's default_collate asks get_worker_info() only to decide whether to stack a batch into a
# new shared-memory block, for shipping to the main process: a thread never ships it.
_COLLATE_MODULE = _collate.__name__


def _shim_worker_info() -> Any:
    """What the shim's ``get_worker_info()`` returns before the process global: the calling
    thread's ``WorkerInfo``, except to torch's own collate (``collate_tensor_fn``), which is told
    "no worker", as torch's function tells it in a thread. Were it told, each batch would be
    stacked into a new shared-memory block (``shm_open``, ``mmap``, a page fault per 4 KiB,
    ``munmap``) for no reader in another process: half the thread workers' throughput at
    256 KiB samples (issue 28). Every other caller, a user's ``collate_fn`` included, sees it,
    and so does code that ``torch.compile`` traces (its caller cannot be read there)."""
    info = _LOCAL.info
    if info is None:
        return None
    if torch.compiler.is_compiling():  # dynamo cannot trace a frame walk (fullgraph=True would
        return info  # raise): compiled code sees the info, as it did before the walk
    try:  # the caller of get_worker_info(), in one C call: no frame object kept alive
        name = sys._getframe(2).f_globals.get("__name__")
    except ValueError:  # no Python frame calls it (a C caller at the bottom of a stack)
        return info
    return None if name == _COLLATE_MODULE else info


def install_worker_info_shim() -> bool:
    """Make ``torch.utils.data.get_worker_info()`` see feedpipe's worker threads (idempotent).

    Returns False (and changes nothing) when torch's function is not the plain global read it
    is in torch 2.11-2.13.
    """
    module = vars(_worker)
    if "_feedpipe_thread_worker_info" in module:
        return True
    fn = getattr(_worker, "get_worker_info", None)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars or code.co_argcount or "_worker_info" not in module:
        return False
    namespace: dict[str, Any] = {}
    # compiled here, run with torch's module globals: the new code reads `_worker_info` there
    exec(compile(_SHIM_SOURCE, __file__, "exec"), namespace)
    module["_feedpipe_thread_worker_info"] = _shim_worker_info
    fn.__code__ = namespace["get_worker_info"].__code__  # type: ignore[union-attr]
    # a process forked from a worker thread (a torch loader run inside the dataset) is no
    # feedpipe worker: its main thread must not inherit the thread's info
    os.register_at_fork(after_in_child=_forget_thread_worker_info)
    return True


def _forget_thread_worker_info() -> None:
    _LOCAL.info = None


def make_worker_info(wid: int, num_workers: int, seed: int, dataset: Any) -> Any:
    """torch's ``WorkerInfo`` for thread worker ``wid`` (with the per-worker RNG fields that
    some torch versions add, when present)."""
    extra: dict[str, Any] = {}
    rng_cls = getattr(_worker, "_RNG", None)
    if rng_cls is not None:
        import random

        extra = {
            "rng": rng_cls(
                random_generator=random.Random(seed),
                torch_generator=torch.Generator().manual_seed(seed),
            ),
            "worker_method": "thread",
        }
    return _worker.WorkerInfo(id=wid, num_workers=num_workers, seed=seed, dataset=dataset, **extra)


def unwrap_worker_dataset(proxy_types: tuple[type, ...]) -> None:
    """Inside a torch worker process: show the user's dataset instead of feedpipe's proxy."""
    info = _worker._worker_info
    if info is not None and isinstance(info.dataset, proxy_types):
        dataset: Any = info.dataset
        _worker._worker_info = _worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=dataset.dataset
        )


# ------------------------------------------------------------------------- 3. worker deaths
class _Sigchld:
    """The state of feedpipe's SIGCHLD handler (main thread only)."""

    installed = False
    reading: Any = None  # the torch iterator whose next() the main thread is inside, or None
    deaths = 0  # SIGCHLDs seen: each Guard checks its workers when it sees a new one


def waiting_on(source: Any) -> tuple[int | None, int | None]:
    """(batch number, worker id) a torch multi-process iterator waits for next."""
    rcvd = getattr(source, "_rcvd_idx", None)
    info = getattr(source, "_task_info", {}).get(rcvd) if rcvd is not None else None
    return rcvd, (info[0] if info else None)


def tasks_of(source: Any, wid: int) -> list[int]:
    """The batch numbers worker ``wid`` of a torch multi-process iterator holds."""
    info = getattr(source, "_task_info", {})
    return sorted(idx for idx, t in info.items() if t and t[0] == wid and len(t) == 1)


def stop_workers(source: Any) -> None:
    """After a worker died the pass is over: stop the others now instead of joining them.

    A SIGKILLed worker can leave the shared result queue locked, so torch's graceful join would
    wait its full timeout per worker; terminating first makes the shutdown immediate. (The pids
    are out of torch's SIGCHLD table already: :func:`adopt_workers`.)
    """
    end_workers(source, Bound(grace=0.0))


def dead_workers(
    source: Any, active_only: bool = False
) -> list[tuple[int, int | None, int | None]]:
    """``(worker id, pid, exit code)`` of the dead process workers of a torch iterator.

    A worker that torch let go (``_workers_status`` False) exits with code 0 while the others go
    on when its ``IterableDataset`` ran out: ``active_only`` leaves those out, as torch's own
    check does (the SIGCHLD paths). Otherwise they come last (torch also lets go of a worker it
    found dead, just before it raises "exited unexpectedly").
    """
    status = getattr(source, "_workers_status", None) or []
    active: list[tuple[int, int | None, int | None]] = []
    let_go: list[tuple[int, int | None, int | None]] = []
    for wid, w in enumerate(getattr(source, "_workers", None) or []):
        if not w.is_alive():
            still = wid >= len(status) or bool(status[wid])
            (active if still else let_go).append((wid, w.pid, w.exitcode))
    return active if active_only else active + let_go


def worker_pids(source: Any) -> list[int]:
    """The pids of a torch multi-process iterator's worker processes (``_workers``; none for a
    thread pool or an inline source)."""
    pids = (getattr(w, "pid", None) for w in getattr(source, "_workers", None) or [])
    return [pid for pid in pids if isinstance(pid, int)]


def has_workers(source: Any) -> bool:
    """Whether ``source`` is a torch multi-process iterator with worker processes
    (``_workers``; False for a thread pool or an inline source)."""
    return bool(getattr(source, "_workers", None))


class WorkerDiedError(RuntimeError):
    """Raised by feedpipe's SIGCHLD handler inside ``next()``: a process worker is gone."""


def _on_sigchld(previous: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        source = _Sigchld.reading
        _Sigchld.deaths += 1  # every Guard looks at its workers in its next next()
        if (
            source is not None
            and not getattr(source, "_shutdown", False)
            and dead_workers(source, active_only=True)
        ):
            _Sigchld.reading = None  # raise once
            raise WorkerDiedError("a DataLoader worker process exited")
        if callable(previous):  # torch's handler: only other (plain torch) loaders' workers
            previous(signum, frame)

    return handler


def adopt_workers(source: Any) -> None:
    """Take a torch multi-process iterator's workers out of torch's asynchronous SIGCHLD check;
    feedpipe's handler reports their deaths inside ``next()`` only."""
    at_exit(source, end_workers)  # torch does nothing at exit; multiprocessing joins forever
    if getattr(source, "_worker_pids_set", False):
        try:
            from torch.utils.data._utils import signal_handling

            # private and not re-exported: the one way to unregister the pids torch set
            signal_handling._remove_worker_pids(id(source))  # type: ignore[attr-defined]
        except (ImportError, RuntimeError):  # pragma: no cover - not registered after all
            pass
        source._worker_pids_set = False
    if not _Sigchld.installed and threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGCHLD)
            signal.signal(signal.SIGCHLD, _on_sigchld(previous))
        except (AttributeError, ValueError):  # pragma: no cover - no SIGCHLD (Windows)
            return
        _Sigchld.installed = True


class Guard:
    """Calls ``next()`` on a torch multi-process iterator so that a worker death raises
    :class:`WorkerDiedError` there, and only there (main thread; elsewhere it is a plain ``next``).

    A SIGCHLD that arrived between two ``next()`` calls is looked at when the next one starts.
    """

    __slots__ = ("seen", "source")

    def __init__(self, source: Any) -> None:
        self.source = source
        self.seen = _Sigchld.deaths

    def next(self) -> Any:
        source = self.source
        if threading.get_ident() != _MAIN:
            return next(source)
        if _Sigchld.deaths != self.seen:
            self.seen = _Sigchld.deaths
            if not getattr(source, "_shutdown", False) and dead_workers(source, active_only=True):
                raise WorkerDiedError("a DataLoader worker process exited")
        _Sigchld.reading = source
        try:
            return next(source)
        finally:
            _Sigchld.reading = None


_MAIN = threading.main_thread().ident


# ------------------------------------------------------------------------------ 4. shutdown
def workers_running(loader: Any) -> bool:
    """Whether ``iter(loader)`` will reuse running persistent workers (``loader._iterator``)
    instead of starting new ones."""
    return bool(loader.persistent_workers) and getattr(loader, "_iterator", None) is not None


def shutdown_iterator(loader: Any) -> None:
    """Stop the persistent workers of a torch ``DataLoader`` (``loader._iterator``) now."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        end_workers(it)


def _ask_to_exit(source: Any) -> None:
    """torch's own request to its workers: the done event, then ``None`` on every index queue.
    The event is set only if its lock can be had within a second: a worker killed while it held
    it (its loop reads the event every turn) leaves it held for ever, and then the ``None`` and
    the reaper's signals are the request."""
    event = source._workers_done_event
    if _lock_free(event):
        event.set()
    for q in source._index_queues:
        q.put(None)


def _lock_free(event: Any) -> bool:
    """Whether ``event``'s lock (a multiprocessing Event's condition) is had within a second."""
    cond = getattr(event, "_cond", None)
    if cond is None:
        return True
    if not cond.acquire(True, 1.0):
        return False
    cond.release()
    return True


def end_workers(source: Any, bound: Bound = DEFAULT_BOUND) -> None:
    """End the worker processes of a torch multi-process iterator within ``bound`` (ask, wait,
    terminate, kill, reap; one that outlives SIGKILL is reported by name and pid), then run
    torch's ``_shutdown_workers()``. Anything else (a thread pool, an inline source): nothing."""
    if not isinstance(source, _dataloader._MultiProcessingDataLoaderIter):
        return
    workers = [w for w in getattr(source, "_workers", None) or [] if w.pid is not None]
    if workers and not source._shutdown:
        end_processes(workers, "DataLoader worker", ask=lambda: _ask_to_exit(source), bound=bound)
        if not any(w.is_alive() for w in workers):
            # a worker killed while it read the done event (its loop does, every turn) leaves the
            # event's lock held by a dead process, and torch's shutdown would wait forever to set
            # it (a fresh-clone run: test_no_error_arrives_asynchronously_after_a_worker_death).
            # No worker is left to read it: torch's shutdown sets a fresh one.
            source._workers_done_event = multiprocessing.Event()
    shutdown = getattr(source, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


# ------------------------------------------------------------- 5. DataLoader's private members
def index_sampler(loader: Any) -> Any:
    """``loader._index_sampler``: what torch's iterators draw index batches (or indices) from."""
    return loader._index_sampler


def auto_collation(loader: Any) -> bool:
    """``loader._auto_collation``: whether torch batches samples (a batch sampler is in use)."""
    return bool(loader._auto_collation)


def len_called(loader: Any) -> Any:
    """``loader._IterableDataset_len_called``: the ``len()`` an iterable's yield is held to."""
    return loader._IterableDataset_len_called


def set_len_called(loader: Any, value: Any) -> None:
    """Hand the outer loader's ``len()`` record to the inner loader (:func:`len_called`)."""
    loader._IterableDataset_len_called = value


# ------------------------------------------- 6. other private names (added for the loader's files)
def random_sampler_num_samples(sampler: Any) -> Any:
    """A ``RandomSampler``'s ``num_samples`` as given (``_num_samples``; None: len(data))."""
    return sampler._num_samples


def infinite_constant_sampler() -> type[Any]:
    """torch's ``_InfiniteConstantSampler``, an ``IterableDataset``'s placeholder sampler."""
    return _dataloader._InfiniteConstantSampler  # type: ignore[no-any-return]
