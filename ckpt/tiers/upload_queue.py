"""``UploadQueue``: the steps waiting for upload, each step's ``UploadStatus``, and the one
background thread that works them off.

Who calls what: ``put``, ``mark``, ``active``, ``failed``, ``snapshot``, ``wait`` and ``close``
may be called from any thread (the manager's, the persist thread's, the worker's). The worker
thread, started by ``start`` and ended when the queue is empty, calls ``scan()`` once first (the
tier reconciles with the remote), then ``upload(step)`` for each queued step, one at a time; an
``Exception`` from either goes to ``on_error(step, exc)`` (``step`` is ``None`` for the scan),
and the worker goes on. ``lock`` guards the statuses and the counters the tier keeps beside them.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

from ckpt.tiers.status import UploadStatus

__all__ = ["UploadQueue"]


class UploadQueue:
    """The upload queue of one tier; ``uploads`` is the tier's ``RemoteStats.uploads`` (shared,
    written under ``lock``). ``newest_done``: the newest step whose upload verified."""

    def __init__(
        self,
        uploads: dict[int, UploadStatus],
        name: str,
        scan: Callable[[], None],
        upload: Callable[[int], None],
        on_error: Callable[[int | None, Exception], None],
    ) -> None:
        self.lock = threading.Condition()  # an RLock inside: a holder may call mark() etc.
        self.uploads = uploads
        self.newest_done: int | None = None
        self._name, self._scan, self._upload, self._on_error = name, scan, upload, on_error
        self._steps: collections.deque[int] = collections.deque()
        self._busy = False
        self._scanned = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        """True once ``close`` ran: an upload still running may finish, nothing new starts."""
        return self._closed

    def put(self, steps: Iterable[int], *, reset: bool) -> None:
        """Queue ``steps`` (each once); ``reset`` marks each pending, else only a step with no
        status yet is."""
        with self.lock:
            for step in steps:
                if reset:
                    self.uploads[step] = UploadStatus(step)
                else:
                    self.uploads.setdefault(step, UploadStatus(step))
                if step not in self._steps:
                    self._steps.append(step)

    def mark(self, step: int, status: UploadStatus) -> None:
        """Record ``step``'s status (a ``done`` one makes it the newest verified if newer)."""
        with self.lock:
            self.uploads[step] = status
            if status.state == "done":
                self.newest_done = max(step, self.newest_done or step)

    def failed(self) -> list[int]:
        """The steps whose last upload failed, ascending."""
        with self.lock:
            return [s for s, st in sorted(self.uploads.items()) if st.state == "failed"]

    def active(self) -> set[int]:
        """The steps queued or uploading now (never deleted by retention)."""
        with self.lock:
            uploading = {s for s, st in self.uploads.items() if st.state == "uploading"}
            return set(self._steps) | uploading

    def snapshot(self) -> dict[int, UploadStatus] | None:
        """A copy of every status, or ``None`` once closed (a later tier owns the mirror)."""
        with self.lock:
            return None if self._closed else dict(self.uploads)

    def start(self) -> None:
        """Start the worker thread unless it runs."""
        with self.lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"{self._name}-queue", daemon=True
                )
                self._thread.start()

    def wait(self, timeout: float | None, url: str) -> None:
        """Wait until the scan ran and every queued upload finished (done or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._steps or self._busy or not self._scanned:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"uploads to {url} still running after {timeout} s")
                self.lock.wait(0.1 if left is None else min(left, 0.1))

    def close(self) -> None:
        """Start nothing new (an upload running now may finish)."""
        with self.lock:
            self._closed = True

    def _next(self) -> bool:
        """Claim the worker's next turn; ``False`` (thread ends) when there is none."""
        with self.lock:
            if self._closed or (self._scanned and not self._steps):
                self._thread = None
                self.lock.notify_all()
                return False
            self._busy = True
            return True

    def _loop(self) -> None:
        while self._next():
            step: int | None = None
            try:
                if not self._scanned:
                    self._scan()
                else:
                    with self.lock:
                        step = self._steps.popleft()
                    self._upload(step)
            except Exception as exc:  # never let the thread die silently: report and go on
                self._on_error(step, exc)
            except BaseException:
                with self.lock:
                    self._thread = None
                raise
            finally:
                with self.lock:
                    self._scanned = True
                    self._busy = False
                    self.lock.notify_all()
