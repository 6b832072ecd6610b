"""``benchmarks/ckpt_save.py --cpu-tensors N``: a save of many small tensors on the CPU, against
its ceiling in the same run (issue 27 item 5).

Two states of about ``N`` tensors (model + AdamW shaped: each parameter, its two moments and
its step count): the transformer of ``--tensors`` (1.3 GB) and the same number of tensors of
256 floats each (a few MB: the save is all Python, as on a GPU whose copy is fast). For each, a
fresh ``CheckpointManager`` saves once without ``reserve`` (the first save: a new plan, a new
flattening, the pool allocated) and then ``saves`` times in steady state; in every steady round,
right before and right after the save (their mean: the noise of a shared machine hits both
alike), the ceiling is measured: a bare torch copy of the same tensors into
preallocated tensors, one ``copy_`` per tensor and one ``torch._foreach_copy_`` for all (the
faster of the two is the ceiling). The flattening with and without the cache
(``ckpt.saving.flatten_cache``) is timed in the same rounds. ``--cpu-small-only``: the small
tensors alone (the transformer row takes minutes on a small CPU).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt._torch_compat import foreach_copy
from ckpt.manager import CheckpointManager
from ckpt.saving.flatten import flatten
from ckpt.saving.flatten_cache import FlattenCache


def _small_state(tensors: int) -> dict[str, Any]:
    params = max(1, tensors // 4)
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"p{i}": torch.randn(256, generator=g) for i in range(params)},
        "optim": {
            i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(256, generator=g),
                "exp_avg_sq": torch.rand(256, generator=g)}
            for i in range(params)
        },
    }  # fmt: skip


def _tensors(state: Any) -> list[torch.Tensor]:
    leaves: list[Any] = []
    flatten(state, leaves)
    return [leaf.value for leaf in leaves if isinstance(leaf.value, torch.Tensor)]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ceiling(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> float:
    def loop() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)

    return min(_timed(loop), _timed(lambda: foreach_copy(dsts, srcs)))


def _first(state: Any, root: Path, name: str) -> tuple[float, float]:
    """A fresh manager's first save (no ``reserve``: a new flattening, plan and pool) and its
    second (the pool and plan reused): blocked seconds of each."""
    with CheckpointManager(root / name, keep_last=1) as manager:
        first = manager.save(0, state)
        first.result()
        second = manager.save(1, state)
        second.result()
    shutil.rmtree(root / name, ignore_errors=True)
    return first.stats.blocked_s, second.stats.blocked_s


def _row(
    name: str, state: Any, mutate: Callable[[], None], saves: int, root: Path, *, firsts: int = 1
) -> str:
    srcs = _tensors(state)
    dsts = [torch.empty_like(t) for t in srcs]
    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    cache = FlattenCache()
    for _ in range(3):  # miss, hit, fast hit: what a steady save finds
        cache.capture(state)
    heads = [_first(state, root, f"{name}-first{k}") for k in range(firsts)]
    with CheckpointManager(root / name, keep_last=1) as manager:
        manager.save(0, state).result()
        steady, ceiling, plain, cached, calls, arounds = [], [], [], [], [], []
        for i in range(1, saves + 1):
            mutate()
            plain.append(_timed(lambda: flatten(state, [])))
            cached.append(_timed(lambda: cache.capture(state)))
            before = _ceiling(srcs, dsts)
            t0 = time.perf_counter()
            handle = manager.save(i, state)
            calls.append(time.perf_counter() - t0)
            handle.result()
            after = _ceiling(srcs, dsts)
            arounds += [before, after]
            ceiling.append((before + after) / 2)  # right around the save
            steady.append(handle.stats.blocked_s)
        count = manager.stats.saves - 1  # the steady saves
    shutil.rmtree(root / name, ignore_errors=True)
    med = statistics.median
    s, c = med(steady), med(ceiling)
    first = med(h[0] for h in heads)
    return (
        f"| {name} | {len(srcs)} | {nbytes / 1e6:.1f} | {c * 1e3:.2f} | {s * 1e3:.2f} "
        f"| **{s / c:.2f}x** | {min(steady) * 1e3:.2f} | **{min(steady) / min(arounds):.2f}x** "
        f"| {med(calls) * 1e3:.2f} | {first * 1e3:.2f} | **{first / s:.2f}x** "
        f"| {med(h[0] / h[1] for h in heads):.2f}x | {med(plain) * 1e3:.2f} "
        f"| {med(cached) * 1e3:.2f} | {med(plain) / med(cached):.2f}x | {count} |"
    )


def report(
    tensors: int, saves: int, root: Path, machine: str, model: Any, *, small_only: bool = False
) -> str:
    """The table (``model``: ``ckpt_save.make_model``, ``step``: its training step;
    ``small_only``: the row of small tensors alone)."""
    small = _small_state(tensors)

    def touch() -> None:
        for t in small["model"].values():
            t.add_(1.0)

    rows = [_row("256 floats per tensor", small, touch, saves, root, firsts=3)]
    if not small_only:
        make_model, step = model
        net, opt = make_model(tensors, "cpu")
        big = {"model": net, "optim": opt}
        rows.insert(0, _row("transformer + AdamW", big, lambda: step(net, opt), saves, root))
    flag = " --cpu-small-only" if small_only else ""
    return "\n".join(
        [
            f"Machine: {machine}",
            "",
            f"Command: `python benchmarks/ckpt_save.py --cpu-tensors {tensors} "
            f"--saves {saves}{flag}`",
            "",
            "Medians over the steady saves; the ceiling is a bare copy of the same tensors into "
            "preallocated tensors, the mean of right before and right after each save (the "
            "faster of one `copy_` per tensor and one `_foreach_copy_`). Best: the fastest "
            "steady save over the fastest ceiling (on a loaded machine the medians carry its "
            "preemptions). save() call: the whole call, manager and queueing included. First "
            "save: a fresh manager without `reserve` (the median of 3 for the small tensors), "
            "over the steady median and over its own second save. Flatten, cached: "
            "`FlattenCache.capture` warm (the fast path). Targets (issue 27): steady blocked / "
            "ceiling <= 1.3x; first save (no `reserve`) / steady <= 2x.",
            "",
            "| state | tensors | MB | ceiling (ms) | steady blocked (ms) | steady / ceiling "
            "| best steady (ms) | best / best ceiling | save() call (ms) | first save (ms) "
            "| first / steady | first / its second | flatten, uncached (ms) "
            "| flatten, cached (ms) | cache speed-up | steady saves |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
