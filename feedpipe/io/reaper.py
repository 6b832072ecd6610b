"""End the workers an object started, within a bound: ask, wait, terminate, kill, reap.

Every feedpipe/ckpt object that starts worker processes hands them to a :class:`Workers` and
ends them through it, at ``close()``, at garbage collection and at interpreter exit (a
``weakref.finalize``, which also runs from ``atexit``). The steps, each bounded by
:class:`Bound`:

1. **ask**: the owner's own polite request (a sentinel, a closed queue, a removed plan
   directory), made before :meth:`Workers.end` or passed to it as ``ask``;
2. **wait** up to ``Bound.grace`` seconds for every worker to exit by itself;
3. **terminate** (SIGTERM) the rest and wait up to ``Bound.term`` seconds;
4. **kill** (SIGKILL) the rest and wait up to ``Bound.kill`` seconds;
5. **reap**: join each exited worker, so that no zombie is left.

A worker that has to be terminated takes its own descendants with it (Linux, a ``/proc`` walk
made just before each signal, each one held by a pidfd so that a reused pid is never signalled):
a dataset that ran a subprocess, or a pool of its own, leaves no orphan when its worker is
killed. torch's ``torch_shm_manager`` and ``multiprocessing``'s helper processes are left to end
by themselves (they outlive their client only until its last segment is released). A descendant
orphaned before its worker was signalled (a worker that exits by itself, a double fork) is out
of reach.

So ``end()`` returns within ``grace + term + kill`` seconds (``DEFAULT_BOUND``: 2 + 2 + 2 s). A
worker still alive after SIGKILL is in uninterruptible sleep (a stuck NFS read, a hung device):
it is reported by name and pid with a :class:`StuckWorkerWarning` and returned, never silently
forgotten.

The owner itself may die without running any of this (the OOM killer, ``kill -9``): a worker
process calls :func:`die_with_parent` first, and ends (with its own descendants) as soon as its
parent is gone, even while it is stuck in the dataset.

Threads cannot be killed. :func:`join_threads` gives them the same bounded wait and reports each
one still running by name and native id; its caller's ``close()`` then returns anyway (the bound
for thread workers is "close returns and reports"; daemon threads never block interpreter exit).

Standard library only: ckpt uses it too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing import util as mp_util
from typing import Any, Protocol

__all__ = [
    "DEFAULT_BOUND",
    "Bound",
    "ProcessLike",
    "StuckWorkerWarning",
    "Workers",
    "at_exit",
    "die_with_parent",
    "end_processes",
    "join_threads",
    "pid_alive",
]


class StuckWorkerWarning(RuntimeWarning):
    """A worker outlived its bounded shutdown (a process that SIGKILL did not end, or a thread).

    A ``RuntimeWarning``: shown by default (Python hides ``ResourceWarning``s).
    """


@dataclass(frozen=True)
class Bound:
    """Seconds for each step of a shutdown: the polite wait, then after SIGTERM, then after
    SIGKILL. The whole shutdown takes at most their sum."""

    grace: float = 2.0
    term: float = 2.0
    kill: float = 2.0

    @property
    def total(self) -> float:
        """The most seconds a shutdown takes."""
        return self.grace + self.term + self.kill


DEFAULT_BOUND = Bound()


class ProcessLike(Protocol):
    """What :func:`end_processes` needs of a worker: ``multiprocessing.Process`` has it."""

    @property
    def pid(self) -> int | None: ...
    @property
    def name(self) -> str: ...
    @property
    def sentinel(self) -> int: ...
    def is_alive(self) -> bool: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


def _wait(procs: list[ProcessLike], seconds: float) -> list[ProcessLike]:
    """Wait up to ``seconds`` for ``procs`` to exit; those still alive."""
    deadline = time.monotonic() + seconds
    alive = [p for p in procs if p.is_alive()]
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            connection.wait([p.sentinel for p in alive], timeout=left)
        except (OSError, ValueError):  # a sentinel closed under us: poll instead
            time.sleep(min(left, 0.05))
        alive = [p for p in alive if p.is_alive()]
    return alive


def _signal(procs: list[ProcessLike], kill: bool) -> None:
    for p in procs:
        try:
            p.kill() if kill else p.terminate()
        except (OSError, ValueError, AttributeError):  # exited meanwhile, or closed
            pass


# descendants that end by themselves once their client is gone (killing torch's manager would
# leave the segments it tracks in /dev/shm)
_SELF_ENDING = (
    b"torch_shm_manager",
    b"multiprocessing.resource_tracker",
    b"multiprocessing.forkserver",
)


class _Descendant:
    """A process descended from a worker, held by a pidfd (never a reused pid)."""

    __slots__ = ("fd", "name", "pid")

    def __init__(self, pid: int, fd: int, name: str) -> None:
        self.pid, self.fd, self.name = pid, fd, name

    @property
    def sentinel(self) -> int:
        return self.fd  # readable once the process has exited

    def is_alive(self) -> bool:
        if self.fd < 0:
            return False
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return not poller.poll(0)

    def _send(self, sig: int) -> None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.fd, sig)

    def terminate(self) -> None:
        self._send(signal.SIGTERM)

    def kill(self) -> None:
        self._send(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        """Not our child: its new parent reaps it."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _descendants(roots: set[int], known: dict[int, _Descendant]) -> None:
    """Add to ``known`` the live descendants of the pids ``roots`` (a /proc walk; Linux with
    pidfds only)."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"):
        return
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    todo = [c for r in roots for c in children.get(r, [])]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if pid in known:
            continue
        cmd = _cmdline(pid)
        if any(h in cmd for h in _SELF_ENDING):
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone meanwhile
            continue
        known[pid] = _Descendant(pid, fd, cmd.decode(errors="replace").strip()[:80] or "?")


def _ask(ask: Callable[[], None] | None) -> None:
    """Ask the workers to exit; a broken channel is no reason to stop (signals follow)."""
    if ask is None:
        return
    try:
        ask()
    except Exception:  # a broken channel: the signals below still end the workers
        pass


def _escalate(alive: list[ProcessLike], bound: Bound) -> list[ProcessLike]:
    """SIGTERM, wait, SIGKILL, wait: the processes still ``alive`` after their grace, and
    their descendants; returns those that outlived it all."""
    family: dict[int, _Descendant] = {}  # the descendants of the workers that are signalled
    try:
        if alive:
            _descendants({p.pid for p in alive if p.pid is not None}, family)
            alive = alive + list(family.values())
            _signal(alive, kill=False)
            alive = _wait(alive, bound.term)
        if alive:
            before = set(family)
            _descendants(
                {p.pid for p in alive if p.pid is not None and not isinstance(p, _Descendant)},
                family,
            )
            alive += [d for pid, d in family.items() if pid not in before]
            _signal(alive, kill=True)
            alive = _wait(alive, bound.kill)
    finally:
        for d in family.values():
            d.close()
    return alive


def _reap(ended: list[ProcessLike]) -> None:
    for p in ended:
        try:
            p.join(0)  # reap: no zombie
        except (AssertionError, ValueError):  # not our child, or closed: nothing to reap
            pass


def end_processes(
    procs: Iterable[ProcessLike],
    what: str,
    *,
    ask: Callable[[], None] | None = None,
    bound: Bound = DEFAULT_BOUND,
) -> list[ProcessLike]:
    """End ``procs`` within ``bound.total`` seconds: ``ask()``, wait, SIGTERM, SIGKILL, reap.

    ``what`` names the kind of worker in the warning about one that outlived SIGKILL
    (:class:`StuckWorkerWarning`, with its name and pid). Returns those still alive.
    """
    procs = [p for p in procs if p.pid is not None]
    _ask(ask)
    alive = _escalate(_wait(procs, bound.grace), bound)
    _reap([p for p in procs if p not in alive])
    for p in alive:
        kind = f"{what}'s child" if isinstance(p, _Descendant) else what
        warnings.warn(
            f"{kind} {p.name} (pid {p.pid}) is still running {bound.total:g} s after it was "
            "asked to stop, terminated and killed (stuck in uninterruptible I/O?): it is left "
            "behind",
            StuckWorkerWarning,
            stacklevel=2,
        )
    return alive


def join_threads(
    threads: Iterable[threading.Thread], what: str, timeout: float = DEFAULT_BOUND.total
) -> list[threading.Thread]:
    """Join ``threads`` for at most ``timeout`` seconds in all; warn about (and return) each
    one still running, by name and native id. Threads cannot be killed: the caller goes on."""
    deadline = time.monotonic() + timeout
    alive: list[threading.Thread] = []
    for t in threads:
        if t is threading.current_thread() or t.ident is None:
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            alive.append(t)
    for t in alive:
        warnings.warn(
            f"{what} thread {t.name} (native id {t.native_id}) is still running {timeout:g} s "
            "after it was asked to stop (stuck in I/O?); threads cannot be killed, so it is left "
            "behind" + (" and will not block exit" if t.daemon else ""),
            StuckWorkerWarning,
            stacklevel=2,
        )
    return alive


class Workers:
    """The worker processes of one owner, ended by :meth:`end`, at the owner's garbage
    collection and at interpreter exit (whichever comes first; later calls do nothing).

    ``ask`` is the owner's polite request to stop (it must not hold the owner). Holding no
    reference to the owner, a ``Workers`` can be the target of its ``weakref.finalize``.
    """

    def __init__(
        self,
        what: str,
        owner: object | None = None,
        *,
        ask: Callable[[], None] | None = None,
        bound: Bound = DEFAULT_BOUND,
    ) -> None:
        self.what = what
        self.bound = bound
        self._ask = ask
        self._procs: list[ProcessLike] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child inherits this object, not the workers
        if owner is not None:
            weakref.finalize(owner, self.end)

    def add(self, procs: Iterable[ProcessLike]) -> None:
        """Take ``procs`` into this set (and end them at interpreter exit: :func:`at_exit`)."""
        with self._lock:
            self._procs.extend(procs)
        at_exit(self, Workers.end)

    @property
    def pids(self) -> list[int]:
        """The pids of the workers not yet ended."""
        with self._lock:
            return [p.pid for p in self._procs if p.pid is not None]

    def end(self, ask: Callable[[], None] | None = None) -> list[ProcessLike]:
        """End every worker within ``bound.total`` seconds (:func:`end_processes`); those that
        outlived SIGKILL (reported)."""
        if os.getpid() != self._pid:  # in a forked child: the workers are the parent's
            return []
        with self._lock:
            procs, self._procs = self._procs, []
        if not procs:
            return []
        return end_processes(procs, self.what, ask=ask or self._ask, bound=self.bound)


_AT_EXIT: list[tuple[int, weakref.ref[Any], Callable[[Any], Any]]] = []  # (pid, owner, end)
_AT_EXIT_LOCK = threading.Lock()
_HOOKED = 0  # the pid whose exit hooks are in place (a forked child needs its own)


def at_exit(owner: object, end: Callable[[Any], Any]) -> None:
    """Call ``end(owner)`` at interpreter exit if ``owner`` is still alive then (it is held
    weakly), before ``multiprocessing`` joins its children without a timeout and before torch
    stops cleaning up, also in a ``multiprocessing`` child (a rank started by
    ``torch.multiprocessing.spawn``), which runs no ``atexit`` hook at all.

    ``atexit`` runs its hooks last-registered first: ours is registered at the first call, which
    comes after the workers were started (so after ``multiprocessing``'s own hook). A
    ``multiprocessing.util.Finalize`` of positive exit priority runs first in either exit path,
    before ``multiprocessing`` terminates and joins its daemonic children.
    """
    global _HOOKED
    pid = os.getpid()
    with _AT_EXIT_LOCK:
        _AT_EXIT[:] = [e for e in _AT_EXIT if e[1]() is not None and e[1]() is not owner]
        _AT_EXIT.append((pid, weakref.ref(owner), end))
        if pid != _HOOKED:
            atexit.register(_end_all, pid)
            mp_util.Finalize(None, _end_all, args=(pid,), exitpriority=100)
            _HOOKED = pid


def _end_all(pid: int) -> None:
    if os.getpid() != pid:  # a forked child exiting: the workers are its parent's
        return
    with _AT_EXIT_LOCK:
        entries = [e for e in _AT_EXIT if e[0] == pid]
        _AT_EXIT[:] = []
    for _, ref, end in reversed(entries):
        owner = ref()
        if owner is not None:
            try:
                end(owner)
            except Exception as exc:  # pragma: no cover - exit goes on
                warnings.warn(
                    f"ending workers at exit failed: {exc!r}", StuckWorkerWarning, stacklevel=1
                )


def die_with_parent(owner: int | None = None) -> None:
    """Called first in a worker process: end it, and the processes it started, as soon as its
    parent process is gone, or ``owner`` (the process that asked for the worker, where that is
    not the parent: a forkserver's child) (Linux, pidfds watched by a daemon thread). An owner
    that was SIGKILLed (the OOM killer) runs no finalizer, and a worker stuck in the dataset
    never looks at its parent: without this it would run on as an orphan, forever."""
    if not hasattr(os, "pidfd_open"):
        return
    parent = os.getppid()
    fds = []
    for pid in {parent, owner or parent}:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:  # already gone
            _die()
        except OSError:  # no pidfds here (a seccomp sandbox, EMFILE): never kill a live worker
            return
    if os.getppid() != parent:  # the parent died before the watch began
        _die()
    poller = select.poll()  # poll, not select: no FD_SETSIZE limit on the pidfds' numbers
    for fd in fds:
        poller.register(fd, select.POLLIN)
    watched = {parent, owner or parent}

    def watch() -> None:
        poller.poll()  # a pidfd is readable once its whole process (not a thread) has exited
        if os.getppid() != parent or not all(pid_alive(p) for p in watched):
            _die()
        # else: a pidfd closed (or its number reused) under the watch: a live owner keeps its
        # worker; the watch ends rather than kill on a false alarm

    threading.Thread(target=watch, name="feedpipe-parent-watch", daemon=True).start()


def _die() -> None:
    family: dict[int, _Descendant] = {}
    _descendants({os.getpid()}, family)
    for d in family.values():
        d.kill()
    os._exit(1)


def pid_alive(pid: int, *, same_user: bool = False) -> bool:
    """Whether process ``pid`` runs: a zombie (dead, not yet reaped) does not; a process of
    another user (``EPERM``) does, unless ``same_user`` (then the pid was reused by another
    user's process: the one asked about is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            running = f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        return running and (not same_user or os.stat(f"/proc/{pid}").st_uid == os.getuid())
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return not same_user
        return True
