"""Preemption: turn SIGTERM/SIGUSR1 into a save at the next step boundary, on every rank at once.

``CheckpointManager(..., save_on_preemption=True)`` creates a ``Preemption``. It installs a
handler for each of ``PreemptionOptions.signals`` (SIGTERM and SIGUSR1: what SLURM and
Kubernetes send before a kill) from the main thread; constructing it in another thread raises
``ValueError``, as ``signal.signal`` does. The handler only records the signal (it allocates
nothing, logs nothing and never interrupts a save in progress), then calls the handler that was
installed before it if that was a Python function; ``SIG_DFL`` and ``SIG_IGN`` are not called
(the default action would kill the process before it saves). A second signal changes nothing.
``close()`` puts the previous handlers back (skipping those of Preemptions already closed), unless
someone replaced ours in the meantime; a closed handler still reached only passes the signal on.
``close(exit_code=N)`` is what ``save_and_exit`` calls once its save is durable: where the
previous handler was ``SIG_DFL``, it installs one that raises ``SystemExit(N)`` instead, so a
second SIGTERM while the process winds down (threads joining, ``atexit``) still ends it with the
promised status, never with the signal's default death (-15). A process that caught that
``SystemExit`` and goes on (a test, a notebook) gets ``SIG_DFL`` back with its next
``Preemption``: one is never chained to the other.

``reached(step)`` is the agreed decision. On one process it is whether a signal (or
``notify()``, the hook for cloud preemption notices) arrived. With ``torch.distributed``
initialized and more than one rank, every rank must call it for the same steps: on each step
that is a multiple of ``sync_every`` it runs one ``all_reduce(MAX)`` of a one-element CPU tensor
over a gloo group (the default group if its backend is gloo, else a gloo group it creates on its
first call), so all ranks see True at the same step even when only one rank was signalled; the
other steps cost nothing. Once True it stays True, without further collectives.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption", "PreemptionOptions"]

log = logging.getLogger("ckpt")

PREEMPTED_EXIT_CODE = 75
"""The exit status of ``CheckpointManager.save_and_exit``: ``EX_TEMPFAIL`` of ``sysexits.h``
("temporary failure, retry later"), distinct from success (0) and from a crash (1)."""


@dataclass(frozen=True)
class PreemptionOptions:
    """``signals`` to handle; ``sync_every``: steps between two agreements across ranks (one
    ``all_reduce`` each); ``deadline_s``: how long ``save_and_exit`` waits for the save to be
    durable (and uploaded); ``exit_code``; ``group``: the process group of the agreement
    (``None``: see the module docstring)."""

    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
    sync_every: int = 1
    deadline_s: float = 60.0
    exit_code: int = PREEMPTED_EXIT_CODE
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int):
            raise ValueError(f"sync_every must be an int >= 1, got {self.sync_every!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {self.sync_every!r}")
        if not 0 < self.deadline_s < float("inf"):  # inf overflowed the waits in save_and_exit
            raise ValueError(f"deadline_s must be a finite number > 0, got {self.deadline_s!r}")


_Handler = Callable[[int, FrameType | None], Any] | int | None


class Preemption:
    """The signal handlers, the local flag and the agreement across ranks (module docstring)."""

    def __init__(self, options: PreemptionOptions | None = None) -> None:
        self.options = options or PreemptionOptions()
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "save_on_preemption=True installs signal handlers, which only the main thread "
                "can do: create the CheckpointManager in the main thread"
            )
        self.signalled: int | None = None
        self.agreed_step: int | None = None
        self._checked: tuple[int, bool] | None = None
        self._group: Any = None
        self._previous: dict[int, _Handler] = {}
        self._closed = False
        try:
            for sig in self.options.signals:
                if sig not in self._previous:  # twice would chain our handler to itself
                    previous = signal.signal(sig, self._handle)
                    if isinstance(previous, _ExitWith):  # a caught save_and_exit's: not chained
                        previous = signal.SIG_DFL
                    self._previous[sig] = previous
        except BaseException:  # e.g. SIGKILL cannot be caught: install nothing, not a part
            self.close()
            raise

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:  # still reachable through a handler chained over ours: pass it on
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            return
        if self.signalled is None:
            self.signalled = signum
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran: the handlers chained over ours only pass signals on."""
        return self._closed

    def previous_handler(self, sig: int, default: Any = signal.SIG_DFL) -> Any:
        """The handler of ``sig`` that ours replaced (``default`` if none was recorded)."""
        return self._previous.get(sig, default)

    def notify(self, signum: int = 0) -> None:
        """Record a preemption notice from elsewhere (a cloud metadata watcher, any thread)."""
        if self.signalled is None:
            self.signalled = signum

    def reached(self, step: int) -> bool:
        """Whether the loop must save ``step`` and exit (the same answer on every rank)."""
        if self.agreed_step is not None:
            return True
        if self._checked is not None and self._checked[0] == step:
            return self._checked[1]
        local = self.signalled is not None
        agreed = local
        if _world_size() > 1:
            agreed = False
            if step % self.options.sync_every == 0:
                agreed = self._all_reduce_max(local)
        self._checked = (step, agreed)
        if agreed:
            self.agreed_step = step
            how = _name(self.signalled) if local else "another rank"
            log.warning("ckpt: preemption (%s): saving step %d and exiting", how, step)
        return agreed

    def _all_reduce_max(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        group = self.options.group
        if group is None:
            if self._group is None:
                gloo = dist.get_backend() == "gloo"
                self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
            group = self._group
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())

    def close(self, exit_code: int | None = None) -> None:
        """Put back the previous handlers (main thread only; ours only where still installed);
        with ``exit_code``, ``SIG_DFL`` becomes ``_ExitWith(exit_code)`` (module docstring)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._closed = True
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                # a closed Preemption's handler (another manager closed first) is skipped
                while isinstance(getattr(previous, "__self__", None), Preemption):
                    owner: Preemption = previous.__self__  # type: ignore[union-attr]
                    if not owner.closed:
                        break
                    previous = owner.previous_handler(sig)
                if previous in (None, signal.SIG_DFL) and exit_code is not None:
                    previous = _ExitWith(exit_code)  # exiting: a signal must not change the status
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


class _ExitWith:
    """A signal handler that raises ``SystemExit(code)``: what a preemption signal does once
    ``save_and_exit`` has committed its step and the process is exiting with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(self.code)


def _name(signum: int | None) -> str:
    """``SIGTERM`` for a signal number; ``notify()``'s 0 (or any other number) as a notice."""
    try:
        return signal.Signals(signum).name if signum else "preemption notice"
    except ValueError:
        return f"preemption notice {signum}"


def _world_size() -> int:
    import sys

    if "torch.distributed" not in sys.modules:
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())
