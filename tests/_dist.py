"""Run a function on N real ``torch.distributed`` (gloo) ranks on localhost, with a timeout.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of which joins a gloo
process group on a free localhost port, calls ``fn(rank, world_size, *args)`` and sends its
return value back; the parent returns the values in rank order. A rank that raises makes the
call fail with that rank's traceback; ranks still running at the deadline are killed and the
call raises ``TimeoutError`` naming them. ``fn`` and its arguments must be picklable
(module-level functions), as with ``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "run_ranks"]

# after a rank died without reporting, how long the others may still take to report
DEAD_PEER_GRACE_S = 30.0


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(  # noqa: PLR0917 - a Process target takes positional args
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    timeout: float,
) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, args, results, timeout),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: list[str] = []
    try:
        while len(values) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in values
                ]
                if dead and len(values) + len(failures) + len(dead) >= world_size:
                    break  # every rank reported or died: nothing more will come
                if dead and not failures:
                    # a rank died without reporting (killed, segfault): the others get a while
                    # to report (5 s was too short beside a loaded make test), not the timeout
                    deadline = min(deadline, time.monotonic() + DEAD_PEER_GRACE_S)
                continue
            if ok:
                values[rank] = value
            else:
                failures.append(f"rank {rank} of {world_size} failed:\n{value}")
                deadline = min(deadline, time.monotonic() + 5.0)  # peers may be stuck waiting
        if failures:
            raise AssertionError("\n".join(failures))
        missing = [i for i in range(world_size) if i not in values]
        if missing:
            codes = {i: procs[i].exitcode for i in missing}
            raise TimeoutError(
                f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                f"(exit codes {codes})"
            )
        return [values[i] for i in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic() + 5.0)))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
