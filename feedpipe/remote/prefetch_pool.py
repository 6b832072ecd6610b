"""The daemon threads that run a :class:`~feedpipe.remote.cache.ShardCache`'s background prefetches.

Unlike :class:`~concurrent.futures.ThreadPoolExecutor`, whose threads the interpreter joins at
exit after running every queued call, nothing here delays exit: the threads are daemons, and
:meth:`DaemonPool.shutdown` cancels the queued calls and sets the pool's ``cancel`` event, which
the running ones check in their lock waits.
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from feedpipe.io.reaper import join_threads

__all__ = ["DaemonPool", "Prefetcher"]

Job = tuple[Future[None], Callable[[str, threading.Event], None], str]


class DaemonPool:
    """Daemon threads running background prefetches (``fn(relpath, cancel)``).

    Unlike :class:`~concurrent.futures.ThreadPoolExecutor`, whose threads the interpreter joins
    at exit after running every queued call, nothing here delays exit. :meth:`shutdown` cancels
    the queued calls and sets ``cancel``, which the running ones check in their lock waits.
    """

    def __init__(self, workers: int, cancel: threading.Event) -> None:
        self.cancel = cancel
        self._workers = max(1, workers)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[str, threading.Event], None], relpath: str) -> Future[None]:
        fut: Future[None] = Future()
        with self._lock:
            if self.cancel.is_set():
                raise RuntimeError("ShardCache is closed")
            self._jobs.put((fut, fn, relpath))
            if len(self._threads) < self._workers:
                t = threading.Thread(
                    target=self._run,
                    name=f"feedpipe-prefetch-{len(self._threads)}",
                    daemon=True,
                )
                self._threads.append(t)
                t.start()
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, relpath = job
            if self.cancel.is_set():
                fut.cancel()
            if fut.set_running_or_notify_cancel():
                try:
                    fn(relpath, self.cancel)
                except BaseException as exc:  # handed to the future's owner
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)
            del job, fut

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Set ``cancel``, cancel queued calls, stop the threads; wait up to ``timeout_s``, then
        warn (``StuckWorkerWarning``) about each thread still running."""
        self.cancel.set()
        with self._lock:
            threads = list(self._threads)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in threads:
            self._jobs.put(None)
        if timeout_s <= 0 or sys.is_finalizing():  # threads cut off at exit never finish
            return
        # a download stuck past the bound is reported by thread name and id (threads cannot
        # be killed; daemons, they never hold the interpreter's exit)
        join_threads(threads, "ShardCache prefetch", timeout_s)


class Prefetcher:
    """A cache's background prefetches: the pool (started on first use), the pending future
    per file, and the closed state. ``fetch(relpath, cancel)`` runs on the pool's threads."""

    def __init__(self, workers: int, fetch: Callable[[str, threading.Event], None]) -> None:
        self._workers = workers
        self._fetch = fetch
        self._lock = threading.Lock()
        self._pool: DaemonPool | None = None
        self._pending: dict[str, Future[None]] = {}
        self.closed = False

    def submit(self, relpaths: Iterable[str], present: Callable[[str], bool]) -> list[Future[None]]:
        """Queue each of ``relpaths`` not ``present`` and not already pending; the futures."""
        out: list[Future[None]] = []
        with self._lock:
            if self.closed:
                raise RuntimeError("ShardCache is closed")
            if self._pool is None:
                self._pool = DaemonPool(self._workers, threading.Event())
                # garbage collection or interpreter exit (atexit) stops it: never waited for
                weakref.finalize(self, self._pool.shutdown)
            for rel in relpaths:
                fut = self._pending.get(rel)
                if fut is None or fut.done():
                    if present(rel):
                        continue
                    fut = self._pool.submit(self._fetch, rel)
                    self._pending[rel] = fut
                out.append(fut)
        return out

    def close(self, timeout_s: float) -> None:
        """No more prefetches; queued ones are cancelled, running ones get ``timeout_s``."""
        with self._lock:
            self.closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(timeout_s=timeout_s)
