"""A worker killed while it held the lock of torch's shared "done" event (its loop reads the event
every turn) must not hang the loader's shutdown: torch's ``_shutdown_workers`` sets that event,
and a lock owned by a dead process is never released (seen once in a fresh-clone run:
test_no_error_arrives_asynchronously_after_a_worker_death, pytest-timeout after 60 s)."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest
import torch
import torch.utils.data as tud

from feedpipe.loader import _torch_compat


class _Rows(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def _hold(event: Any, ready: Any) -> None:
    event._cond.acquire()  # what a worker holds inside event.is_set()
    ready.set()
    threading.Event().wait(60)


@pytest.mark.timeout(120)
def test_stop_workers_returns_when_a_dead_process_holds_the_done_events_lock() -> None:
    loader = tud.DataLoader(_Rows(), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(it._workers_done_event, ready))
    holder.start()
    assert ready.wait(30)
    holder.kill()
    holder.join(30)
    done = threading.Event()

    def stop() -> None:
        _torch_compat.stop_workers(it)
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    assert done.wait(60), "stop_workers waited for a lock held by a dead process"
    assert not any(w.is_alive() for w in it._workers)
