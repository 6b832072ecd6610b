"""Attacks on the promise of ``ImageLoader.close()`` (tests/test_dali_close.py): once ``close()``
(or a timeout's ``WorkerError``) has returned, no thread of the loader runs or holds DALI's
pipeline, no pipeline is left for another thread to shut down, and the process exits cleanly
(its expected exit status, no "terminate called" abort, no leftover worker or plan directory).

Found here (fixed in feedpipe/dali/stream.py and loader.py):
- a batch DALI failed on left the pipeline in a reference cycle (the error, its traceback and
  the frame of ``Caller.call`` that re-raised it, which held the error and ``pipe.run``): after
  ``close()`` a garbage collection on any thread (a user's thread, a daemon at exit) shut it
  down; a kept ``DatasetError`` (its ``__cause__``'s traceback) kept the pipeline past close();
- ``close()`` from another thread (or ``next()`` on an iterator of a closed loader) went on
  decoding every batch through the repair path: it built a new pipeline and a new caller thread
  after ``close()`` had returned (the ``None`` pipeline's ``AttributeError`` taken for a bad
  record); so did a repair in progress when another thread closed the loader;
- Ctrl-C caught mid-epoch left the interrupted ``pipe.run()``'s result queued: the next epoch
  got it for its first batch ("DALI returned batch 0 out of order").

Real DALI pipelines on the CPU backend; the exit paths run in child interpreters.
"""

from __future__ import annotations

import gc
import os
import signal
import textwrap
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

dali = pytest.importorskip("nvidia.dali")
Image = pytest.importorskip("PIL.Image")

from _procs import key_lines, run_python, wait_gone  # noqa: E402
from test_dali import _corrupt, _jpeg, _loader  # noqa: E402
from test_dali_datasets import BytesDataset, ExplodingDataset, HangingDataset  # noqa: E402

from feedpipe.dali import records, stream  # noqa: E402
from feedpipe.errors import DatasetError, WorkerError  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HERE = threading.current_thread().name


def _dali_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedpipe-dali")]


class Pipes:
    """Every pipeline built in this test (main, fed, probe), held weakly, and the threads that
    shut each down."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Any]] = []
        self.on: dict[int, list[str]] = {}

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)

    def threads(self) -> set[str]:
        return {name for names in self.on.values() for name in names}


@pytest.fixture
def pipes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pipes]:
    gc.collect()
    seen = Pipes()
    mine: set[int] = set()
    for module, name in ((stream, "build_main"), (stream, "build_fed"), (records, "build_probe")):
        build = getattr(module, name)

        def built(*a: Any, _build: Any = build, **kw: Any) -> Any:
            pipe = _build(*a, **kw)
            seen.refs.append(weakref.ref(pipe))
            mine.add(id(pipe))
            return pipe

        monkeypatch.setattr(module, name, built)
    real = dali.Pipeline._shutdown

    def shutdown(self: Any) -> None:
        if self._pipe and id(self) in mine:
            seen.on.setdefault(id(self), []).append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(dali.Pipeline, "_shutdown", shutdown)
    yield seen


def _corrupt_ds(n: int = 8) -> BytesDataset:
    """Record 2 passes the cheap checks (header, end marker) but DALI cannot decode it: DALI
    itself fails on its batch (the repair path)."""
    recs = [_jpeg(i) for i in range(n)]
    recs[2] = _corrupt("corrupt_data", recs[2])
    return BytesDataset(recs)


# ------------------------------------------------------------------ in this process
def test_gc_on_a_user_thread_after_a_failed_batch_shuts_nothing_down(pipes: Pipes) -> None:
    """Broke: the failed batch's error and ``Caller.call``'s frame formed a cycle holding the
    pipeline; a user's thread that collected garbage after close() shut it down (at exit, a
    daemon thread doing so is the CI abort)."""
    gc.disable()  # no collection on this thread meanwhile: only the user's thread collects
    try:
        loader = _loader(_corrupt_ds(), batch_size=4, train=False, shuffle=False,
                         on_error="skip")  # fmt: skip
        assert sum(len(y) for _, y in loader) == 8
        assert loader.skipped_indices == [2]
        loader.close()
        assert pipes.alive() == 0, "a pipeline outlived close()"
        user = threading.Thread(target=gc.collect, name="user-gc")
        user.start()
        user.join(60)
    finally:
        gc.enable()
    assert pipes.threads() <= {HERE}, pipes.on
    assert _dali_threads() == []


@pytest.mark.parametrize("bad", ["undecodable", "unreadable"])
def test_a_kept_dataset_error_does_not_keep_the_pipeline(pipes: Pipes, bad: str) -> None:
    """Broke (undecodable): ``errors.append(e)`` of a ``DatasetError`` kept the pipeline past
    close() (its ``__cause__``'s traceback held ``pipe.run``): it shut down later, wherever the
    list died. Unreadable: the read fails in DALI's worker (``ExplodingDataset``)."""
    errors: list[Exception] = []
    ds = _corrupt_ds() if bad == "undecodable" else ExplodingDataset([_jpeg(i) for i in range(8)])
    loader = _loader(ds, batch_size=4, train=False, shuffle=False, on_error="raise")
    with pytest.raises(DatasetError, match="record 2"):
        try:
            list(loader)
        except DatasetError as e:
            errors.append(e)
            raise
    loader.close()
    assert pipes.alive() == 0, "the kept error holds a pipeline after close()"
    assert pipes.threads() <= {HERE}, pipes.on
    assert _dali_threads() == []
    assert "record 2" in str(errors[0])  # still usable


class _HangUntilOff(HangingDataset):
    """Record 5 hangs while ``hang`` is set (read when a pipeline pickles the dataset)."""

    hang = True

    def __getitem__(self, i: int) -> Any:
        if self.hang:
            return super().__getitem__(i)
        return BytesDataset.__getitem__(self, i)


@pytest.mark.slow  # ~8 s: the 3 s timeout and two pipelines
def test_a_timeout_then_a_new_epoch_rebuilds_and_closes_cleanly(pipes: Pipes) -> None:
    """Held: a timeout's ``WorkerError`` (kept by the user) ends that pipeline and its threads
    before it returns; the next epoch builds a new one that close() ends on this thread."""
    ds = _HangUntilOff([_jpeg(i) for i in range(8)])
    loader = _loader(ds, batch_size=4, train=False, shuffle=False, timeout=3)
    kept: list[WorkerError] = []
    try:
        list(loader)
    except WorkerError as e:
        kept.append(e)
    assert kept and "within 3 s" in str(kept[0])
    assert _dali_threads() == [] and pipes.alive() == 0
    ds.hang = False
    assert [y.tolist() for _, y in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    loader.close()
    assert pipes.alive() == 0 and _dali_threads() == []
    assert len(pipes.on) == 2  # both pipelines shut down


def test_next_on_an_iterator_of_a_closed_loader_raises_and_builds_nothing(pipes: Pipes) -> None:
    """Broke: ``next(it)`` after ``loader.close()`` decoded the batch through the repair path
    (the closed stream's ``None`` pipeline taken for a bad record): a new pipeline and a new
    caller thread after close(), left running."""
    loader = _loader(BytesDataset([_jpeg(i) for i in range(16)]), batch_size=4, train=False,
                     shuffle=False)  # fmt: skip
    it = iter(loader)
    next(it)
    loader.close()
    built = len(pipes.refs)
    with pytest.raises(WorkerError, match="closed"):
        next(it)
    assert len(pipes.refs) == built, "a pipeline was built after close()"
    assert _dali_threads() == [] and pipes.alive() == 0
    assert loader.skipped == 0
    assert pipes.threads() <= {HERE}, pipes.on
    # a new epoch on the closed loader builds a new pipeline (ImageLoader.close's docstring)
    assert [y.tolist() for _, y in loader] == [list(range(b, b + 4)) for b in (0, 4, 8, 12)]
    loader.close()
    assert _dali_threads() == [] and pipes.alive() == 0


def test_close_from_another_thread_while_one_iterates(pipes: Pipes, tmp_path: Path) -> None:
    """Broke: the iterating thread went on after another thread's close(), every batch decoded
    by a new pipeline (and caller thread) built after close(). Now its next batch raises a
    ``WorkerError`` saying the loader was closed. (Record 9 is held until close() returned:
    the epoch cannot end first; close() ends the holding worker, 2 s of the reaper's grace.)"""
    ds = _HoldAt9([_jpeg(i) for i in range(24)])
    ds.marker, ds.release = str(tmp_path / "reached"), str(tmp_path / "release")
    loader = _loader(ds, batch_size=2, train=False, shuffle=False)
    closed = threading.Event()
    outcome: list[str] = []

    def iterate() -> None:
        try:
            for _, y in loader:
                if closed.is_set():
                    outcome.append(f"batch {y.tolist()} after close")
        except WorkerError as e:
            outcome.append(f"WorkerError {e}")

    user = threading.Thread(target=iterate, name="user-train")
    user.start()
    while not os.path.exists(ds.marker) and user.is_alive():
        user.join(0.01)
    built = len(pipes.refs)
    try:
        loader.close()
    finally:
        closed.set()
        Path(ds.release).touch()
        user.join(60)
    assert not user.is_alive()
    assert len(pipes.refs) == built, f"a pipeline was built after close(): {outcome}"
    assert outcome and "closed" in outcome[-1], outcome
    assert _dali_threads() == [] and pipes.alive() == 0
    assert pipes.threads() <= {HERE, "user-train"}, pipes.on


class _HeldInRepair(BytesDataset):
    """Record 2 (undecodable) read in ``owner`` (the repair's read, in the loader's process)
    creates ``marker``, then waits (at most 60 s) for the file ``release``."""

    owner = 0
    marker = release = ""

    def __getitem__(self, i: int) -> Any:
        if i == 2 and os.getpid() == self.owner:
            import time

            open(self.marker, "a").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().__getitem__(i)


def test_close_from_another_thread_during_a_repair(pipes: Pipes, tmp_path: Path) -> None:
    """Broke: close() while the iterating thread repaired a batch DALI failed on: the repair
    went on after close(), building a probe, a fed pipeline and a caller thread, and delivered
    the batch; they stayed. Now the iterating thread raises the closed ``WorkerError`` and
    leaves nothing: no pipeline alive, no thread of the loader."""
    ds = _HeldInRepair(list(_corrupt_ds(8).records))
    ds.owner = os.getpid()
    ds.marker, ds.release = str(tmp_path / "reached"), str(tmp_path / "release")
    loader = _loader(ds, batch_size=4, train=False, shuffle=False, on_error="skip")
    outcome: list[str] = []

    def iterate() -> None:
        try:
            for _, y in loader:
                outcome.append(f"batch {y.tolist()}")
        except WorkerError as e:
            outcome.append(f"WorkerError {e}")

    user = threading.Thread(target=iterate, name="user-train")
    user.start()
    try:
        while not os.path.exists(ds.marker) and user.is_alive():
            user.join(0.01)
        loader.close()
    finally:
        Path(ds.release).touch()
        user.join(60)
    assert not user.is_alive()
    assert outcome and "closed" in outcome[-1], outcome
    assert not any(o.startswith("batch") for o in outcome), outcome  # batch 0 was being repaired
    assert _dali_threads() == [] and pipes.alive() == 0, (_dali_threads(), pipes.alive())


class _HoldAt9(BytesDataset):
    """Record 9 creates ``marker``, then waits (at most 60 s) for the file ``release``."""

    marker = release = ""

    def __getitem__(self, i: int) -> Any:
        if i == 9 and not os.path.exists(self.release):
            import time

            open(self.marker, "a").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().__getitem__(i)


def test_ctrl_c_mid_epoch_then_a_new_epoch_on_the_same_loader(pipes: Pipes, tmp_path: Path) -> None:
    """Broke: Ctrl-C caught mid-epoch (a notebook cell interrupted, run again): the caller
    thread finished the interrupted ``pipe.run()`` and its result waited in the queue, so the
    next epoch got it for its first batch ("DALI returned batch 0 out of order"). The stale
    result is now dropped; the next epoch is right and close() ends everything here."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Ctrl-C reaches the main thread only")
    ds = _HoldAt9([_jpeg(i) for i in range(16)])
    ds.marker, ds.release = str(tmp_path / "reached"), str(tmp_path / "release")
    loader = _loader(ds, batch_size=2, train=False, shuffle=False)

    def ctrl_c() -> None:
        while not os.path.exists(ds.marker):
            gone.wait(0.01)
        main = threading.main_thread().ident
        assert main is not None
        signal.pthread_kill(main, signal.SIGINT)  # a real Ctrl-C, to the main thread

    gone = threading.Event()
    presser = threading.Thread(target=ctrl_c, name="ctrl-c")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    got: list[list[int]] = []
    try:
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            for _, y in loader:  # record 9 (batch 4) is held until the Ctrl-C came
                got.append(y.tolist())
    finally:
        Path(ds.release).touch()
        gone.set()
        presser.join(60)
        signal.signal(signal.SIGINT, old)
    assert got == [[2 * b, 2 * b + 1] for b in range(len(got))] and len(got) <= 4
    assert [y.tolist() for _, y in loader] == [[2 * b, 2 * b + 1] for b in range(8)]
    loader.close()
    assert pipes.alive() == 0 and _dali_threads() == []
    assert pipes.threads() <= {HERE}, pipes.on


# ------------------------------------------------------------------ exit paths, in a child
_CHILD = """
import gc, os, signal, sys, threading, time
sys.path[:0] = [{tests!r}]
import nvidia.dali as dali
from _procs import descendants
from test_dali_datasets import BytesDataset
from feedpipe.dali import ImageLoader

CLOSED = []
_real = dali.Pipeline._shutdown

def _shutdown(self):  # every pipeline shutdown after a close() returned, and its thread
    if self._pipe and CLOSED:
        print("LATE_SHUTDOWN", threading.current_thread().name, flush=True)
    _real(self)

dali.Pipeline._shutdown = _shutdown
records = [open(os.path.join({tmp!r}, f"{{i}}.jpg"), "rb").read() for i in range(16)]
MARKER, RELEASE = os.path.join({tmp!r}, "reached"), os.path.join({tmp!r}, "release")

class Held(BytesDataset):  # record 9 waits (60 s at most) for RELEASE, after making MARKER
    def __getitem__(self, i):
        if i == 9:
            open(MARKER, "a").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(RELEASE) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().__getitem__(i)

def signal_main_at_record_9(sig):  # from a thread: the main thread waits for that batch
    def send():
        while not os.path.exists(MARKER):
            time.sleep(0.01)
        print("WORKERS", *descendants(), flush=True)
        signal.pthread_kill(threading.main_thread().ident, sig)
    threading.Thread(target=send, daemon=True).start()

def make(recs=records, ds=BytesDataset, **kw):
    return ImageLoader(ds(recs), 4, device="cpu", crop=32, resize=40, num_threads=1,
                       py_num_workers=1, train=False, shuffle=False, timeout=60, **kw)

def close(loader):
    loader.close()
    CLOSED.append(1)

def main():
    print("PID", os.getpid(), flush=True)
{body}
    print("WORKERS", *descendants(), flush=True)
    return kept

if __name__ == "__main__":
    kept = main()
    print("END", flush=True)
"""

_MID_EPOCH = """
loader = make()
it = iter(loader)
next(it)  # DALI is producing the next batches
print("WORKERS", *descendants(), flush=True)
"""

_BAD = """
bad = list(records)
bad[2] = open(os.path.join({tmp!r}, "bad.jpg"), "rb").read()  # DALI itself fails on it
"""

# name: (body, expected exit status)
_EXITS: dict[str, tuple[str, int]] = {
    # an exception escapes the training loop mid-epoch: exit status 1, not an abort (-6)
    "uncaught_mid_epoch": (_MID_EPOCH + "raise RuntimeError('boom in the training loop')", 1),
    # a corrupt record, on_error="raise": the DatasetError escapes (exit status 1, no abort)
    "dataset_error_uncaught": (_BAD + "kept = make(bad)\nlist(kept)", 1),
    # a DALI-failed batch repaired, close(), then a user's daemon thread collecting garbage
    # while the interpreter exits (the CI abort's shape: a pipeline shut down on a daemon)
    "daemon_gc_after_failed_batch": (
        _BAD
        + textwrap.dedent("""
        loader = make(bad, on_error="skip")
        print("N", sum(len(y) for _, y in loader), flush=True)
        close(loader)
        def churn():
            while True:
                gc.collect()
                time.sleep(0.005)
        threading.Thread(target=churn, name="user-daemon", daemon=True).start()
        kept = None
        """),
        0,
    ),
}
_SLOW_EXITS: dict[str, tuple[str, int]] = {
    # for ... break, then exit (the generator left suspended, the loader a live global)
    "break_no_close": ("loader = make()\nfor x, y in loader:\n    break\nkept = loader", 0),
    # the loader and its suspended iterator alive at exit, never closed
    "no_close_mid_epoch": (_MID_EPOCH + "kept = (loader, it)", 0),
    # Ctrl-C mid-epoch: Python ends itself by SIGINT (the status a shell sees as 130)
    "sigint_mid_epoch": (
        _MID_EPOCH + "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(60)",
        -signal.SIGINT,
    ),
    # a corrupt record skipped (the repaired batch path), never closed
    "skip_no_close": (_BAD + "kept = make(bad, on_error='skip')\nprint('N', len(list(kept)))", 0),
    "sys_exit_mid_epoch": (_MID_EPOCH + "sys.exit(0)", 0),
    "del_mid_epoch": (_MID_EPOCH + "del it, loader\nkept = None", 0),
    "sigterm_handler_mid_epoch": (
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        + _MID_EPOCH
        + "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(60)",
        143,
    ),
    # a scheduler's SIGTERM while the main thread waits for a batch; its handler closes the
    # loader, then exits
    "sigterm_handler_closes_while_waiting": (
        textwrap.dedent("""
        loader = make(ds=Held)
        signal.signal(signal.SIGTERM, lambda *a: (close(loader), sys.exit(143)))
        signal_main_at_record_9(signal.SIGTERM)
        for x, y in loader:
            pass
        """),
        143,
    ),
    # Ctrl-C while the main thread waits for a batch, caught; then close() and a normal exit
    "ctrl_c_while_waiting_caught_then_close": (
        textwrap.dedent("""
        loader = make(ds=Held)
        signal_main_at_record_9(signal.SIGINT)
        try:
            for x, y in loader:
                pass
        except KeyboardInterrupt:
            close(loader)
        kept = None
        """),
        0,
    ),
    # a user's daemon thread iterating, blocked in next() (DALI waits for a held record),
    # while the main thread returns without close(): the interpreter exits under it
    "daemon_thread_blocked_in_next_at_exit": (
        textwrap.dedent("""
        loader = make(ds=Held)
        def iterate():
            for x, y in loader:
                pass
        threading.Thread(target=iterate, name="user-prefetch", daemon=True).start()
        while not os.path.exists(MARKER):
            time.sleep(0.01)
        kept = loader
        """),
        0,
    ),
    # Ctrl-C again while close() waits for a stuck worker (close() interrupted, uncaught)
    "ctrl_c_during_close": (
        textwrap.dedent("""
        import feedpipe.io.reaper as reaper
        real_end = reaper.end_processes
        def end(*a, **kw):  # the signal comes as close() starts ending the workers
            reaper.end_processes = real_end
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return real_end(*a, **kw)
        loader = make(ds=Held)
        it = iter(loader)
        next(it)
        while not os.path.exists(MARKER):
            time.sleep(0.01)
        print("WORKERS", *descendants(), flush=True)
        reaper.end_processes = end
        close(loader)
        """),
        -signal.SIGINT,
    ),
    "two_loaders_one_closed": (
        # b (not closed) shuts down at exit: a.close(), not close(a) (no late-shutdown check)
        "a, b = make(), make()\nnext(iter(a))\nkept = (b, iter(b))\nnext(kept[1])\na.close()",
        0,
    ),
    "close_after_a_timeout_kept_error": (
        textwrap.dedent("""
        import test_dali_datasets
        loader = ImageLoader(test_dali_datasets.HangingDataset(records), 4, device="cpu",
                             crop=32, resize=40, num_threads=1, py_num_workers=1, train=False,
                             shuffle=False, timeout=3)
        try:
            list(loader)
        except Exception as e:
            kept = e
        close(loader)
        """),
        0,
    ),
}


# close() from a signal handler that interrupted the main thread's wait for a batch: that wait
# (the loader's run(), below the handler on the same thread) still holds the pipeline; it shuts
# down on the main thread as the handler's SystemExit unwinds it, after close() returned (no
# abort: never on another thread). Only a shutdown on another thread fails these cases.
_LATE_ON_MAIN_THREAD = {"sigterm_handler_closes_while_waiting"}


def _run_exit(tmp_path: Path, body: str, status: int, late_on_main: bool = False) -> None:
    for i in range(16):
        (tmp_path / f"{i}.jpg").write_bytes(_jpeg(i))
    (tmp_path / "bad.jpg").write_bytes(_corrupt("corrupt_data", _jpeg(2)))
    body = textwrap.indent(body.replace("{tmp!r}", repr(str(tmp_path))), "    ")
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(Path(__file__).parent), tmp=str(tmp_path), body=body))
    proc = run_python(script, timeout=100)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == status, f"exit status {proc.returncode}: {err[-3000:]}"
    assert "terminate called" not in err and "Fatal Python error" not in err, err[-3000:]
    late = [line for line in out.splitlines() if line.startswith("LATE_SHUTDOWN")]
    if late_on_main:
        late = [line for line in late if line != "LATE_SHUTDOWN MainThread"]
    assert late == [], f"a pipeline shut down after close(): {out}"
    lines = key_lines(out)
    pid = int(lines["PID"])
    workers = [int(p) for p in lines.get("WORKERS", "").split()]
    assert wait_gone(workers, 30.0) == []  # no worker outlives the interpreter (30 s: load)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"feedpipe-dali-{pid}-")]


@pytest.mark.parametrize("case", sorted(_EXITS))
def test_exit_paths(tmp_path: Path, case: str) -> None:
    """Held (except the daemon gc case, fixed): each exit path ends with its expected status,
    no abort, no pipeline shut down after close(), no leftover worker or plan directory."""
    _run_exit(tmp_path, *_EXITS[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_SLOW_EXITS))
def test_exit_paths_slow(tmp_path: Path, case: str) -> None:
    """Held: the same for more exit paths (slow: a child interpreter each, ~5 s)."""
    _run_exit(tmp_path, *_SLOW_EXITS[case], late_on_main=case in _LATE_ON_MAIN_THREAD)
