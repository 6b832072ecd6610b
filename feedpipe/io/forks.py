"""Whether an object is in the process that made it, or in a child forked since (which holds a
copy of it), told without a system call: ``os.getpid()`` is one, too dear per batch; and locks
that a forked child finds free."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["ForkLock", "ForkStamp", "first_lock"]

_FORKS = [0]  # forks counted in this process since the first stamp (in each child: +1)
_HOOKED = [False]
_LOCKS: weakref.WeakSet[ForkLock] = weakref.WeakSet()


def _forked() -> None:
    _FORKS[0] += 1
    for held in list(_LOCKS):  # the child has one thread: nobody else can hold them here
        held.lock = held.new()


def _hook() -> None:
    if not _HOOKED[0]:
        _HOOKED[0] = True
        os.register_at_fork(after_in_child=_forked)


class ForkLock:
    """A lock, ``.lock`` (reentrant unless ``reentrant=False``), that a forked child finds free:
    the child's copy of a lock that another thread held at the fork would never be released
    (that thread does not exist in the child), so its first use would wait for ever. Use it as
    ``with x.lock:``, looking ``.lock`` up each time (a child's is a new one)."""

    __slots__ = ("__weakref__", "lock", "new")

    def __init__(self, reentrant: bool = True) -> None:
        _hook()
        self.new: type[Any] = threading.RLock if reentrant else threading.Lock
        self.lock: Any = self.new()
        _LOCKS.add(self)


def first_lock(slot: list[ForkLock]) -> ForkLock:
    """``slot``'s :class:`ForkLock`, made on first use: a module's lock without a fork hook at
    import. Threads calling at once all get the first one appended (``append`` is atomic)."""
    if not slot:
        slot.append(ForkLock())
    return slot[0]


class ForkStamp:
    """Made in a process; :meth:`here` is True there and False in any child forked after it
    (a process started by spawn makes its own stamps: pickling one is refused)."""

    __slots__ = ("_forks", "_gen")

    def __init__(self) -> None:
        _hook()
        # the counter is held, not looked up: a ``__del__`` asking at interpreter exit finds
        # module globals already set to None
        self._forks = _FORKS
        self._gen = _FORKS[0]

    def here(self) -> bool:
        """Whether this is the process the stamp was made in."""
        return self._gen == self._forks[0]

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("a ForkStamp belongs to its process; make a new one in the other")
