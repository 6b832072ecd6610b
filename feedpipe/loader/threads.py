"""Thread workers: a pool that calls the dataset directly, with torch's batch order.

Batches are dealt to workers round-robin exactly like torch's process workers (batch ``n`` goes
to the next active worker in the cycle), at most ``prefetch_factor * num_workers`` are in
flight, and they are delivered in sampler order (or as they finish with ``in_order=False``).
Nothing is pickled or copied through shared memory, so this pays off for reads that release
the GIL (numpy/memmap gathers, ``read_batch``).

Inside the threads ``feedpipe.get_worker_info()`` and torch's ``get_worker_info()`` both return
the thread's own ``WorkerInfo`` (``feedpipe.loader._torch_compat``), in ``worker_init_fn`` too, so
an ``IterableDataset`` that shards itself by worker id works as with processes. What threads
cannot have is their own global RNG: :mod:`feedpipe.loader.thread_rng` watches for a
``worker_init_fn`` or a dataset that seeds or draws from it, on each worker's first batch of the
loader's first pass; the rest of that pass is dealt out only after the first ``next()`` has
waited for those batches, so a draw the watch sees is the workers', never the sampler's or
another loader's.

The pool is three objects: :class:`ThreadWorkers` deals index batches and delivers results in
order, :class:`_Crew` owns the threads and their inboxes, and each thread runs one
:class:`_Worker` (set up, then answer each task) with the pool's frozen :class:`_WorkerOptions`.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from feedpipe.errors import WorkerError
from feedpipe.io.reaper import join_threads
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import (
    Failed,
    Mode,
    ShippedTuple,
    fetcher,
)
from feedpipe.loader.inline import InlineSource, next_iterable
from feedpipe.loader.skip import pin_out, skipping
from feedpipe.loader.thread_rng import FirstRound, RNGWatch, note_iter, rng_states

__all__ = ["InlineSource", "RNGWatch", "ThreadWorkers", "note_iter", "thread_worker_info"]

thread_worker_info = _torch_compat.thread_worker_info
_POLL_S = 1.0  # how often a wait without timeout checks that the workers are alive
_EXIT_JOIN_S = 10.0
_INIT_SYNC_S = 5.0


class _Exhausted:
    """A worker's iterable dataset ran out (torch's ``_IterableDatasetStopIteration``)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker


@dataclass(frozen=True)
class _WorkerOptions:
    """What every worker thread of one pool shares (the per-worker parts are its id, dataset
    and inbox)."""

    num_workers: int
    base_seed: int
    collate_fn: Callable[[Any], Any]
    mode: Mode
    results: queue.Queue[tuple[int, int, Any]]  # (batch number, worker, batch or failure)
    init_fn: Callable[[int], None] | None
    pin: bool
    drop_last: bool
    out_for: Callable[[int, int], Any] | None  # READ_BATCH only: the buffer of a batch
    timed: bool
    skip: bool = False  # on_error="skip"
    rng_watch: RNGWatch | None = None
    # with a worker_init_fn, no worker reads before all ran it: the RNG checks of the first
    # batch would otherwise see another worker's worker_init_fn reseeding
    inited: threading.Barrier | None = None
    first: FirstRound | None = None  # the watched first round of the loader's first pass
    init_failed: list[int] | None = None  # workers whose worker_init_fn raised (appended to)


class ThreadWorkers:
    """An iterator over ``ShippedTuple`` batches produced by ``num_workers`` threads.

    ``sampler_iter`` yields index batches (``None`` placeholders for iterable datasets).
    ``datasets``: the workers' datasets of an earlier pool (``persistent_workers``; the loader
    then passes no ``worker_init_fn``: it ran once, as in a persistent worker process).
    ``out_for(batch_number, rows)``, for ``read_batch`` datasets, may return a preallocated
    destination (e.g. a pinned ring slot of a device feed) that the worker gathers into; such
    a batch is not pinned again. Batch numbers count from 0 in each pass.

    Each worker reads its own dataset (a copy of an iterable one, in ``datasets``); persistent
    workers pass the last pass's back in, so what a worker set on its copy stays, as in a
    persistent process.
    """

    def __init__(
        self,
        dataset: Any,
        sampler_iter: Iterator[Any],
        collate_fn: Callable[[Any], Any],
        mode: Mode,
        *,
        num_workers: int,
        prefetch_factor: int,
        base_seed: int,
        timeout: float,
        worker_init_fn: Callable[[int], None] | None,
        pin: bool,
        in_order: bool,
        drop_last: bool,
        out_for: Callable[[int, int], Any] | None = None,
        timed: bool = True,
        skip: bool = False,
        rng_watch: RNGWatch | None = None,
        datasets: list[Any] | None = None,
        tuner: Any = None,  # num_workers="auto" (map-style): asked between deliveries (resize)
    ) -> None:
        self._timeout, self._in_order, self._tuner = timeout, in_order, tuner
        self._results: queue.Queue[tuple[int, int, Any]] = queue.Queue()
        self._shutdown = False
        # the loader's first pass: the first batches' indices are drawn before any worker runs
        # and the main thread waits for those batches, so the RNG checks see the workers only
        self._first, predrawn = FirstRound.drawn(rng_watch, sampler_iter, num_workers)
        self._rng_watch = rng_watch if self._first is not None else None
        self._deal = _Deal(sampler_iter, predrawn, num_workers, prefetch_factor * num_workers)
        self.init_failed: list[int] = []  # workers whose worker_init_fn raised
        self.datasets = datasets or [
            copy.copy(dataset) if mode is Mode.ITERABLE else dataset for _ in range(num_workers)
        ]
        self._crew = _Crew(
            self.datasets,
            _WorkerOptions(
                num_workers=num_workers,
                base_seed=base_seed,
                collate_fn=collate_fn,
                mode=mode,
                results=self._results,
                init_fn=worker_init_fn,
                pin=pin,
                drop_last=drop_last,
                out_for=out_for if mode is Mode.READ_BATCH else None,
                timed=timed,
                skip=skip,
                rng_watch=self._rng_watch,
                inited=threading.Barrier(num_workers) if worker_init_fn is not None else None,
                first=self._first,
                init_failed=self.init_failed,
            ),
        )
        self._first_wait_s = (
            0.0 if timeout > 0 else _INIT_SYNC_S * (1 + (worker_init_fn is not None))
        )
        # a watched pass deals only the first round now, the rest in the first next()
        for _ in range(self._first.batches if self._first is not None else self._deal.max_tasks):
            self._put_task()

    def _end_first_round(self) -> None:
        """First ``next()`` of a watched pass: wait for the first batches, then deal the rest.

        With a timeout there is no extra wait (torch's timeout is per batch): only the first
        batches already read are checked (again in the next pass if not all were).
        """
        first, self._first = self._first, None
        assert first is not None
        try:
            if first.wait(self._first_wait_s) and self._rng_watch is not None:
                self._rng_watch.watching = False
        finally:  # also after Ctrl-C: the pass may go on
            for _ in range(self._deal.max_tasks):
                self._put_task()

    # --------------------------------------------------------------------------- iteration
    def __iter__(self) -> ThreadWorkers:
        return self

    def waiting_on(self) -> tuple[int, int | None]:
        """(batch number, worker) the next ``__next__`` waits for."""
        deal = self._deal
        info = deal.info.get(deal.received)
        return deal.received, (info[0] if info else None)

    def __next__(self) -> ShippedTuple | Failed:
        if self._first is not None:
            self._end_first_round()
        deal = self._deal
        while True:
            if not deal.awaits():
                self.close(join_s=_EXIT_JOIN_S)  # all idle by now: returns at once
                raise StopIteration
            info = deal.info[deal.received]
            if len(info) == 2:  # it came early
                deal.info.pop(deal.received)
                deal.received += 1
                return self._deliver(info[0], info[1])
            idx, wid, data = self._get()
            deal.outstanding -= 1
            if isinstance(data, _Exhausted):
                deal.active[data.worker] = False
                deal.info.pop(idx, None)
                self._put_task()
                continue
            if idx == deal.received:
                deal.info.pop(idx)
                deal.received += 1
                return self._deliver(wid, data)
            if not self._in_order:
                deal.info.pop(idx)
                return self._deliver(wid, data)
            deal.info[idx] = (wid, data)

    def _get(self) -> tuple[int, int, Any]:
        if self._timeout > 0:
            try:
                return self._results.get(timeout=self._timeout)
            except queue.Empty:
                raise TimeoutError(f"DataLoader timed out after {self._timeout} seconds") from None
        while True:
            try:
                return self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = self._crew.dead(self._deal.active)
                if dead:
                    raise WorkerError(
                        f"DataLoader worker thread(s) {dead} exited unexpectedly while loading "
                        f"batch {self._deal.received}"
                    ) from None

    def _deliver(self, wid: int, data: ShippedTuple | Failed) -> ShippedTuple | Failed:
        self._put_task()
        if self._tuner is not None:
            settings = self._tuner.online(self._deal.workers, self._crew.native_ids)
            if settings is not None:
                self.resize(settings.workers, settings.prefetch)
        return data

    def resize(self, workers: int, prefetch: int) -> None:
        """Deal to ``workers`` threads from now on, ``prefetch`` batches each in flight.

        New threads start at once (``worker_init_fn`` runs in each); a thread given back reads
        the batches already dealt to it, then exits. Which samples make up each batch and the
        delivery order do not change: batch numbers come from the same index stream. Map-style
        datasets only (an iterable one shards itself by the worker count)."""
        crew, deal = self._crew, self._deal
        if self._first is not None or self._shutdown:  # the watched first round: not now
            return
        opts = replace(crew.opts, num_workers=workers, inited=None, first=None, rng_watch=None)
        for wid in range(workers):
            if wid >= len(self.datasets):
                self.datasets.append(self.datasets[0])
            if wid >= len(crew.threads) or wid in crew.retired:
                crew.start(wid, self.datasets[wid], opts)
        for wid in range(workers, deal.workers):
            crew.retire(wid)
        deal.resize(workers, prefetch * workers)
        for _ in range(max(0, deal.max_tasks - deal.outstanding)):
            self._put_task()

    def _put_task(self) -> None:
        if self._shutdown:
            return
        task = self._deal.next_task()
        if task is not None:
            self._crew.send(*task)

    def close(self, join_s: float = 0.0) -> None:
        """Tell the threads to exit after their current batch; wait up to ``join_s`` for them."""
        first = getattr(self, "_first", None)
        if first is not None:
            first.close()
        crew = getattr(self, "_crew", None)
        if crew is None:  # __init__ failed before any thread started
            return
        if not self._shutdown:
            self._shutdown = True
            crew.stop()
        if join_s > 0:
            crew.join(join_s)

    def __del__(self) -> None:
        self.close()


class _Deal:
    """Which worker reads which batch, and what is in flight.

    Index batches come from ``sampler_iter`` (the ``predrawn`` first round first, popped from
    the end) and go round-robin to the active workers, at most ``max_tasks`` in flight.
    ``info`` maps each batch number sent and not yet delivered to ``(worker,)`` while it is
    read, or ``(worker, data)`` once it came early; ``received`` is the next batch number to
    deliver in order, ``sent`` the next to send.
    """

    def __init__(
        self, sampler_iter: Iterator[Any], predrawn: list[Any], workers: int, max_tasks: int
    ) -> None:
        self.sampler_iter, self.predrawn = sampler_iter, predrawn
        self.workers = workers
        self.max_tasks = max(1, max_tasks)
        self.active = [True] * workers  # False once a worker's iterable dataset ran out
        self.info: dict[int, tuple[Any, ...]] = {}
        self.cycle = itertools.cycle(range(workers))
        self.sent = self.received = self.outstanding = 0

    def resize(self, workers: int, max_tasks: int) -> None:
        """Deal round-robin to workers ``0..workers-1`` from now on (``ThreadWorkers.resize``)."""
        self.workers, self.max_tasks = workers, max(1, max_tasks)
        self.active.extend([True] * (workers - len(self.active)))
        self.cycle = itertools.cycle(range(workers))

    def next_task(self) -> tuple[int, tuple[int, Any]] | None:
        """``(worker, (batch number, index batch))`` to send next, or None (enough in flight,
        the sampler ran out, or no worker is active)."""
        if self.outstanding >= self.max_tasks:
            return None
        try:
            index = self.predrawn.pop() if self.predrawn else next(self.sampler_iter)
        except StopIteration:
            return None
        for _ in range(self.workers):
            wid = next(self.cycle)
            if self.active[wid]:
                break
        else:
            return None
        task = (self.sent, index)
        self.info[self.sent] = (wid,)
        self.outstanding += 1
        self.sent += 1
        return wid, task

    def awaits(self) -> bool:
        """Whether a batch is still to be delivered, after passing over those that never will
        be (their worker's iterable dataset ran out)."""
        while self.received < self.sent:
            info = self.info.get(self.received)
            if info and (len(info) == 2 or self.active[info[0]]):
                return True
            self.info.pop(self.received, None)
            self.received += 1
        return False


class _Crew:
    """A pool's worker threads, one inbox each: started at once, stopped and joined together.

    Every thread still running is also tracked module-wide (:func:`_track`) until it ends, so
    the interpreter's exit stops and joins it even after its pool is gone.
    """

    def __init__(self, datasets: list[Any], opts: _WorkerOptions) -> None:
        _torch_compat.install_worker_info_shim()  # get_worker_info() in the threads
        self.opts = opts
        self.inboxes: list[queue.Queue[Any]] = []
        self.threads: list[threading.Thread] = []
        self.retired: set[int] = set()  # workers given back (ThreadWorkers.resize)
        for wid, dataset in enumerate(datasets):
            self.start(wid, dataset, opts)

    def start(self, wid: int, dataset: Any, opts: _WorkerOptions) -> None:
        """Start worker ``wid``'s thread (a new one in place of a retired one)."""
        inbox: queue.Queue[Any] = queue.Queue()
        t = threading.Thread(
            target=_worker_loop,
            args=(wid, dataset, inbox, opts),
            name=f"feedpipe-worker-{wid}",
            daemon=True,
        )
        _track(t, inbox)
        t.start()
        if wid < len(self.threads):
            self.threads[wid], self.inboxes[wid] = t, inbox
        else:
            self.threads.append(t)
            self.inboxes.append(inbox)
        self.retired.discard(wid)

    def native_ids(self) -> set[int]:
        """The OS thread ids of the running workers (their CPU is the pool's)."""
        return {t.native_id for t in self.threads if t.native_id is not None and t.is_alive()}

    def retire(self, wid: int) -> None:
        """Worker ``wid`` exits once it has read the tasks queued before (no new ones come)."""
        if wid not in self.retired:
            self.retired.add(wid)
            self.inboxes[wid].put(None)

    def send(self, wid: int, task: tuple[int, Any]) -> None:
        """Queue ``(batch number, index batch)`` for worker ``wid``."""
        self.inboxes[wid].put(task)

    def stop(self) -> None:
        """Each worker exits after the tasks queued before (the stop word ``None``)."""
        for box in self.inboxes:
            box.put(None)

    def join(self, join_s: float) -> None:
        """Wait up to ``join_s`` in all for the threads to end."""
        deadline = time.monotonic() + join_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def dead(self, active: list[bool]) -> list[int]:
        """The active workers whose thread is gone."""
        return [
            w
            for w, t in enumerate(self.threads)
            if active[w] and w not in self.retired and not t.is_alive()
        ]


# Worker threads still running, with their inboxes: told to stop and joined at exit (a pool may
# be gone while its threads finish).
_RUNNING: dict[threading.Thread, queue.Queue[Any]] = {}
_RUNNING_LOCK = threading.Lock()


def _join_at_exit() -> None:
    """Stop the worker threads and let them finish their batch before the interpreter tears
    torch down.

    Daemon threads killed inside a torch call abort the process ("terminate called without an
    active exception"). Every worker thread still running is told to stop (its queued tasks
    dropped, so an iterator still alive at exit costs at most the batches being read, not a
    wait for work that will never come) and joined, including those of pools already dropped
    (after a ``break``, a pool is closed at once but its threads finish their batch); a thread
    stuck in the dataset is abandoned after ``_EXIT_JOIN_S``, and reported by name and native
    id (threads cannot be killed).
    """
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for _, inbox in running:
        _stop_inbox(inbox)
    join_threads([t for t, _ in running], "DataLoader worker", _EXIT_JOIN_S)


def _stop_inbox(inbox: queue.Queue[Any]) -> None:
    """Drop a worker's queued tasks and queue the stop word (``None``) as its next task."""
    try:
        while True:
            inbox.get_nowait()
    except queue.Empty:
        pass
    inbox.put(None)


def _track(thread: threading.Thread, inbox: queue.Queue[Any]) -> None:
    """Remember a worker thread and its inbox until it ends; the exit hook is registered with
    the first one (not at import)."""
    global _HOOKED
    with _RUNNING_LOCK:
        if not _HOOKED:
            atexit.register(_join_at_exit)
            os.register_at_fork(after_in_child=_forget_running)
            _HOOKED = True
        _RUNNING[thread] = inbox


_HOOKED = False


def _forget_running() -> None:
    """In a forked child: none of the parent's worker threads is here, and one of them may have
    held the lock at the fork (the child's exit hook would wait for it for ever)."""
    global _RUNNING_LOCK
    _RUNNING_LOCK = threading.Lock()
    _RUNNING.clear()


# ------------------------------------------------------------------------- the worker thread
def _worker_loop(wid: int, dataset: Any, inbox: queue.Queue[Any], opts: _WorkerOptions) -> None:
    try:
        _worker_body(wid, dataset, inbox, opts)
    finally:
        _torch_compat.set_thread_worker_info(None)
        with _RUNNING_LOCK:
            _RUNNING.pop(threading.current_thread(), None)


def _worker_body(wid: int, dataset: Any, inbox: queue.Queue[Any], opts: _WorkerOptions) -> None:
    worker = _Worker(wid, dataset, opts)
    worker.start()
    while (task := inbox.get()) is not None:
        idx, indices = task
        opts.results.put((idx, wid, worker.answer(idx, indices)))


class _Worker:
    """One worker thread's state and steps: :meth:`start` (worker info, ``worker_init_fn``),
    then :meth:`answer` each task (a batch, a :class:`Failed` or :class:`_Exhausted`).

    ``first`` is the pool's watched first round until this worker's first batch is done; the
    RNG checks run only while it is set.
    """

    def __init__(self, wid: int, dataset: Any, opts: _WorkerOptions) -> None:
        self.wid, self.dataset, self.opts = wid, dataset, opts
        fetch: Any = fetcher(opts.timed)
        self.fetch: Any = skipping(fetch) if opts.skip else fetch  # on_error="skip"
        self.first = opts.first
        self.watch = opts.rng_watch if opts.first is not None else None
        self.init_error: Failed | None = None
        self.iterator: Iterator[Any] | None = None  # an iterable dataset's, from the first task
        self.position = 0  # samples an iterable dataset gave so far

    def start(self) -> None:
        """Publish this thread's ``WorkerInfo``, run ``worker_init_fn`` (checked against the
        global RNGs) and wait for the other workers to have run theirs."""
        opts = self.opts
        seed = opts.base_seed + self.wid
        _torch_compat.set_thread_worker_info(
            _torch_compat.make_worker_info(self.wid, opts.num_workers, seed, self.dataset)
        )
        if opts.init_fn is None:
            return
        before = rng_states() if self.watch is not None else None
        try:
            opts.init_fn(self.wid)
        except (Exception, SystemExit) as exc:  # SystemExit: this thread is not the process
            self.init_error = Failed(exc, self.wid, None)
            if opts.init_failed is not None:
                opts.init_failed.append(self.wid)
        self._check("worker_init_fn", before)
        if opts.inited is not None:
            try:
                opts.inited.wait(_INIT_SYNC_S)
            except threading.BrokenBarrierError:  # a slow worker_init_fn: go on without it
                pass

    def answer(self, idx: int, indices: Any) -> Any:
        """The result of one task: its batch, or what went wrong (never raises)."""
        if self.init_error is not None:
            self._end_first(None)
            return self.init_error
        before = rng_states() if self.watch is not None and self.first is not None else None
        try:
            return self.read(idx, indices)
        except (Exception, SystemExit) as exc:  # SystemExit: this thread is not the process
            iterable = self.opts.mode is Mode.ITERABLE
            where = f"stream position {self.position}" if iterable else indices
            return Failed(exc, self.wid, where)
        finally:
            self._end_first(before)

    def read(self, idx: int, indices: Any) -> Any:
        """One batch (pinned when asked) or :class:`_Exhausted`."""
        opts = self.opts
        if opts.mode is Mode.ITERABLE:
            if self.iterator is None:
                self.iterator = iter(self.dataset)
            out = next_iterable(self.iterator, indices, opts.collate_fn, opts.drop_last)
            if out is None:
                return _Exhausted(self.wid)
            self.position += out[1]
            dest = None
        else:
            dest = opts.out_for(idx, len(indices)) if opts.out_for is not None else None
            out = self.fetch(self.dataset, indices, opts.collate_fn, opts.mode, dest)
        if opts.pin and (opts.out_for is None or dest is None):
            out = pin_out(out)
        return out

    def _check(self, what: str, before: tuple[Any, ...] | None) -> None:
        if self.first is not None and self.watch is not None and before is not None:
            self.first.check(self.watch, what, before)

    def _end_first(self, before: tuple[Any, ...] | None) -> None:
        """This worker's first batch is done: check what it drew, then leave the round."""
        if self.first is None:
            return
        self._check("dataset", before)
        self.first.finish()
        self.first = None
