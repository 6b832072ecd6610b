"""``feedpipe.headspace`` and ``feedpipe bench --headspace``: the share of step time the input
costs (cached batches vs the live loader), the answer naming the slowest stage, the loader left
where it stood, and clear errors for a failing step and a bad ``SCRIPT:FN``."""

from __future__ import annotations

import os
import pickle
import runpy
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

import feedpipe
from feedpipe.cli import main
from feedpipe.commands.headspace import load_step
from feedpipe.stall.headspace import STAGE_NAMES, HeadspaceError, HeadspaceResult

ROOT = Path(__file__).resolve().parents[1]


class Sleepy(torch.utils.data.Dataset[torch.Tensor]):
    """Sample ``i`` is ``[i, i]``; every read sleeps ``read_s`` (a known input cost)."""

    def __init__(self, n: int, read_s: float = 0.0) -> None:
        self.n, self.read_s = n, read_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.read_s:
            time.sleep(self.read_s)
        return torch.tensor([i, i])


def _sleep_step(seconds: float) -> Any:
    def train_step(batch: Any) -> None:
        time.sleep(seconds)

    return train_step


class Injected(torch.utils.data.Dataset[torch.Tensor]):
    """Reads that sleep ``read_s`` (sample 0, the first of each pass: ``slow_s`` more), each
    read's real duration recorded: the injected input cost as the loop incurred it."""

    def __init__(self, read_s: float, slow_s: float) -> None:
        self.read_s, self.slow_s = read_s, slow_s
        self.reads: list[float] = []

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        start = time.perf_counter()
        time.sleep(self.read_s + (self.slow_s if i == 0 else 0.0))
        self.reads.append(time.perf_counter() - start)
        return torch.tensor([i])


class TimedStep:
    """A step that sleeps ``step_s`` (``slow_s`` more on the given calls) and records how long
    each call really took: the step's own time, told apart from the loop's."""

    def __init__(self, step_s: float, slow_s: float = 0.0, slow_calls: tuple[int, ...] = ()):
        self.step_s, self.slow_s, self.slow_calls = step_s, slow_s, slow_calls
        self.took: list[float] = []

    def __call__(self, batch: Any) -> None:
        start = time.perf_counter()
        slow = len(self.took) + 1 in self.slow_calls
        time.sleep(self.step_s + (self.slow_s if slow else 0.0))
        self.took.append(time.perf_counter() - start)

    def means(self, warmup: int, steps: int) -> tuple[float, float]:
        """Mean real step time of the cached run's and the live run's measured steps."""
        assert len(self.took) == 2 * (warmup + steps)
        cached, live = self.took[warmup : warmup + steps], self.took[2 * warmup + steps :]
        return sum(cached) / steps, sum(live) / steps


@pytest.mark.serial
def test_reports_a_known_input_cost_within_5_percent() -> None:
    """One sample per batch, read in the loop (num_workers=0): a live step is a read plus the
    step. The injected cost is the reads' real time (a sleep overshoots on a loaded machine), and
    the step's own real time in each run is taken out of the comparison: what is left is what
    headspace adds or misses. The first step of each run and the first read of each pass are
    slow: the warm-up must leave them out, or the figure would be far off."""
    read_s, step_s, slow_s, steps = 0.05, 0.05, 0.3, 12
    step = TimedStep(step_s, slow_s, slow_calls=(1, steps + 2))
    ds = Injected(read_s, slow_s)
    loader = feedpipe.DataLoader(ds, batch_size=1)
    r = feedpipe.headspace(step, loader, steps=steps, warmup=1, cache=2)
    assert len(ds.reads) == 2 + 1 + steps  # the cache pass, the live warm-up, the live steps
    injected = sum(ds.reads[-steps:]) / steps  # the reads of the live run's measured steps
    step_cached, step_live = step.means(1, steps)
    # live - cached = injected input + (the step's own drift between the runs)
    measured = r.live_step_s - r.cached_step_s - (step_live - step_cached)
    assert measured == pytest.approx(injected, rel=0.05)
    assert r.input_share == pytest.approx(1.0 - r.cached_step_s / r.live_step_s)
    assert r.slowest_stage == "fetch" and r.stats is not None
    assert r.stats.batches == steps  # the live run's counters: the measured steps, not warm-up
    assert r.answer().startswith(f"input costs {100 * r.input_share:.0f}% of step time")


@pytest.mark.serial
def test_no_input_cost_reads_about_zero() -> None:
    """Free input: the live run is slower only by the step's own drift between the runs."""
    step = TimedStep(0.03)
    loader = feedpipe.DataLoader(Sleepy(64), batch_size=4)
    r = feedpipe.headspace(step, loader, steps=10, warmup=1, cache=2)
    step_cached, step_live = step.means(1, 10)
    drift = max(0.0, 1.0 - step_cached / step_live)  # the share the step alone explains
    assert r.input_share == pytest.approx(drift, abs=0.05)
    assert r.live_step_s - step_live < 0.05 * r.live_step_s  # the loop around the step is cheap


def test_answer_names_the_slowest_stage_and_the_table_follows() -> None:
    loader = feedpipe.DataLoader(Sleepy(32, 0.005), batch_size=2)
    r = feedpipe.headspace(_sleep_step(0.0), loader, steps=4, warmup=1, cache=2)
    assert r.slowest_stage == "fetch"
    line, *table = str(r).splitlines()
    assert line == r.answer()
    assert line.endswith("; the dataset's read (fetch) is the slowest stage")
    assert any("fetch" in row and "<- slowest" in row for row in table)
    assert any(row.split()[:2] == ["stall", "(meter)"] for row in table)
    assert (r.steps, r.cached_batches) == (4, 2)


def test_answer_without_a_meter_or_stage_times() -> None:
    batches = [torch.ones(2), torch.zeros(2)]  # any iterable of batches: no stall counters
    r = feedpipe.headspace(_sleep_step(0.0), batches, steps=3, warmup=0, cache=5)
    assert r.stats is None and r.slowest_stage is None and r.cached_batches == 2
    assert r.answer().endswith("; no stall counters (the loader has no feedpipe meter)")
    stats = feedpipe.StallMeter().stats()
    bare = HeadspaceResult(0.01, 0.02, 0.5, None, stats, 3, 1)
    assert bare.answer() == (
        "input costs 50% of step time (20 ms per step live, 10 ms on cached batches); "
        "no stage times were reported"
    )
    assert set(STAGE_NAMES) == {"fetch", "decode", "collate", "pin", "h2d"}


def test_cached_batches_are_copies_with_their_structure() -> None:
    Pair = namedtuple("Pair", "x y")
    originals = [Pair(torch.full((3,), float(i)), {"id": torch.tensor([i])}) for i in range(2)]
    seen: list[Any] = []
    r = feedpipe.headspace(seen.append, originals, steps=2, warmup=0, cache=2)
    cached, live = seen[:2], seen[2:]
    assert [type(b) for b in cached] == [Pair, Pair] and r.cached_batches == 2
    for got, orig in zip(cached, originals, strict=True):
        assert torch.equal(got.x, orig.x) and torch.equal(got.y["id"], orig.y["id"])
        assert got.x.data_ptr() != orig.x.data_ptr()  # no buffer of the loader is held
    assert live == originals  # the live run gets the loader's own batches


def _loader(workers: int, generator: bool, kind: str = "thread") -> feedpipe.DataLoader:
    kwargs: dict[str, Any] = {"num_workers": workers}
    if workers:
        kwargs["worker_type"] = kind
        kwargs["persistent_workers"] = kind == "process"
    if generator:
        kwargs["generator"] = torch.Generator().manual_seed(3)
    return feedpipe.DataLoader(Sleepy(12), batch_size=4, shuffle=True, **kwargs)


@pytest.mark.parametrize(
    ("workers", "generator", "kind"),
    [(0, True, "thread"), (0, False, "thread"), (2, True, "thread"), (2, True, "process")],
)
def test_the_loader_is_left_where_it_stood(workers: int, generator: bool, kind: str) -> None:
    """After one epoch, headspace (whose live run crosses an epoch), then the second epoch: the
    same batches as a twin loader's second epoch, and the meter's counters as before. (Process
    workers here are persistent: started by the first epoch, reused by headspace's passes.)"""
    torch.manual_seed(11)
    twin = _loader(workers, generator, kind)
    list(twin)
    expected = [b.tolist() for b in twin]
    torch.manual_seed(11)
    loader = _loader(workers, generator, kind)
    list(loader)
    before = loader.meter.state_dict()
    r = feedpipe.headspace(_sleep_step(0.0), loader, steps=4, warmup=1, cache=2)
    assert r.stats is not None and r.stats.batches == 4
    assert loader.meter.state_dict()["batches"] == before["batches"] == 3
    assert [b.tolist() for b in loader] == expected


def test_persistent_workers_started_by_headspace_keep_the_first_epoch() -> None:
    expected = [b.tolist() for b in _loader(2, True, "process")]
    loader = _loader(2, True, "process")
    feedpipe.headspace(_sleep_step(0.0), loader, steps=4, warmup=1, cache=2)
    got = [b.tolist() for b in loader]
    del loader  # its persistent workers end here, not with the failure's traceback
    assert got == expected


def test_a_loader_without_a_saved_position_still_gives_whole_epochs() -> None:
    """Out-of-order delivery cannot save its position: the next pass is a new epoch, whole."""
    loader = feedpipe.DataLoader(
        Sleepy(12), batch_size=4, num_workers=2, worker_type="thread", in_order=False
    )
    r = feedpipe.headspace(_sleep_step(0.0), loader, steps=4, warmup=1, cache=2)
    assert r.stats is not None and r.stats.batches == 4
    seen = sorted(i for b in loader for i in b[:, 0].tolist())
    assert seen == list(range(12))


def test_a_failing_step_names_the_step_and_the_run() -> None:
    calls = []

    def train_step(batch: Any) -> None:
        calls.append(batch)
        if len(calls) == 3:
            raise ValueError("loss is nan")

    loader = feedpipe.DataLoader(Sleepy(8), batch_size=2)
    with pytest.raises(HeadspaceError) as info:
        feedpipe.headspace(train_step, loader, steps=4, warmup=1)
    text = str(info.value)
    assert "train_step" in text and "step 3 of the cached run" in text
    assert "ValueError: loss is nan" in text
    assert isinstance(info.value.__cause__, ValueError)


def test_bad_arguments_and_an_empty_loader() -> None:
    with pytest.raises(HeadspaceError, match="steps >= 1"):
        feedpipe.headspace(_sleep_step(0.0), [torch.ones(1)], steps=0)
    with pytest.raises(HeadspaceError, match="gave no batch"):
        feedpipe.headspace(_sleep_step(0.0), [], steps=1)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_cli_runs_the_example_script_end_to_end() -> None:
    argv = ["bench", "--headspace", "examples/headspace.py:make", "--batches", "4"]
    argv += ["--headspace-cache", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "feedpipe.cli", *argv, "--warmup", "1"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "feedpipe bench --headspace examples/headspace.py:make: 4 steps per run after 1 warm-up"
    )
    assert lines[1].startswith("input costs ") and "% of step time" in lines[1]
    assert lines[1].endswith("; the dataset's read (fetch) is the slowest stage")
    assert "  steps           4 per run after warm-up, 3 cached" in lines
    assert proc.stderr == ""


def test_the_example_script_runs_and_leaves_the_loader_whole(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python examples/headspace.py``, in this process (the CLI test above runs a subprocess)."""
    argv = ["examples/headspace.py", "--workers", "2", "--steps", "3", "--warmup", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(ROOT / "examples" / "headspace.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)  # the example's make() sets one thread
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "--- 2 thread workers"
    assert lines[1].startswith("input costs ") and "is the slowest stage" in lines[1]
    assert lines[-1] == "next epoch: 32 batches of 32"


_GOOD = "import torch\ndef make():\n    return (lambda b: None), [torch.ones(2)]\n"


@pytest.mark.parametrize(
    ("body", "fn", "message"),
    [
        (None, "make", "{script}: no such file"),
        (_GOOD, "build", "{script}: no function 'build' in it"),
        ("make = 3\n", "make", "{script}: make is a int, not a function"),
        ("def make():\n    return [1, 2]\n", "make", "{script}: make() must return (step_fn, "),
        ("def make():\n    return None\n", "make", "make() must return (step_fn, loader); it "),
        ("def make():\n    return print, 5\n", "make", "its loader is a int, not an iterable"),
        ("def make():\n    return 1, []\n", "make", "its step_fn is a int, not callable"),
        ("def make():\n    raise OSError('no data')\n", "make", "make() raised OSError: no data"),
        ("import no_such_module_hs\n", "make", "{script}: running the script raised Module"),
    ],
)
def test_cli_bad_script_fn_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str | None, fn: str, message: str
) -> None:
    script = tmp_path / f"hs_{abs(hash((body, fn)))}.py"
    if body is not None:
        script.write_text(body)
    assert main(["bench", "--headspace", f"{script}:{fn}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("feedpipe bench: error: HeadspaceError: ") and err.count("\n") == 1
    assert message.format(script=script) in err


def test_load_step_returns_the_pair_and_refuses_a_spec_without_fn(tmp_path: Path) -> None:
    script = tmp_path / "hs_good_pair.py"
    script.write_text(_GOOD)
    step, loader = load_step(f"{script}:make")
    assert callable(step) and [t.tolist() for t in loader] == [[1.0, 1.0]]
    with pytest.raises(HeadspaceError, match="wants SCRIPT:FN"):
        load_step(str(script))


def _forget_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """The scripts' modules and folders leave sys.modules and sys.path after the test (a second
    run in one process would otherwise find the name taken and get the fallback name)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # restored (removed) at teardown
        del sys.modules[name]


def test_load_step_imports_the_script_as_a_module_named_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its folder is on sys.path (a sibling import works), its classes pickle by the module's
    name, and its ``if __name__ == "__main__":`` block does not run."""
    _forget_modules(monkeypatch, "hs_named_script", "hs_sibling_helper")
    (tmp_path / "hs_sibling_helper.py").write_text("SCALE = 3\n")
    script = tmp_path / "hs_named_script.py"
    script.write_text(
        "import torch\nfrom hs_sibling_helper import SCALE\n"
        "class Step:\n    def __call__(self, batch):\n        return batch * SCALE\n"
        "def make():\n    return Step(), [torch.ones(1)]\n"
        "if __name__ == '__main__':\n    raise SystemExit('the main block ran')\n"
    )
    step, _loader = load_step(f"{script}:make")
    assert type(step).__module__ == "hs_named_script"
    again = pickle.loads(pickle.dumps(step))
    assert again(torch.ones(1)).item() == 3.0


def test_a_slower_cached_run_reads_as_no_input_cost() -> None:
    """A live run faster than the cached one (noise, a cold first run) is no input cost: 0%."""
    calls: list[int] = []

    def train_step(batch: Any) -> None:
        calls.append(1)
        if len(calls) <= 4:  # the cached run's steps only
            time.sleep(0.02)

    r = feedpipe.headspace(train_step, [torch.ones(1)] * 4, steps=3, warmup=1)
    assert r.cached_step_s > r.live_step_s and r.input_share == 0.0
    assert r.answer().startswith("input costs 0% of step time")


def test_cli_headspace_refuses_a_dataset_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="give no PATH or --synthetic"):
        main(["bench", "--synthetic", "--headspace", "x.py:make"])


@pytest.mark.gpu
def test_cuda_step_is_synchronised_and_batches_cached_on_the_device() -> None:
    """The cached run keeps batches on the device, and its clock waits for the queued kernels:
    without the sync the step would read as its launch time only."""
    x = torch.randn(2048, 2048, device="cuda")
    devices: list[str] = []

    def train_step(batch: torch.Tensor) -> None:
        devices.append(batch.device.type)
        y = batch.to("cuda", non_blocking=True).float().sum() + x
        for _ in range(20):
            y = y @ x

    loader = feedpipe.DataLoader(Sleepy(64), batch_size=4)
    r = feedpipe.headspace(train_step, loader, steps=5, warmup=2, cache=2, device="cuda")
    assert devices[:7] == ["cuda"] * 7 and devices[7:] == ["cpu"] * 7
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        train_step(torch.zeros(4, 2, device="cuda"))
    torch.cuda.synchronize()
    synced = (time.perf_counter() - start) / 5
    assert r.cached_step_s == pytest.approx(synced, rel=0.5)


# ---------------------------------------------------------------- headspace


class _Items(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((4,), float(i)), "y": i}


def test_a_step_that_pops_from_its_batch_is_measured() -> None:
    """The cached run gave every step the same dict: a step that pops its labels (or replaces
    an entry, ``batch["x"] = batch["x"].cuda()``) failed with KeyError on the second cycle, or
    measured a step with the copy already done."""
    import feedpipe

    labels: list[Any] = []

    def step(batch: dict[str, Any]) -> None:
        labels.append(batch.pop("y"))
        batch["x"] = batch["x"] + 1  # replaced in the step's own dict only

    loader = feedpipe.DataLoader(_Items(), batch_size=4)
    r = feedpipe.headspace(step, loader, steps=12, warmup=0, cache=3)
    assert r.steps == 12
    cached = labels[:12]
    assert [int(t[0]) for t in cached] == [0, 4, 8] * 4  # the three cached batches, cycled


def test_a_step_that_changes_its_batch_in_place_is_refused() -> None:
    """``batch["x"].mul_(2)`` in the step: the cached run fed it ever larger values (x 2**cycles)
    and timed that; now a HeadspaceError says so."""
    import feedpipe
    from feedpipe.stall.headspace import HeadspaceError

    def step(batch: dict[str, Any]) -> None:
        batch["x"].mul_(2)

    loader = feedpipe.DataLoader(_Items(), batch_size=4)
    with pytest.raises(HeadspaceError, match=r"step_fn .*step changed cached batch 1 in place"):
        feedpipe.headspace(step, loader, steps=12, warmup=0, cache=3)
    again = [b["x"] for b in loader]  # the loader's own batches were never touched
    assert torch.equal(again[0], torch.arange(4.0).repeat_interleave(4).reshape(4, 4))


def test_a_step_that_leaves_nan_batches_alone_is_not_refused() -> None:
    import feedpipe

    loader = feedpipe.DataLoader([torch.full((2,), float("nan"))] * 6, batch_size=2)
    r = feedpipe.headspace(lambda b: b.sum(), loader, steps=4, warmup=0, cache=2)
    assert r.cached_batches == 2


@pytest.mark.parametrize("bad", [{"steps": 2.5}, {"steps": True}, {"warmup": float("nan")}])
def test_counts_that_are_not_integers_are_refused_by_name(bad: dict[str, Any]) -> None:
    """``steps=2.5`` was a bare TypeError from ``range``; ``steps=True`` ran one step and said
    "True per run"."""
    import feedpipe
    from feedpipe.stall.headspace import HeadspaceError

    loader = feedpipe.DataLoader(list(range(8)), batch_size=2)
    (name,) = bad
    with pytest.raises(HeadspaceError, match=rf"need integers .*{name}={bad[name]!r}"):
        feedpipe.headspace(lambda b: None, loader, **bad)


def test_a_one_shot_loader_is_named_as_such() -> None:
    """A generator gave its batches to the cache's pass; the live run's pass then said "the
    loader gave no batch", which it had."""
    import feedpipe
    from feedpipe.stall.headspace import HeadspaceError

    gen = (torch.ones(2) for _ in range(5))
    with pytest.raises(HeadspaceError, match=r"gave no batch on pass 2 .* one-shot iterable"):
        feedpipe.headspace(lambda b: None, gen, steps=3, warmup=0)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("import sys\nsys.exit(0)\n", "running the script exited (sys.exit(0)"),
        ("def make():\n    raise SystemExit('no data')\n", "make() exited (sys.exit('no data')"),
    ],
)
def test_cli_script_that_exits_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, message: str
) -> None:
    """``sys.exit(0)`` at a script's top level made ``feedpipe bench --headspace`` exit 0 having
    measured nothing; a SystemExit in FN printed only its message."""
    from feedpipe.cli import main

    script = tmp_path / f"atk28_exit_{abs(hash(body))}.py"
    script.write_text(body)
    assert main(["bench", "--headspace", f"{script}:make"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"feedpipe bench: error: HeadspaceError: {script}: ")
    assert message in err and err.count("\n") == 1


def test_cli_script_parsing_its_arguments_at_import_gets_its_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module-level ``parse_args()`` saw ``bench --headspace ...`` and exited 2 with the
    script's own usage line; it now sees ``[SCRIPT]`` (its defaults), and argv is put back."""
    _forget_modules(monkeypatch, "atk28_argv_script")
    from feedpipe.cli import main

    script = tmp_path / "atk28_argv_script.py"
    script.write_text(
        "import argparse, sys, torch\n"
        "p = argparse.ArgumentParser(); p.add_argument('--scale', type=float, default=2.0)\n"
        "args = p.parse_args()\n"
        "SEEN = list(sys.argv)\n"
        "def make():\n"
        "    return (lambda b: b * args.scale), [torch.ones(2)] * 4\n"
    )
    argv = list(sys.argv)
    assert main(["bench", "--headspace", f"{script}:make", "--batches", "3", "--warmup", "0"]) == 0
    assert "input costs" in capsys.readouterr().out
    seen = sys.modules["atk28_argv_script"].SEEN
    assert seen == [str(script)]
    assert sys.argv == argv


@pytest.mark.parametrize("device", ["bogus", "cuda"])
def test_a_device_that_cannot_be_had_is_refused_before_any_pass(device: str) -> None:
    """``device="cuda"`` on a machine without CUDA (or a misspelt device) was torch's bare
    AssertionError or RuntimeError, after a pass over the loader had begun."""
    import feedpipe
    from feedpipe.stall.headspace import HeadspaceError

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is here: the device can be had")
    passes: list[int] = []

    class Counted(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            passes.append(i)
            return torch.ones(2)

    loader = feedpipe.DataLoader(Counted(), batch_size=2)
    with pytest.raises(HeadspaceError, match=rf"device='{device}' cannot hold the cached"):
        feedpipe.headspace(lambda b: None, loader, steps=2, device=device)
    assert passes == []
