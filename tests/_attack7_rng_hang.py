"""Run by tests/test_attack7_rng.py in a child process: a thread worker reads the global RNG
states (``rng_states``, its first batch) while a garbage collection inside torch's
``get_rng_state`` (the generator's mutex held) runs a finalizer that lets the GIL go, as a
LoaderIter's does; meanwhile another thread reads torch's generator: a second worker (the CI
hang), the training loop's own ``torch.get_rng_state``, or the loader's saved state
(``rng_state.global_state``). Prints ``ok <fired> <holder alive>`` unless it hangs."""

from __future__ import annotations

import gc
import inspect
import sys
import threading

import torch

from feedpipe.loader import rng_state
from feedpipe.loader.thread_rng import rng_states

WAITER = sys.argv[1]  # "torch" / "feedpipe": the main thread; "worker": a second thread worker
sys.setswitchinterval(5.0)  # a thread keeps the GIL until it waits: no timing in this script
go, reading = threading.Event(), threading.Event()
fired: list[bool] = []


def in_generator_call() -> bool:
    """The collection runs inside torch.get_rng_state's C call (the generator's mutex held)."""
    frame = inspect.currentframe()
    for _ in range(2):  # this function's caller (the callback), then the code collected in
        frame = frame.f_back if frame is not None else None
    return (
        frame is not None
        and frame.f_code.co_name == "get_rng_state"
        and "torch" in frame.f_code.co_filename
    )


def collecting(phase: str, info: dict[str, int]) -> None:
    here = threading.current_thread() is holder_thread
    if phase == "start" and here and not fired and in_generator_call():
        fired.append(True)
        go.set()
        reading.wait(30)  # lets the GIL go, as a finalizer that joins a thread does


class Garbage:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def holder() -> None:
    """A thread worker reading the RNG states (its first batch), garbage collected meanwhile."""
    for _ in range(5000):
        if fired:
            break
        Garbage()
        rng_states()
    go.set()


def waiter() -> None:
    go.wait(60)
    if fired:
        reading.set()  # the holder's wait ends once this read blocks or returns
        {"torch": torch.get_rng_state, "feedpipe": rng_state.global_state, "worker": rng_states}[
            WAITER
        ]()


holder_thread = threading.Thread(name="holder", target=holder, daemon=True)
gc.callbacks.append(collecting)
gc.set_threshold(1, 1000, 1000)
holder_thread.start()
if WAITER == "worker":
    other = threading.Thread(target=waiter, daemon=True)
    other.start()
    other.join(60)
else:
    waiter()
holder_thread.join(60)
print("ok", bool(fired), holder_thread.is_alive())
