"""Workers that die, time out or raise: a clear error naming worker and samples, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from _helpers import rng_warnings as _rng_warnings
from _procs import key_lines, run_python, shm_entries, wait_gone
from torch.utils.data import Dataset, IterableDataset

from feedpipe import DataLoader
from feedpipe.errors import WorkerError

pytestmark = pytest.mark.timeout(60)

BAD = 13  # sample index that misbehaves; with batch_size=4 it is in batch 3 -> worker 1 of 2
BATCH_OF_BAD = [12, 13, 14, 15]


class Faulty(Dataset):
    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        if i == BAD:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "hang":
                time.sleep(4)
            elif self.how == "raise":
                raise KeyError(f"record {i} is corrupt")
        return torch.tensor(i)


class FaultyStream(IterableDataset):
    def __iter__(self) -> Any:
        for i in range(10):
            if i == 6:
                raise OSError("stream broke")
            yield i


def test_killed_process_worker_is_named() -> None:
    loader = DataLoader(Faulty("kill"), batch_size=4, num_workers=2)
    got = []
    with pytest.raises(WorkerError) as err:
        for batch in loader:
            got.append(batch)
    msg = str(err.value)
    assert "worker 1" in msg and "died" in msg and "-9" in msg, msg
    # the batch it was reading is named (results it had sent but not flushed may be lost too)
    assert f"batch 3 (sample indices {BATCH_OF_BAD})" in msg, msg
    assert len(got) <= 3


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_timeout_is_named(worker_type: str) -> None:
    loader = DataLoader(
        Faulty("hang"), batch_size=4, num_workers=2, timeout=1.5, worker_type=worker_type
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(WorkerError) as err:
        next(it)
    msg = str(err.value)
    del it, err  # torch joins the sleeping worker (up to 4 s) before terminating it
    assert "worker 1 timed out after 1.5 s" in msg, msg
    assert f"batch 3 (sample indices {BATCH_OF_BAD})" in msg, msg


@pytest.mark.parametrize(
    ("worker_type", "num_workers"), [("process", 0), ("process", 2), ("thread", 2)]
)
def test_raising_worker_keeps_type_and_names_samples(worker_type: str, num_workers: int) -> None:
    loader = DataLoader(
        Faulty("raise"), batch_size=4, num_workers=num_workers, worker_type=worker_type
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(KeyError) as err:
        next(it)
    text = str(err.value) + " ".join(getattr(err.value, "__notes__", []))
    assert "record 13 is corrupt" in text
    assert f"sample indices {BATCH_OF_BAD}" in text and "batch 3" in text, text
    where = "in the main process" if num_workers == 0 else "in DataLoader worker 1"
    assert where in text, text
    # like torch, the loader goes on after a failed batch
    rest = [b.tolist() for b in it]
    assert rest == [[16, 17, 18, 19], [20, 21, 22, 23]]


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_raising_iterable_names_stream_position(worker_type: str) -> None:
    loader = DataLoader(FaultyStream(), batch_size=4, num_workers=1, worker_type=worker_type)
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(OSError) as err:
        next(it)
    text = str(err.value) + " ".join(getattr(err.value, "__notes__", []))
    assert "stream broke" in text and "worker 0" in text and "stream position" in text, text


def test_raising_collate_is_named() -> None:
    def bad_collate(samples: list[Any]) -> Any:
        raise TypeError("cannot collate")

    for wt in ("process", "thread"):
        loader = DataLoader(
            Faulty("ok"), batch_size=4, num_workers=2, collate_fn=bad_collate, worker_type=wt
        )
        with pytest.raises(TypeError) as err:
            next(iter(loader))
        text = str(err.value) + " ".join(getattr(err.value, "__notes__", []))
        assert "cannot collate" in text and "sample indices [0, 1, 2, 3]" in text, text


def test_thread_worker_init_failure_is_reported() -> None:
    def init(wid: int) -> None:
        raise RuntimeError(f"init failed in {wid}")

    loader = DataLoader(
        Faulty("ok"), batch_size=4, num_workers=2, worker_type="thread", worker_init_fn=init
    )
    with pytest.raises(RuntimeError, match="init failed in 0"):
        next(iter(loader))


_HUNG_SCRIPT = """
import gc, os, signal, sys, time
sys.path[:0] = [{tests!r}]
import torch
from torch.utils.data import Dataset
from _procs import alive, descendants
from feedpipe import DataLoader

MARKER = {marker!r}


class Hung(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5:  # a read that never returns, in a worker that ignores SIGTERM
            open(MARKER, "a").close()
            time.sleep(1e9)
        return torch.tensor(i)


def deaf(worker_id):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main():
    loader = DataLoader(Hung(), batch_size=2, num_workers=1, worker_init_fn=deaf,
                        multiprocessing_context={context!r}, persistent_workers={persistent})
    it = iter(loader)
    next(it)
    while not os.path.exists(MARKER):
        time.sleep(0.01)
    print("PID", os.getpid(), flush=True)
    print("WORKERS", *descendants(), flush=True)
    del it  # the pass is dropped ...
    if {persistent}:
        del loader  # ... and the loader: its persistent workers go with it
    gc.collect()
    print("AFTER", *alive(descendants()), flush=True)


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize(("context", "persistent"), [("fork", False), ("spawn", True)])
def test_hung_process_worker_is_ended(context: str, persistent: bool, tmp_path: Any) -> None:
    """A worker stuck in the dataset (and deaf to SIGTERM): dropping the pass (or the loader of
    persistent workers) terminates, kills and reaps it; nothing outlives the interpreter."""
    tests = os.path.dirname(__file__)
    script = tmp_path / "hung.py"
    script.write_text(
        _HUNG_SCRIPT.format(
            tests=tests, marker=str(tmp_path / "hung"), context=context, persistent=persistent
        )
    )
    proc = run_python(script, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = key_lines(proc.stdout)
    workers = [int(p) for p in lines["WORKERS"].split()]
    assert workers, proc.stdout
    assert lines["AFTER"] == "", proc.stdout  # ended and reaped when dropped
    assert wait_gone(workers, 2.0) == []
    assert shm_entries([int(lines["PID"]), *workers]) == set()  # no slot memory left named


_KILLED_OWNER_SCRIPT = """
import os, signal, subprocess, sys, time
sys.path[:0] = [{tests!r}]
import torch
from torch.utils.data import Dataset
from _procs import descendants
from feedpipe import DataLoader


class Hung(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i >= 4:  # stuck for good, after starting a process of its own
            subprocess.Popen(["sleep", "1000"]).wait()
        return torch.tensor(i)


if __name__ == "__main__":
    it = iter(DataLoader(Hung(), batch_size=2, num_workers=2, multiprocessing_context={ctx!r}))
    next(it)
    while len(descendants()) < 4:  # two workers, each with its sleep
        time.sleep(0.02)
    print(*descendants(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: no finalizer, no exit hook runs
"""


@pytest.mark.parametrize("ctx", ["fork", "forkserver"])
def test_workers_stuck_in_the_dataset_end_when_their_owner_is_sigkilled(
    ctx: str, tmp_path: Any
) -> None:
    """Found: the owner killed by the OOM killer left its hung workers (and their children)
    running as orphans for good (torch's watchdog is only read between batches); a forkserver's
    workers keep the forkserver alive too, so watching the parent alone is not enough. (The
    leftover check did not even see a forkserver's workers: they carry its command line.)"""
    tests = os.path.dirname(__file__)
    script, out = tmp_path / "killed.py", tmp_path / "pids"
    script.write_text(_KILLED_OWNER_SCRIPT.format(tests=tests, ctx=ctx))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}
    with open(out, "w") as f:  # a file, not a pipe: orphans would hold a pipe open
        code = subprocess.run(
            [sys.executable, str(script)],
            check=False,
            stdout=f,
            stderr=subprocess.DEVNULL,
            env=env,
            timeout=50,
        ).returncode
    pids = [int(p) for p in out.read_text().split()]
    try:
        assert code == -signal.SIGKILL and len(pids) == 4, out.read_text()
        assert wait_gone(pids, 5.0) == []
    finally:
        for pid in wait_gone(pids, 0):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------- a worker that finished its stream did not die
class _Uneven(IterableDataset):  # type: ignore[type-arg]
    """Worker 0 streams 2 samples at once; worker 1 streams 12, slowly."""

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        if info is None or info.id == 0:
            yield from range(2)
            return
        for i in range(100, 112):
            time.sleep(0.02)
            yield i


def test_a_process_worker_done_with_its_stream_is_not_a_death() -> None:
    """torch ends a worker whose IterableDataset is exhausted (exit code 0) while the others go
    on: its SIGCHLD, arriving inside ``next()``, must not become a ``WorkerError``."""
    for _ in range(3):
        loader = DataLoader(_Uneven(), batch_size=2, num_workers=2)
        got = sorted(int(x) for b in loader for x in b)
        assert got == [0, 1, *range(100, 112)]


class _SlowItems(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.15)
        return i


class _ExitsAt4(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if i == 4:
            os._exit(3)
        return i


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_worker_death_of_one_loader_while_inside_another_loaders_next() -> None:
    """``zip(loader_a, loader_b)``: b's worker dies while the main thread waits in a's
    ``next()``; b's next ``next()`` reports it at once (not after torch's 5 s status poll)."""
    a = DataLoader(_SlowItems(), batch_size=2, num_workers=1)
    b = DataLoader(_ExitsAt4(), batch_size=2, num_workers=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="exit code 3"):
        for _pair in zip(a, b, strict=True):
            pass
    assert time.monotonic() - t0 < 4.0


class _SlowPlain(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.15)
        return i


@pytest.mark.serial
def test_ctrl_c_while_waiting_for_the_first_batches_is_prompt_and_blames_no_one() -> None:
    """Ctrl-C while the first ``next()`` waits for the workers' first batches: raised at once;
    the training loop's RNG draws after it are not blamed on the abandoned workers."""
    loader = DataLoader(_SlowPlain(), batch_size=2, num_workers=2, worker_type="thread")
    timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                for _batch in loader:
                    pass
            assert time.monotonic() - t0 < 0.25
            for _ in range(20):  # the loop goes on (say, saves a checkpoint): draws meanwhile
                torch.rand(3)
                time.sleep(0.02)
        finally:
            timer.cancel()
        assert sorted(int(x) for b in loader for x in b) == list(range(8))  # usable again
    assert _rng_warnings(record) == []
