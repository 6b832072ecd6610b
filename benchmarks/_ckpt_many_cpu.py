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
(``ckpt.saving.flatten_cache``) is timed in the same rounds.
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


def _row(name: str, state: Any, mutate: Callable[[], None], saves: int, root: Path) -> str:
    srcs = _tensors(state)
    dsts = [torch.empty_like(t) for t in srcs]
    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    cache = FlattenCache()
    cache.flatten(state, [])
    with CheckpointManager(root / name, keep_last=1) as manager:
        first = manager.save(0, state)
        first.result()
        steady, ceiling, plain, cached = [], [], [], []
        for i in range(1, saves + 1):
            mutate()
            plain.append(_timed(lambda: flatten(state, [])))
            cached.append(_timed(lambda: cache.flatten(state, [])))
            before = _ceiling(srcs, dsts)
            handle = manager.save(i, state)
            handle.result()
            ceiling.append((before + _ceiling(srcs, dsts)) / 2)  # right around the save
            steady.append(handle.stats.blocked_s)
        count = manager.stats.saves - 1  # the steady saves
    shutil.rmtree(root / name, ignore_errors=True)
    med = statistics.median
    s, c = med(steady), med(ceiling)
    return (
        f"| {name} | {len(srcs)} | {nbytes / 1e6:.1f} | {c * 1e3:.2f} | {s * 1e3:.2f} "
        f"| **{s / c:.2f}x** | {first.stats.blocked_s * 1e3:.2f} "
        f"| **{first.stats.blocked_s / s:.2f}x** | {med(plain) * 1e3:.2f} "
        f"| {med(cached) * 1e3:.2f} | {med(plain) / med(cached):.2f}x | {count} |"
    )


def report(tensors: int, saves: int, root: Path, machine: str, model: Any) -> str:
    """The table (``model``: ``ckpt_save.make_model``, ``step``: its training step)."""
    make_model, step = model
    net, opt = make_model(tensors, "cpu")
    big = {"model": net, "optim": opt}
    small = _small_state(tensors)

    def touch() -> None:
        for t in small["model"].values():
            t.add_(1.0)

    rows = [
        _row("transformer + AdamW", big, lambda: step(net, opt), saves, root),
        _row("256 floats per tensor", small, touch, saves, root),
    ]
    return "\n".join(
        [
            f"Machine: {machine}",
            "",
            f"Command: `python benchmarks/ckpt_save.py --cpu-tensors {tensors} --saves {saves}`",
            "",
            "Medians over the steady saves; the ceiling is a bare copy of the same tensors into "
            "preallocated tensors, the mean of right before and right after each save (the "
            "faster of one `copy_` per tensor and one `_foreach_copy_`). Targets (issue 27): "
            "steady blocked / ceiling <= 1.3x; first save (no `reserve`) / steady <= 2x.",
            "",
            "| state | tensors | MB | ceiling (ms) | steady blocked (ms) | steady / ceiling "
            "| first save (ms) | first / steady | flatten, uncached (ms) | flatten, cached (ms) "
            "| cache speed-up | steady saves |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
