"""Thread workers: a pool that calls the dataset directly, with torch's batch order.

Batches are dealt to workers round-robin exactly like torch's process workers (batch ``n`` goes
to the next active worker in the cycle), at most ``prefetch_factor * num_workers`` are in
flight, and they are delivered in sampler order (or as they finish with ``in_order=False``).
Nothing is pickled or copied through shared memory, so this pays off for reads that release
the GIL (numpy/memmap gathers, ``read_batch``).

Inside the threads ``feedpipe.get_worker_info()`` and torch's ``get_worker_info()`` both return
the thread's own ``WorkerInfo`` (``feedpipe.loader._torch_compat``), in ``worker_init_fn`` too, so
an
``IterableDataset`` that shards itself by worker id works as with processes. What threads cannot
have is their own global RNG: a ``worker_init_fn`` that seeds numpy / ``random`` / torch, or a
dataset that draws from them, changes the training loop's RNG. ``RNGWatch`` detects both (by
comparing the global states around ``worker_init_fn`` and around each worker's first batch) and
warns once per loader. The global RNGs are shared with every other thread, so the checks run
on each worker's first batch of the loader's first pass only (``_FirstRound``), whose indices
are drawn before the workers start; the rest of the pass is dealt out only after the first
``next()`` has waited for those batches, and a round during which any loader's ``iter()`` ran
(``note_iter``: its seed draws, as in ``zip(a, b)``) is not judged. A draw they see is the
workers', never the sampler's or another loader's.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import queue
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feedpipe.errors import WorkerError
from feedpipe.io.reaper import join_threads
from feedpipe.loader import _torch_compat
from feedpipe.loader.fetch import (
    Failed,
    Mode,
    ShippedTuple,
    fetch_mid,
    fetch_traced,
    fetcher,
    nbytes_of,
)
from feedpipe.loader.skip import pin_out, skipping

__all__ = ["RNGWatch", "ThreadWorkers", "note_iter", "thread_worker_info"]

thread_worker_info = _torch_compat.thread_worker_info
_POLL_S = 1.0  # how often a wait without timeout checks that the workers are alive


def _rng_states() -> tuple[Any, ...]:
    """The process-global RNG states a thread worker would share with the training loop."""
    np_state: Any = np.random.get_state(legacy=True)
    return (
        random.getstate(),
        np_state[1].tobytes(),
        np_state[2],
        torch.initial_seed(),
        torch.get_rng_state(),
    )


def _changed(before: tuple[Any, ...], after: tuple[Any, ...], seeded: bool) -> list[str]:
    """Which global RNGs changed; ``seeded``: only count torch reseeds (the main thread's
    sampler may draw from torch's global RNG while ``worker_init_fn`` runs)."""
    names = []
    if before[0] != after[0]:
        names.append("random")
    if before[1:3] != after[1:3]:
        names.append("numpy.random")
    if before[3] != after[3] or not (seeded or torch.equal(before[4], after[4])):
        names.append("torch")
    return names


class RNGWatch:
    """Warns once per loader when thread workers seed or draw from the process-global RNGs."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.watching = True  # until a first round was checked in full (``_FirstRound``)

    def check(self, what: str, before: tuple[Any, ...]) -> None:
        """``before`` is :func:`_rng_states` taken before ``what`` ran in a worker thread."""
        names = _changed(before, _rng_states(), seeded=what == "worker_init_fn")
        with self._lock:
            if not names or what in self._warned:
                return
            self._warned.add(what)
        detail = {
            "worker_init_fn": "worker_init_fn seeded the global RNG of "
            + " and ".join(names)
            + " from a thread worker: threads share the training process's RNGs, so this "
            "reseeded the main process (once per worker) instead of seeding a worker",
            "dataset": "the dataset drew from the global RNG of "
            + " and ".join(names)
            + " in a thread worker: threads share it with the training loop and with each "
            "other, so these draws are neither per-worker nor reproducible",
        }[what]
        warnings.warn(
            f"feedpipe: {detail}. Derive randomness from feedpipe.get_worker_info().seed "
            "(e.g. numpy.random.default_rng(seed), torch.Generator().manual_seed(seed)), or "
            'use worker_type="process".',
            RuntimeWarning,
            stacklevel=2,
        )


class _Iters:
    """How many ``iter(loader)`` calls (of any feedpipe loader) began: each may draw from the
    global RNGs in the calling thread."""

    n = 0


def note_iter() -> None:
    """A loader's ``iter()`` begins (call before it draws any seed)."""
    _Iters.n += 1


class _FirstRound:
    """The first batch of each worker, read before the rest of the pass is dealt out.

    Workers run their RNG checks only while ``open`` and no ``iter()`` began since the round
    did; the main thread closes it (under the lock, so no check is half done) in its first
    ``next()`` once those batches are read, before it returns to the user's code.
    """

    def __init__(self, batches: int) -> None:
        self.batches = batches  # workers that got a first batch
        self.open = True
        self._iters = _Iters.n
        self._lock = threading.Lock()
        self._done = threading.Semaphore(0)

    def check(self, watch: RNGWatch, what: str, before: tuple[Any, ...]) -> None:
        """Worker side: check the global RNGs against ``before`` if the round is still clean."""
        with self._lock:
            if self.open and _Iters.n == self._iters:
                watch.check(what, before)

    def close(self) -> None:
        """No more checks (the main thread goes back to the user's code)."""
        with self._lock:
            self.open = False

    def finish(self) -> None:
        """Worker side: this worker's first batch is done (read, failed or never read)."""
        self._done.release()

    def wait(self, timeout: float) -> bool:
        """Main side: wait for every first batch (at most ``timeout``), then close; True if all
        were checked."""
        deadline = time.monotonic() + timeout
        done = 0
        try:
            while done < self.batches and self._done.acquire(
                timeout=max(0.0, deadline - time.monotonic())
            ):
                done += 1
        finally:  # also on KeyboardInterrupt: the caller's code runs next
            with self._lock:
                self.open = False
        return done == self.batches and _Iters.n == self._iters


# Worker threads still running, with their inboxes: told to stop and joined at exit (a pool may
# be gone while its threads finish).
_RUNNING: dict[threading.Thread, queue.Queue[Any]] = {}
_RUNNING_LOCK = threading.Lock()


class _Exhausted:
    """A worker's iterable dataset ran out (torch's ``_IterableDatasetStopIteration``)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker


class ThreadWorkers:
    """An iterator over ``ShippedTuple`` batches produced by ``num_workers`` threads.

    ``sampler_iter`` yields index batches (``None`` placeholders for iterable datasets).
    ``datasets``: the workers' datasets of an earlier pool (``persistent_workers``; the loader
    then passes no ``worker_init_fn``: it ran once, as in a persistent worker process).
    ``out_for(batch_number, rows)``, for ``read_batch`` datasets, may return a preallocated
    destination (e.g. a pinned ring slot of a device feed) that the worker gathers into; such
    a batch is not pinned again. Batch numbers count from 0 in each pass.
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
    ) -> None:
        _torch_compat.install_worker_info_shim()
        self._sampler_iter = sampler_iter
        self._num_workers = num_workers
        self._max_tasks = max(1, prefetch_factor * num_workers)
        self._timeout = timeout
        self._in_order = in_order
        self._results: queue.Queue[tuple[int, int, Any]] = queue.Queue()
        self._inboxes: list[queue.Queue[Any]] = [queue.Queue() for _ in range(num_workers)]
        self._active = [True] * num_workers
        self._task_info: dict[int, tuple[Any, ...]] = {}  # send idx -> (worker,) or (worker, data)
        self._cycle = itertools.cycle(range(num_workers))
        self._send_idx = self._rcvd_idx = self._outstanding = 0
        self._shutdown = False
        self._threads = []
        # with a worker_init_fn, no worker reads before all ran it: the RNG checks of the first
        # batch would otherwise see another worker's worker_init_fn reseeding
        inited = threading.Barrier(num_workers) if worker_init_fn is not None else None
        # the loader's first pass: the first batches' indices are drawn before any worker runs
        # and the main thread waits for those batches, so the RNG checks see the workers only
        self._predrawn: list[Any] = []
        first: _FirstRound | None = None
        if rng_watch is not None and rng_watch.watching:
            self._predrawn = list(itertools.islice(sampler_iter, num_workers))[::-1]
            first = _FirstRound(len(self._predrawn))
        else:
            rng_watch = None
        # each worker's dataset (a copy of an iterable one); persistent workers pass the last
        # pass's back in, so what a worker set on its copy stays, as in a persistent process
        self.init_failed: list[int] = []  # workers whose worker_init_fn raised
        self.datasets = datasets or [
            copy.copy(dataset) if mode is Mode.ITERABLE else dataset for _ in range(num_workers)
        ]
        options = _WorkerOptions(
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
            rng_watch=rng_watch,
            inited=inited,
            first=first,
            init_failed=self.init_failed,
        )
        for wid in range(num_workers):
            ds = self.datasets[wid]
            t = threading.Thread(
                target=_worker_loop,
                args=(wid, ds, self._inboxes[wid], options),
                name=f"feedpipe-worker-{wid}",
                daemon=True,
            )
            _track(t, self._inboxes[wid])
            t.start()
            self._threads.append(t)
        self._first = first
        self._rng_watch = rng_watch
        # with a timeout, no extra wait (torch's timeout is per batch): only the first batches
        # already read by the first next() are checked (again in the next pass if not all were)
        self._first_wait_s = (
            0.0 if timeout > 0 else _INIT_SYNC_S * (1 + (worker_init_fn is not None))
        )
        if first is not None:  # the rest is dealt out in the first next(): _end_first_round
            for _ in range(first.batches):
                self._put_task()
        else:
            for _ in range(self._max_tasks):
                self._put_task()

    def _end_first_round(self) -> None:
        """First ``next()`` of a watched pass: wait for the first batches, then deal the rest."""
        first, self._first = self._first, None
        assert first is not None
        try:
            if first.wait(self._first_wait_s) and self._rng_watch is not None:
                self._rng_watch.watching = False
        finally:  # also after Ctrl-C: the pass may go on
            for _ in range(self._max_tasks):
                self._put_task()

    # --------------------------------------------------------------------------- iteration
    def __iter__(self) -> ThreadWorkers:
        return self

    def waiting_on(self) -> tuple[int, int | None]:
        """(batch number, worker) the next ``__next__`` waits for."""
        info = self._task_info.get(self._rcvd_idx)
        return self._rcvd_idx, (info[0] if info else None)

    def __next__(self) -> ShippedTuple | Failed:
        if self._first is not None:
            self._end_first_round()
        while True:
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info and (len(info) == 2 or self._active[info[0]]):
                    break
                self._task_info.pop(self._rcvd_idx, None)
                self._rcvd_idx += 1
            else:
                self.close(join_s=_EXIT_JOIN_S)  # all idle by now: returns at once
                raise StopIteration
            info = self._task_info[self._rcvd_idx]
            if len(info) == 2:
                self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._deliver(info[0], info[1])
            idx, wid, data = self._get()
            self._outstanding -= 1
            if isinstance(data, _Exhausted):
                self._active[data.worker] = False
                self._task_info.pop(idx, None)
                self._put_task()
                continue
            if idx == self._rcvd_idx:
                self._task_info.pop(idx)
                self._rcvd_idx += 1
                return self._deliver(wid, data)
            if not self._in_order:
                self._task_info.pop(idx)
                return self._deliver(wid, data)
            self._task_info[idx] = (wid, data)

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
                dead = [
                    w for w, t in enumerate(self._threads) if self._active[w] and not t.is_alive()
                ]
                if dead:
                    raise WorkerError(
                        f"DataLoader worker thread(s) {dead} exited unexpectedly while loading "
                        f"batch {self._rcvd_idx}"
                    ) from None

    def _deliver(self, wid: int, data: Any) -> Any:
        self._put_task()
        return data

    def _put_task(self) -> None:
        if self._shutdown or self._outstanding >= self._max_tasks:
            return
        try:
            index = self._predrawn.pop() if self._predrawn else next(self._sampler_iter)
        except StopIteration:
            return
        for _ in range(self._num_workers):
            wid = next(self._cycle)
            if self._active[wid]:
                break
        else:
            return
        self._inboxes[wid].put((self._send_idx, index))
        self._task_info[self._send_idx] = (wid,)
        self._outstanding += 1
        self._send_idx += 1

    def close(self, join_s: float = 0.0) -> None:
        """Tell the threads to exit after their current batch; wait up to ``join_s`` for them."""
        first = getattr(self, "_first", None)
        if first is not None:
            first.close()
        if not self._shutdown:
            self._shutdown = True
            for box in self._inboxes:
                box.put(None)
        if join_s > 0:
            deadline = time.monotonic() + join_s
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        self.close()


_EXIT_JOIN_S = 10.0
_INIT_SYNC_S = 5.0


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
            _HOOKED = True
        _RUNNING[thread] = inbox


_HOOKED = False


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
    inited: threading.Barrier | None = None  # all workers ran worker_init_fn
    first: _FirstRound | None = None  # the watched first round of the loader's first pass
    init_failed: list[int] | None = None  # workers whose worker_init_fn raised (appended to)


def _worker_loop(wid: int, dataset: Any, inbox: queue.Queue[Any], opts: _WorkerOptions) -> None:
    try:
        _worker_body(wid, dataset, inbox, opts)
    finally:
        _torch_compat.set_thread_worker_info(None)
        with _RUNNING_LOCK:
            _RUNNING.pop(threading.current_thread(), None)


def _worker_body(wid: int, dataset: Any, inbox: queue.Queue[Any], opts: _WorkerOptions) -> None:
    results, out_for = opts.results, opts.out_for
    rng_watch, first = opts.rng_watch, opts.first  # both end after the first round
    fetch: Any = fetcher(opts.timed)
    if opts.skip:  # on_error="skip"
        fetch = skipping(fetch)
    iterable = opts.mode is Mode.ITERABLE
    seed = opts.base_seed + wid
    _torch_compat.set_thread_worker_info(
        _torch_compat.make_worker_info(wid, opts.num_workers, seed, dataset)
    )
    init_error: Failed | None = None
    if first is None:  # the RNG checks run in the first round only
        rng_watch = None
    if opts.init_fn is not None:
        before = _rng_states() if rng_watch is not None else None
        try:
            opts.init_fn(wid)
        except (Exception, SystemExit) as exc:  # SystemExit: this thread is not the process
            init_error = Failed(exc, wid, None)
            if opts.init_failed is not None:
                opts.init_failed.append(wid)
        if first is not None and rng_watch is not None and before is not None:
            first.check(rng_watch, "worker_init_fn", before)
        if opts.inited is not None:
            try:
                opts.inited.wait(_INIT_SYNC_S)
            except threading.BrokenBarrierError:  # a slow worker_init_fn: go on without it
                pass
    watch_first = rng_watch is not None
    iterator: Iterator[Any] | None = None
    dest: Any = None
    position = 0
    while True:
        task = inbox.get()
        if task is None:
            return
        idx, indices = task
        if init_error is not None:
            results.put((idx, wid, init_error))
            if first is not None:
                first.finish()
                first = None
            continue
        before = _rng_states() if watch_first else None
        try:
            if iterable:
                if iterator is None:
                    iterator = iter(dataset)
                out = _next_iterable(iterator, indices, opts.collate_fn, opts.drop_last)
                if out is None:
                    results.put((idx, wid, _Exhausted(wid)))
                    continue
                position += out[1]
            else:
                dest = out_for(idx, len(indices)) if out_for is not None else None
                out = fetch(dataset, indices, opts.collate_fn, opts.mode, dest)
            if opts.pin and (out_for is None or dest is None):
                out = pin_out(out)
        except (Exception, SystemExit) as exc:  # SystemExit: this thread is not the process
            where = indices if not iterable else f"stream position {position}"
            results.put((idx, wid, Failed(exc, wid, where)))
            continue
        finally:
            if first is not None:
                if before is not None and rng_watch is not None:
                    first.check(rng_watch, "dataset", before)
                watch_first = False
                first.finish()
                first = None
        results.put((idx, wid, out))


def _next_iterable(
    iterator: Iterator[Any], indices: Any, collate_fn: Callable[[Any], Any], drop_last: bool
) -> ShippedTuple | None:
    """One batch from an iterable dataset, with torch's end-of-stream rules (None: exhausted)."""
    t0 = time.perf_counter()
    if indices is None:  # batch_size=None
        try:
            data = next(iterator)
        except StopIteration:
            return None
        samples = 1
    else:
        data = list(itertools.islice(iterator, len(indices)))
        if not data or (drop_last and len(data) < len(indices)):
            return None
        samples = len(data)
    t1 = time.perf_counter()
    batch = collate_fn(data)
    return (batch, samples, nbytes_of(batch), t1 - t0, time.perf_counter() - t1)


class InlineSource:
    """``num_workers=0``: torch's single-process iterator, minus its per-batch overhead.

    Same RNG draws (index sampler, then torch's base seed, then ``iter(dataset)`` for iterable
    datasets), same fetch rules, same exceptions (the original object, with a note naming the
    sample indices); batches are read by ``fetch_batch`` in the calling thread.
    """

    def __init__(
        self,
        dataset: Any,
        sampler_iter: Iterator[Any],
        collate_fn: Callable[[Any], Any],
        mode: Mode,
        *,
        generator: torch.Generator | None,
        pin: bool,
        drop_last: bool,
        timed: bool = True,
        shared_clock: bool = False,
        skip: bool = False,
    ) -> None:
        self._sampler_iter = sampler_iter
        self._fetch: Any = fetcher(timed)
        # the iterator's clock reads around next() bound the fetch: one read in between does
        # (map-style datasets, no pinning, no NVTX ranges, no skipping; see fetch_mid)
        self.shared_clock = (
            shared_clock and timed and mode is not Mode.ITERABLE and not pin and not skip
            and self._fetch is not fetch_traced
        )  # fmt: skip
        if self.shared_clock:
            self._fetch = fetch_mid
        if skip:  # on_error="skip"
            self._fetch = skipping(self._fetch)
        torch.empty((), dtype=torch.int64).random_(generator=generator)  # torch's base seed draw
        self._dataset, self._collate_fn, self._mode = dataset, collate_fn, mode
        self._pin, self._drop_last = pin, drop_last
        self._iterator = iter(dataset) if mode is Mode.ITERABLE else None
        self._ended = False
        self._position = 0

    def __iter__(self) -> InlineSource:
        return self

    def __next__(self) -> ShippedTuple | Failed:
        indices = next(self._sampler_iter)
        try:
            if self._iterator is not None:
                if self._ended:
                    raise StopIteration
                out = _next_iterable(self._iterator, indices, self._collate_fn, self._drop_last)
                if out is None:
                    self._ended = True
                    raise StopIteration
                self._position += out[1]
            else:
                out = self._fetch(self._dataset, indices, self._collate_fn, self._mode)
            if self._pin:
                out = pin_out(out)
            return out
        except StopIteration:
            raise
        except Exception as exc:
            where = indices if self._iterator is None else f"stream position {self._position}"
            return Failed(exc, None, where)
