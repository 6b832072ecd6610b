"""``feedpipe.loader.tuner_cpu``: the tuner reads the CPU of its own loader's worker processes,
each by pid (``/proc/<pid>/stat``), never another child's, and keeps a worker's CPU after it
exits (issue 28, item 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data as tud

import feedpipe
from feedpipe.loader import tuner as tuner_mod
from feedpipe.loader.tuner_cpu import ProcessCPU, cpu_between, read_stat

LINUX = Path("/proc/self/stat").exists()
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _stat(root: Path, pid: int, name: str, ticks: tuple[int, int, int, int], start: int) -> None:
    """A ``/proc/<pid>/stat`` line with the given name, CPU ticks and start time."""
    tail = ["S", "1", *["0"] * 9, *map(str, ticks), "20", "0", "1", "0", str(start), "0"]
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(tail) + "\n")


def test_read_stat_parses_a_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    _stat(tmp_path, 42, "pt worker) (1", (150, 50, 30, 20), start=777)
    got = read_stat(42, str(tmp_path))
    assert got is not None
    key, cpu = got
    assert key == (42, 777)
    assert cpu == pytest.approx(250 / _hz())  # user, system and reaped children's
    assert read_stat(43, str(tmp_path)) is None  # gone


def test_a_reused_pid_counts_from_zero_and_an_exited_worker_keeps_its_last_reading(
    tmp_path: Path,
) -> None:
    (tmp_path / "self").mkdir()
    clock = ProcessCPU(str(tmp_path))
    _stat(tmp_path, 7, "w", (100, 0, 0, 0), start=1)
    clock.watch([7])
    old = clock.snapshot()
    _stat(tmp_path, 7, "w", (300, 0, 0, 0), start=1)
    clock.sample()
    (tmp_path / "7" / "stat").unlink()  # the worker exited after that reading
    kept = clock.snapshot()
    assert kept is not None and old is not None
    assert cpu_between(kept, old) == pytest.approx(200 / _hz())
    # the next pass: pid 7 reused by a new worker (another start time) that ran 50 ticks
    _stat(tmp_path, 7, "w", (50, 0, 0, 0), start=9)
    clock.watch([7])
    new = clock.snapshot()
    assert new is not None and list(new) == [(7, 9)]  # the old worker's reading is dropped
    assert cpu_between(new, kept) == pytest.approx(50 / _hz())  # never 50 - 300


def test_a_pid_reused_mid_pass_by_another_process_is_not_counted(tmp_path: Path) -> None:
    """A worker exits and, before the next pass, the OS gives its pid to an unrelated process
    (another start time): that process's CPU is not the loader's, and the gone worker keeps
    its last reading."""
    (tmp_path / "self").mkdir()
    clock = ProcessCPU(str(tmp_path))
    _stat(tmp_path, 7, "w", (100, 0, 0, 0), start=1)
    clock.watch([7])
    old = clock.snapshot()
    _stat(tmp_path, 7, "w", (300, 0, 0, 0), start=1)
    clock.sample()
    # the worker exits; pid 7 now names a long-running stranger (no new pass: no watch)
    _stat(tmp_path, 7, "stranger", (90_000, 0, 0, 0), start=50)
    now = clock.snapshot()
    assert now is not None and old is not None
    assert list(now) == [(7, 1)]
    assert cpu_between(now, old) == pytest.approx(200 / _hz())


def test_without_proc_nothing_is_read(tmp_path: Path) -> None:
    """macOS, Windows: no ``/proc``: the CPU is unknown (None), never another process's."""
    clock = ProcessCPU(str(tmp_path / "none"))
    assert not clock.available
    clock.watch([1])
    assert clock.snapshot() is None
    assert cpu_between(None, {}) is None


def _hz() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_live_worker_is_read_and_its_cpu_kept_after_it_exits() -> None:
    clock = ProcessCPU()
    child = subprocess.Popen(
        [sys.executable, "-c", BURN.format(s=0.3) + "print('x', flush=True)\ninput()\n"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        clock.watch([child.pid])
        old = clock.snapshot()
        assert child.stdout is not None and child.stdout.readline() == b"x\n"  # burned
        live = clock.snapshot()
    finally:
        child.communicate(b"\n", timeout=30)
    after = clock.snapshot()  # exited and reaped: the last reading stays
    assert live is not None and after == live
    cpu = cpu_between(live, old)
    assert cpu is not None and 0.25 <= cpu <= 0.45


class _Burn(tud.Dataset):  # type: ignore[type-arg]
    """``i``, after ``delay`` seconds of this process's CPU."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        end = time.process_time() + self.delay
        while time.process_time() < end:
            pass
        return i


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_an_auto_loaders_process_workers_cpu_excludes_another_child(monkeypatch: Any) -> None:
    """The pass's reading holds its workers' CPU (read while they ran, kept after torch ended
    them), and not that of a subprocess the training loop ran and reaped meanwhile."""
    readings: list[Any] = []
    decide = tuner_mod.decide  # type: ignore[attr-defined]

    def spy(r: Any, s: Any, limits: Any) -> Any:
        readings.append(r)
        return decide(r, s, limits)

    monkeypatch.setattr(tuner_mod, "decide", spy)
    n, delay, other = 64, 0.005, 0.6  # the workers burn 0.32 s, the other child 0.6 s
    loader = feedpipe.DataLoader(
        _Burn(n, delay), batch_size=4, num_workers="auto", worker_type="process"
    )
    for i, _ in enumerate(loader):
        if i == 1:
            subprocess.run([sys.executable, "-c", BURN.format(s=other)], check=True, timeout=60)
    iter(loader)  # the next pass judges the last one
    assert len(readings) == 1
    cpu = readings[0].cpu_s
    work = n * delay
    assert cpu is not None and 0.5 * work <= cpu <= 1.5 * work + 0.15, cpu


def test_without_proc_the_tuner_takes_the_busy_time_for_the_cpu(tmp_path: Path) -> None:
    """No ``/proc``: the reading's CPU is unknown (never ``RUSAGE_CHILDREN``), and the rule
    counts the workers' busy time in its place."""
    from feedpipe.loader.tuner import Tuner
    from feedpipe.loader.tuner_policy import Reading, Settings

    tuner = Tuner(workers=True, prefetch=False, kind=False, start=Settings(1, "process", 2))
    tuner._procs = ProcessCPU(str(tmp_path / "none"))
    assert tuner.watch([os.getpid()]) is None  # nothing for the loop to call
    meter = feedpipe.StallMeter()
    tuner.begin(meter)
    subprocess.run([sys.executable, "-c", BURN.format(s=0.1)], check=True, timeout=30)
    assert tuner._read(meter).cpu_s is None
    r = Reading(wait_s=0.5, step_s=0.5, busy_s=0.8, cpu_s=None, batches=10)
    assert r.cores() == pytest.approx(0.8)
