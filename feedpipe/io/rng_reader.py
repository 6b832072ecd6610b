"""One reader of the process-global random generators at a time, with no garbage collection
while it reads (shared by feedpipe's loader and ckpt's RNG capture, so it lives in
:mod:`feedpipe.io`).

torch's generator calls lock the generator's mutex and hold the GIL while they wait for it; the
call that holds the mutex may run a garbage collection, and so any finalizer, which may let the
GIL go: a second thread then waits for the mutex holding the GIL, and neither moves again (a CI
hang: two thread workers in ``torch.get_rng_state``, one inside a ``LoaderIter`` finalizer).
Waiting for this lock lets the GIL go; with the collector off inside, a reader never lets the GIL
go while it holds the mutex, so a thread that calls torch's generator without this lock (the
training loop's code) cannot hang on it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

from feedpipe.io.forks import ForkLock, first_lock

__all__ = ["one_reader"]

# reentrant: a finalizer run inside (by refcount) may read too; a ForkLock: a child forked while
# another thread read finds it free (made on first use: first_lock)
_READING: list[ForkLock] = []


T = TypeVar("T")


def one_reader(call: Callable[[], T]) -> T:
    """``call()`` (a read or write of the process-global RNGs) with no other such call made
    through here running and the garbage collector off meanwhile (see the module)."""
    with first_lock(_READING).lock:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return call()
        finally:
            if collecting:
                gc.enable()
