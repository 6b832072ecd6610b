"""The automatic save interval against fixed ones, under failures of a given MTBF, in one run.

A training-like loop (a CPU MLP with SGD and momentum, its state saved by a real
``CheckpointManager``) runs real steps and real saves while failures strike at exponentially
distributed times of mean ``--mtbf`` seconds (the same draws for every policy of a round). A
failure loses the steps since the last *committed* save (a save still in flight is lost too),
and the run restores that step for real. Policies: ``save_interval_steps=N`` for each
``--every`` and ``"auto"`` with ``mtbf=`` the true MTBF.

Time is accounted: each step counts its measured duration, each save its measured blocking
time, each failure its measured restore time; failures strike on that clock and a policy runs
until ``--budget`` seconds are accounted. Left out: the simulation's own bookkeeping (waiting
for the saves in flight at a failure, which a real crash loses) and the time between a step and
the next outside ``step()``/``save()``. The background write's share of the CPU is in: it slows
the steps it overlaps (a real cost on a 2-core machine). The baseline step time (no saves, no
failures, the median at the start of each round) is printed for reference.

Printed per policy: the overhead (the share of the accounted time not spent on steps that
count: lost work + blocking saves + restores + steps slowed by the background writes), its
parts, and the ratio of each fixed policy's overhead to auto's (above 1: auto lost less).

    .venv/bin/python benchmarks/ckpt_auto_interval.py                   # ~5 min on 2 cores
    .venv/bin/python benchmarks/ckpt_auto_interval.py --budget 2 --rounds 1 --no-doc
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from ckpt.manager import CheckpointManager


@dataclass
class Outcome:
    """One policy's totals over the rounds."""

    name: str
    seconds: float = 0.0
    steps: int = 0
    saves: int = 0
    blocked_s: float = 0.0
    failures: int = 0
    lost_steps: int = 0
    lost_s: float = 0.0
    useful_s: float = 0.0
    restore_s: float = 0.0
    intervals: list[int] = field(default_factory=list)


class Trainer:
    """The loop's model and its SGD with momentum (by hand: ``torch.optim`` imports the
    compiler on first use, seconds that a benchmark's smoke test need not pay): ``step()`` is
    one training step, ``state()`` what a save holds (restored in place)."""

    def __init__(self, width: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )
        self.momentum = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}
        self.x = torch.randn(batch, width)

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                assert p.grad is not None
                buf = self.momentum[name].mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-1e-3)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "momentum": self.momentum}


def step_time(trainer: Trainer, steps: int = 30) -> float:
    """The median seconds of one step with no save and no failure (the baseline)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _committed(handles: dict[int, Any]) -> int | None:
    """The newest step whose save committed by now (in-flight ones are lost in a crash)."""
    done = [s for s, h in handles.items() if h.done() and h.error is None]
    return max(done) if done else None


def _manager(root: Path, every: int | str, mtbf: float) -> CheckpointManager:
    extra: dict[str, Any] = {"mtbf": mtbf} if every == "auto" else {}
    # keep_last=8: the step a failure rolls back to should outlive the saves in flight, which
    # commit while the failed manager closes (else the run rolls back further: _fail)
    return CheckpointManager(root, keep_last=8, save_interval_steps=every, **extra)


def _fail(
    m: CheckpointManager,
    make: Callable[[], CheckpointManager],
    trainer: Trainer,
    handles: dict[int, Any],
    out: Outcome,
) -> tuple[CheckpointManager, int]:
    """A failure now: the run restarts with a new manager (an ``"auto"`` one starts from the
    costs its run log recorded) from the last committed step, restored for real (timed).
    Returns the new manager and the step the run goes on from."""
    last = _committed(handles)
    m.close()  # waits for the saves in flight: the sim's bookkeeping, not counted
    for n in m.steps():  # what a real crash loses: the saves that were still in flight
        if last is None or n > last:
            shutil.rmtree(m.directory / f"step-{n}")
    left = m.steps()  # retention may have evicted ``last`` meanwhile: the newest kept, then
    last = left[-1] if left else None
    handles.clear()
    r0 = time.perf_counter()
    m = make()
    if last is not None:
        m.restore(last, into=trainer.state())
    out.restore_s += time.perf_counter() - r0
    out.failures += 1
    return m, (0 if last is None else last + 1)


def run_policy(
    trainer: Trainer, root: Path, every: int | str, *, mtbf: float, budget: float, seed: int
) -> Outcome:
    """Train until ``budget`` seconds are accounted (module docstring) under failures."""
    out = Outcome(f"every={every}" if every != "auto" else "auto")
    shutil.rmtree(root, ignore_errors=True)
    m = _manager(root, every, mtbf)
    make = functools.partial(_manager, root, every, mtbf)
    rng = random.Random(seed)
    next_fail = rng.expovariate(1.0 / mtbf)
    handles: dict[int, Any] = {}
    work_at: dict[int, float] = {}  # step -> the useful compute seconds up to it
    step, clock, work = 0, 0.0, 0.0
    while clock < budget:
        if clock >= next_fail:
            lost_from, restored = step, out.restore_s
            m, step = _fail(m, make, trainer, handles, out)
            kept = work_at.get(step - 1, 0.0)
            out.lost_steps, out.lost_s = out.lost_steps + lost_from - step, out.lost_s + work - kept
            work, work_at = kept, {s: w for s, w in work_at.items() if s < step}
            clock += out.restore_s - restored
            next_fail = clock + rng.expovariate(1.0 / mtbf)
            continue
        t0 = time.perf_counter()
        trainer.step()
        dt = time.perf_counter() - t0
        clock, work = clock + dt, work + dt
        work_at[step] = work
        if m.should_save(step):
            handles[step] = h = m.save(step, trainer.state())
            out.saves += 1
            out.blocked_s += h.stats.blocked_s
            clock += h.stats.blocked_s
        step += 1
    out.seconds, out.steps, out.useful_s = clock, step, work
    rep = m.interval()
    if rep is not None and rep.steps is not None:
        out.intervals.append(rep.steps)
    m.close()
    return out


def table(outcomes: list[Outcome], step_s: list[float], args: argparse.Namespace) -> str:
    """The markdown table of the outcomes (overhead: the accounted time not spent on steps
    that count)."""
    auto = next(o for o in outcomes if o.name == "auto")
    auto_over = 1.0 - auto.useful_s / auto.seconds
    ms = ", ".join(f"{t * 1e3:.1f}" for t in step_s)
    lines = [
        f"MTBF {args.mtbf:g} s (exponential, the same draws for every policy of a round), "
        f"{args.budget:g} s accounted per policy x {args.rounds} round(s); MLP width "
        f"{args.width}, baseline step {ms} ms (one per round). {machine()}",
        "",
        "| policy | overhead | saves | blocked (s) | failures | lost work (s) | restore (s) "
        "| overhead / auto's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        over = 1.0 - o.useful_s / o.seconds
        ratio = f"{over / auto_over:.2f}x" if auto_over > 0 else "-"
        lines.append(
            f"| {o.name} | {over:.1%} | {o.saves} | {o.blocked_s:.2f} | {o.failures} | "
            f"{o.lost_s:.2f} | {o.restore_s:.2f} | {ratio} |"
        )
    lines.append("")
    lines.append(f"auto's interval at the end of each round (steps): {auto.intervals}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print the table; write docs/benchmarks.md unless ``--no-doc``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtbf", type=float, default=2.0, help="mean time between failures, s")
    p.add_argument("--budget", type=float, default=10.0, help="seconds per policy and round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--every", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core for the loop, one for the save's background write
    policies: list[int | str] = [*args.every, "auto"]
    outcomes = {str(e): Outcome(f"every={e}" if e != "auto" else "auto") for e in policies}
    base = tempfile.mkdtemp(prefix="ckpt-interval-", dir=args.dir)
    step_times: list[float] = []
    try:
        for r in range(args.rounds):
            trainer = Trainer(args.width, args.batch)
            step_s = step_time(trainer)
            step_times.append(step_s)
            for every in policies:
                trainer = Trainer(args.width, args.batch)
                got = run_policy(
                    trainer, Path(base) / "ckpt", every, mtbf=args.mtbf, budget=args.budget, seed=r
                )
                _add(outcomes[str(every)], got)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(base, ignore_errors=True)
    text = table(list(outcomes.values()), step_times, args)
    print(text)
    if not args.no_doc:
        write_section("ckpt_auto_interval", "## Automatic save interval\n\n" + text)
    return 0


def _add(total: Outcome, one: Outcome) -> None:
    for name in ("seconds", "steps", "saves", "blocked_s", "failures", "lost_steps"):
        setattr(total, name, getattr(total, name) + getattr(one, name))
    for name in ("lost_s", "useful_s", "restore_s"):
        setattr(total, name, getattr(total, name) + getattr(one, name))
    total.intervals += one.intervals


if __name__ == "__main__":
    sys.exit(main())
