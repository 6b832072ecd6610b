"""``feedpipe bench``: measure a loader configuration alone and against a simulated step.

For every ``num_workers`` x ``prefetch_factor`` in the sweep it runs the loader twice:

- *alone*: the loop does nothing between batches, so the figure is the maximum input rate;
- *step*: the loop sleeps ``--step-ms`` per batch (a stand-in for GPU compute, which releases
  the GIL while the host waits), so the figure is the stall a training loop of that speed sees.

Each run gets its own :class:`~feedpipe.stall.StallMeter`; the first ``--warmup`` batches (worker
start-up) are dropped with ``meter.reset()``. The per-step wait and step times come from the
meter's own clock readings (``meter.last_wait``). It prints a table, optionally writes a PNG
(matplotlib) and a JSON file.

Example::

    feedpipe bench /data/imagenet-fp --batch-size 256 --workers 0,2,4 --prefetch 2,4 \\
        --worker-type thread --step-ms 5 --plot out.png
    feedpipe bench --synthetic --sample-delay-ms 0.2 --workers 0,2 --step-ms 5

``--headspace SCRIPT:FN`` runs the user's own step and loader instead
(:mod:`feedpipe.commands.headspace`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from feedpipe.io.cliargs import (
    add_storage_arguments,
    milliseconds,
    non_negative_int,
    positive_int,
    storage_options,
)

__all__ = ["BenchResult", "SyntheticDataset", "add_arguments", "run", "run_one"]


class SyntheticDataset:
    """A map-style dataset of ``n`` uint8 tensors of ``shape``; each read sleeps ``delay_s``.

    The sleep stands for I/O or GIL-releasing decode; sample ``i`` is filled with ``i % 251`` so
    batches can be checked. Picklable, so it works with process workers.
    """

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 32, 32), delay_s: float = 0.0):
        if n < 1:
            raise ValueError(f"SyntheticDataset: n must be >= 1, got {n}")
        if delay_s < 0:
            raise ValueError(f"SyntheticDataset: delay_s must be >= 0, got {delay_s}")
        self.n = n
        self.shape = tuple(shape)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        import torch

        if not -self.n <= index < self.n:
            raise IndexError(f"SyntheticDataset: index {index} out of range for {self.n} samples")
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.full(self.shape, index % self.n % 251, dtype=torch.uint8)


@dataclasses.dataclass
class BenchResult:
    """One run: the configuration, the meter's snapshot and per-step wait/step times (s)."""

    workers: int
    prefetch: int | None
    step_ms: float
    stats: dict[str, Any]
    waits: list[float]
    steps: list[float]

    @property
    def label(self) -> str:
        return f"w={self.workers}" + (f" p={self.prefetch}" if self.workers else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", help="a feedpipe dataset directory or URL")
    add_storage_arguments(parser)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="local shard cache for a URL (default: a temporary folder, removed at the end)",
    )
    parser.add_argument(
        "--synthetic", action="store_true", help="use a built-in synthetic dataset instead of PATH"
    )
    parser.add_argument("--sample-shape", default="3,32,32", help="synthetic sample shape")
    parser.add_argument(
        "--sample-delay-ms", type=milliseconds, default=0.0, help="synthetic per-sample read delay"
    )
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--workers", default="0,2,4", help="comma-separated num_workers sweep")
    parser.add_argument("--prefetch", default="2", help="comma-separated prefetch_factor sweep")
    parser.add_argument("--worker-type", choices=("process", "thread"), default="process")
    parser.add_argument("--pin-memory", action="store_true")
    parser.add_argument(
        "--step-ms",
        type=milliseconds,
        default=0.0,
        help="simulated step time (0: only the alone run)",
    )
    parser.add_argument(
        "--batches", type=positive_int, default=100, help="measured batches per run"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=5, help="batches dropped before measuring"
    )
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--json", help="write every run's stats and timelines here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    from feedpipe.commands.headspace import add_arguments as add_headspace_arguments

    add_headspace_arguments(parser)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(  # noqa: B904 - a usage error, not a failure inside the handler
            f"feedpipe bench: {what} must be comma-separated integers, got {text!r}"
        )
    if not values or min(values) < 0:
        raise SystemExit(f"feedpipe bench: {what} must be non-negative integers, got {text!r}")
    return values


def _dataset(args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    if args.synthetic:
        shape = tuple(_ints(args.sample_shape, "--sample-shape"))
        n = (args.warmup + args.batches) * args.batch_size
        return SyntheticDataset(n, shape, args.sample_delay_ms / 1e3)
    if not args.path:
        raise SystemExit("feedpipe bench: give a dataset PATH or --synthetic")
    from feedpipe.datasets.memmap import MemmapDataset
    from feedpipe.remote import transfer as _remote

    if not _remote.is_remote(args.path):
        return MemmapDataset(args.path)
    options = storage_options(args)
    cache = getattr(args, "cache_dir", None)
    if cache is None:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="feedpipe-bench-"))
    ds = MemmapDataset(args.path, cache_dir=cache, storage_options=options)
    stack.callback(ds.close)  # end its shards' leases before the cache folder goes
    return ds


def _cycle(loader: Any) -> Iterator[Any]:
    """Batches from ``loader``, epoch after epoch (a short dataset is re-read)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise SystemExit("feedpipe bench: the loader produced no batches")


def run_one(
    dataset: Any,
    *,
    batch_size: int,
    workers: int,
    prefetch: int | None,
    worker_type: str,
    step_ms: float,
    batches: int,
    warmup: int,
    pin_memory: bool = False,
    progress: Any = None,
) -> BenchResult:
    """Run one configuration and return its :class:`BenchResult`."""
    from feedpipe.loader import DataLoader
    from feedpipe.stall import StallMeter

    meter = StallMeter(trace=False)
    meter.set_workers(workers)
    kwargs: dict[str, Any] = {}
    if workers:
        kwargs.update(prefetch_factor=prefetch, persistent_workers=True, worker_type=worker_type)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=pin_memory,
        meter=meter,
        **kwargs,
    )
    step_s = step_ms / 1e3
    waits: list[float] = []
    steps: list[float] = []
    it = _cycle(loader)
    try:
        for _ in range(warmup):
            next(it)
            if progress is not None:
                progress.update(1)
        meter.reset()
        for k in range(batches):
            prev_end = meter.last_wait[1]
            next(it)
            begin, end = meter.last_wait
            waits.append(end - begin)
            if k:  # the step that ended when this batch was asked for
                steps.append(begin - prev_end)
            if step_s:
                time.sleep(step_s)
            if progress is not None:
                progress.update(1)
        stats = meter.stats().to_dict()  # before closing: a dropped pass would end here
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        shutdown = getattr(loader, "close", None) or getattr(loader, "shutdown", None)
        if callable(shutdown):
            shutdown()
    return BenchResult(workers, prefetch if workers else None, step_ms, stats, waits, steps)


def _table(results: list[BenchResult], step_ms: float) -> str:
    """The sweep as a text table: one row per configuration, alone vs with the step."""
    from feedpipe.stall import StallStats
    from feedpipe.stall.report import hint

    head = f"{'config':<10}{'alone samples/s':>16}{'alone p50 ms':>14}"
    if step_ms:
        head += f"{f'step {step_ms:g} ms: samples/s':>24}{'stall %':>9}{'p50 ms':>9}{'p99 ms':>9}"
    head += f"  {'slowest stage':<14}{'hint'}"
    rows = [head, "-" * len(head)]
    by_label: dict[str, dict[float, BenchResult]] = {}
    for r in results:
        by_label.setdefault(r.label, {})[r.step_ms] = r
    for label, runs in by_label.items():
        alone = runs[0.0].stats
        row = f"{label:<10}{alone['samples_per_s']:>16.0f}{alone['wait_p50_s'] * 1e3:>14.3f}"
        last = alone
        if step_ms:
            s = last = runs[step_ms].stats
            row += (
                f"{s['samples_per_s']:>24.0f}{100 * s['stall_fraction']:>9.1f}"
                f"{s['wait_p50_s'] * 1e3:>9.3f}{s['wait_p99_s'] * 1e3:>9.3f}"
            )
        slowest = last["slowest_stage"] or "-"
        row += f"  {slowest:<14}{hint(StallStats.from_dict(last)).split(':')[0]}"
        rows.append(row)
    return "\n".join(rows)


def _plot(results: list[BenchResult], path: str) -> None:
    """PNG: wait and step time over steps, per-stage breakdown, throughput alone vs step."""
    from feedpipe.errors import require

    require("matplotlib", "bench")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, panel in zip(axes, _PANELS, strict=True):
        panel(ax, results)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _timed(results: list[BenchResult]) -> list[BenchResult]:
    """The runs with a simulated step (all runs when none had one)."""
    return [r for r in results if r.step_ms] or results


def _plot_waits(ax: Any, results: list[BenchResult]) -> None:
    """Wait (solid) and step (dotted) time of each batch, per run."""
    for i, r in enumerate(_timed(results)):
        color = f"C{i % 10}"
        ax.plot([w * 1e3 for w in r.waits], color=color, label=f"{r.label} wait")
        ax.plot(range(1, len(r.steps) + 1), [s * 1e3 for s in r.steps], color=color, ls=":")
    ax.set(xlabel="step", ylabel="ms", title="wait (solid) and step (dotted) per batch")


def _plot_stages(ax: Any, results: list[BenchResult]) -> None:
    """Stacked per-stage time per batch, with the mean wait and step of each run."""
    timed = _timed(results)
    labels = [r.label for r in timed]
    names = sorted({n for r in timed for n in r.stats["stages"]})
    bottom = [0.0] * len(timed)
    for j, name in enumerate(names):
        ms = [r.stats["stages"].get(name, {}).get("effective_s", 0.0) * 1e3 for r in timed]
        ax.bar(labels, ms, bottom=bottom, label=name, color=f"C{j % 10}")
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.plot(labels, [r.stats["wait_mean_s"] * 1e3 for r in timed], "kv", label="mean wait")
    ax.plot(labels, [r.stats["step_mean_s"] * 1e3 for r in timed], "k_", ms=20, label="step")
    ax.set(ylabel="ms per batch", title="per-stage time (effective, per batch)")


def _plot_throughput(ax: Any, results: list[BenchResult]) -> None:
    """Samples per second of each loader alone, and with the simulated step."""
    alone = {r.label: r.stats["samples_per_s"] for r in results if not r.step_ms}
    stepped = {r.label: r.stats["samples_per_s"] for r in results if r.step_ms}
    xs = list(alone)
    width = 0.4
    ax.bar([i - width / 2 for i in range(len(xs))], [alone[x] for x in xs], width, label="alone")
    if stepped:
        vals = [stepped.get(x, 0.0) for x in xs]
        ax.bar([i + width / 2 for i in range(len(xs))], vals, width, label="with step")
    ax.set_xticks(range(len(xs)), xs)
    ax.set(ylabel="samples/s", title="throughput")


_PANELS: tuple[Callable[[Any, list[BenchResult]], None], ...] = (
    _plot_waits,
    _plot_stages,
    _plot_throughput,
)


def run(args: argparse.Namespace) -> int:
    """Run the sweep, print the table, write the plot/JSON; returns the exit status."""
    if getattr(args, "headspace", None):
        from feedpipe.commands.headspace import run as run_headspace

        return run_headspace(args)
    workers = _ints(args.workers, "--workers")
    prefetch = _ints(args.prefetch, "--prefetch")
    if min(prefetch) < 1:
        raise SystemExit("feedpipe bench: --prefetch values must be >= 1")
    if args.batch_size < 1 or args.batches < 2 or args.warmup < 0 or args.step_ms < 0:
        raise SystemExit(
            "feedpipe bench: need --batch-size >= 1, --batches >= 2, --warmup >= 0, --step-ms >= 0"
        )
    if args.plot:  # before the sweep, not after minutes of measuring
        from feedpipe.errors import require

        require("matplotlib", "bench")
    with contextlib.ExitStack() as stack:
        dataset = _dataset(args, stack)
        results = _sweep(args, dataset, workers, prefetch)
    from feedpipe.remote.transfer import redact

    source = "synthetic" if args.synthetic else redact(args.path)
    print(
        f"feedpipe bench: {source}, batch {args.batch_size}, {args.worker_type} workers, "
        f"{args.batches} batches per run after {args.warmup} warm-up"
    )
    print(_table(results, args.step_ms))
    if args.plot:
        _plot(results, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(r) for r in results], f)
        print(f"results written to {args.json}")
    return 0


def _sweep(
    args: argparse.Namespace, dataset: Any, workers: list[int], prefetch: list[int]
) -> list[BenchResult]:
    from feedpipe.io.progress import progress

    configs = [(w, p) for w in workers for p in (prefetch if w else prefetch[:1])]
    step_values = [0.0, args.step_ms] if args.step_ms else [0.0]
    total = len(configs) * len(step_values) * (args.warmup + args.batches)
    results: list[BenchResult] = []
    enabled = False if args.no_progress else None  # None: only on a terminal
    with progress(total, "bench", unit="batch", enabled=enabled) as bar:
        for w, p in configs:
            for step_ms in step_values:
                bar.set_description(f"w={w} p={p if w else '-'} step={step_ms:g}ms")
                results.append(
                    run_one(
                        dataset,
                        batch_size=args.batch_size,
                        workers=w,
                        prefetch=p,
                        worker_type=args.worker_type,
                        step_ms=step_ms,
                        batches=args.batches,
                        warmup=args.warmup,
                        pin_memory=args.pin_memory,
                        progress=bar,
                    )
                )
    return results
