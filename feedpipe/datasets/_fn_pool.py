"""The parts of ``convert(fn, ...)`` run in this process or in a pool of worker processes.

A pool worker dies with its parent (an owner killed outright must not leave workers converting)
and posts the input it is on (:mod:`feedpipe.datasets._fn_board`), so that a worker that dies
is named by its input. A part that fails (or Ctrl-C) ends the others within the reaper's bound:
the pool's own shutdown would wait for every running ``fn``, forever for one that hangs.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from feedpipe.datasets._convert_sink import Sink
from feedpipe.datasets._fn_board import WorkerBoard, take_seat
from feedpipe.datasets._fn_part import write_part
from feedpipe.datasets._fn_task import Task
from feedpipe.datasets._part_pool import drain, pool_context, set_queue
from feedpipe.format import Index
from feedpipe.io.reaper import die_with_parent, end_processes

__all__ = ["PartRunner"]


def _init_worker(q: Any, board: Any = None, seats: Any = None) -> None:
    """A pool worker's start: its progress queue, and a seat on the board."""
    die_with_parent()  # an owner killed outright (OOM) must not leave its workers converting
    set_queue(q)
    if board is not None:
        take_seat(board, seats)


def _as_index(doc: Any) -> Index | None:
    return None if doc is None else Index.from_json(doc, "part manifest")


class PartRunner:
    """Runs ``fn``'s parts into ``sink``: :meth:`run` returns each part's index (None: empty)."""

    def __init__(
        self, fn: Callable[[Any], Any], sink: Sink, shard_bytes: int, workers: int
    ) -> None:
        self.fn, self.sink, self.shard_bytes, self.workers = fn, sink, shard_bytes, workers

    def run(self, todo: Sequence[Task], bar: Any) -> dict[int, Index | None]:
        if not todo:
            return {}
        if self.workers == 1 or len(todo) == 1:
            return self._run_here(todo, bar)
        return self._run_pool(todo, bar)

    def _run_here(self, todo: Sequence[Task], bar: Any) -> dict[int, Index | None]:
        set_queue(None)
        results: dict[int, Index | None] = {}
        for t in todo:
            results[t.part] = _as_index(write_part(self.fn, t, self.sink, self.shard_bytes))
            bar.update(len(t.items))
        return results

    def _run_pool(self, todo: Sequence[Task], bar: Any) -> dict[int, Index | None]:
        ctx = pool_context()
        q = ctx.Queue()
        board = WorkerBoard(ctx, min(self.workers, len(todo)))
        before = {p.pid for p in mp.active_children()}
        pool = ProcessPoolExecutor(
            min(self.workers, len(todo)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(q, *board.seat_args()),
        )
        procs: list[Any] = []
        try:
            futures: dict[Future[Any], Task] = {
                pool.submit(write_part, self.fn, t, self.sink, self.shard_bytes): t for t in todo
            }
            # the pool starts its processes at the first submit: those new since `before`
            procs = [p for p in mp.active_children() if p.pid not in before]
            results = self._collect(futures, board, procs, q, bar)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            end_processes(procs, "convert(fn) worker")
            raise
        pool.shutdown(wait=True)
        drain(q, bar)
        return results

    def _collect(
        self,
        futures: dict[Future[Any], Task],
        board: WorkerBoard,
        procs: list[Any],
        q: Any,
        bar: Any,
    ) -> dict[int, Index | None]:
        """Each part's index as it finishes; a broken pool names the function and input."""
        results: dict[int, Index | None] = {}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            drain(q, bar)
            for fut in finished:
                try:
                    results[futures[fut].part] = _as_index(fut.result())
                except BrokenProcessPool:  # not a bare error: name the function and input
                    raise board.error(self.fn, list(futures.values()), procs) from None
        return results
