"""Peers side by side: torch's DataLoader (the baseline), torchdata's ``StatefulDataLoader`` and
``torchdata.nodes``, SPDL and feedpipe's DataLoader, over the same converted records, in one run.

Every system reads the same ``feedpipe.MemmapDataset`` (written by ``gpu_feed.make_dataset`` and
read once into the page cache) in shuffled batches of ``--batch`` records of 512 B, 8 KiB and
256 KiB, with ``--workers`` workers; each runs whole epochs for ``--seconds`` (timed from after
its first batch; later epochs' start-up counts), repetitions interleaved, best kept. Every epoch
must deliver every record (checked); ``--check`` (on with ``--smoke``) also compares one epoch's
byte sum with the dataset's. A row prints samples/s, its ratio to torch's DataLoader from the
same run, and feedpipe's best row divided by it; a summary gives feedpipe's ratio to each peer's
best configuration at each record size.

The peers, each written as its own docs show:

- torch ``DataLoader(ds, batch_size, shuffle=True, num_workers=W, persistent_workers=True)``:
  its fetcher calls the dataset's ``__getitems__`` (one gather, split into per-sample views)
  and ``default_collate`` stacks the samples. torchdata's ``StatefulDataLoader``: the same.
- ``torchdata.nodes`` as its migration guide for map-style datasets builds a DataLoader:
  ``SamplerWrapper(RandomSampler)`` -> ``Batcher`` -> ``ParallelMapper(map_and_collate, W)`` ->
  (``PinMemory``) -> ``Prefetcher(2 W)`` -> ``Loader``: a batched map (each task fetches one
  batch as torch's fetcher does), ``method="process"`` (the guide's) and ``"thread"``; a third
  row gives the threads feedpipe's one-gather ``read_batch`` as the map.
- SPDL: ``spdl.dataloader.get_pytorch_dataloader`` (its drop-in for map-style datasets: W
  worker processes fed by a sampler in the main process), and ``spdl.pipeline`` built once
  over a continuous source of shuffled index batches -> ``pipe(read, concurrency=W,
  output_order="completion")`` -> ``add_sink(2 W)``, run MT (its thread pool, this process;
  the read is torch's fetch or ``read_batch``) and MTP (``run_pipeline_in_subprocess``, the
  pattern its docs recommend for GPU training); see :class:`SpdlLoader`.
- feedpipe ``DataLoader`` with W thread workers, W process workers and no workers.

With ``--device cuda`` batches end on the GPU: torch and the peers pin where they offer it
(``pin_memory=True``, ``PinMemory``; SPDL's pipeline stage ``transfer_tensor_h2d`` pins and
copies on its own stream), then ``.to(dev, non_blocking=True)``; feedpipe ``device="cuda"``. A
package that is not installed prints "not installed"; a row that raises prints "failed: ..."
and the run goes on (exit status 1).

    python benchmarks/peers.py --device cuda --gb 0.1 --seconds 1.5 --write   # the H200 machine
    python benchmarks/peers.py --workers 2 --gb 0.05 --seconds 1  # this CPU box
    python benchmarks/peers.py --smoke                            # every system, tiny data
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import machine, write_section
from gpu_feed import make_dataset

import feedpipe
from feedpipe.device.feed import GPUFeedWarning

__all__ = ["ROWS", "Row", "Setting", "SpdlLoader", "Timing", "main"]

_TIMEOUT_S = 300.0  # an SPDL pipeline that delivers nothing for this long fails its row
Built = tuple[Iterable[Any], Callable[[Any], Any]]


@dataclass(frozen=True)
class Setting:
    """What every system is asked for: batch size, worker count and where batches end."""

    batch: int
    workers: int
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pool(self) -> int:
        """Workers for a system that needs at least one (torchdata.nodes, SPDL)."""
        return max(1, self.workers)

    def move(self, batch: Any) -> Any:
        """torch's and the peers' last step: ``.to(dev, non_blocking=True)`` on CUDA."""
        return batch.to(self.device, non_blocking=True) if self.cuda else batch

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _same(batch: Any) -> Any:
    return batch


class TorchFetch:
    """A batch read the way torch's fetcher reads a map-style dataset: ``__getitems__`` (one
    ``ds[i]`` per index without it), then ``default_collate``. Picklable (process workers)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __call__(self, indices: Sequence[int]) -> Any:
        getitems = getattr(self.ds, "__getitems__", None)
        items = getitems(list(indices)) if getitems else [self.ds[int(i)] for i in indices]
        return default_collate(items)


class ReadBatch:
    """A batch read by ``MemmapDataset.read_batch``: one gather into a fresh batch tensor."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __call__(self, indices: Sequence[int]) -> Any:
        return self.ds.read_batch(np.asarray(indices, dtype=np.int64))


class EpochIndices:
    """A re-iterable source: each pass yields one epoch's shuffled indices, in batches."""

    def __init__(self, n: int, batch: int) -> None:
        self.n, self.batch = n, batch
        self.rng = np.random.default_rng(0)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.rng.permutation(self.n)
        for start in range(0, self.n, self.batch):
            yield perm[start : start + self.batch].tolist()


class SpdlLoader:
    """SPDL's pipeline as its docs run one across epochs: a continuous source of index batches
    -> ``pipe(read, concurrency=W)`` -> sink, built once; each ``iter()`` is one epoch. MT runs
    the read on the pipeline's thread pool in this process; MTP runs the whole pipeline in a
    subprocess (``run_pipeline_in_subprocess``), the pattern SPDL recommends for GPU training.
    On CUDA a pipeline in this process moves each batch with ``transfer_tensor_h2d``."""

    def __init__(self, n: int, s: Setting, read: Callable[[Sequence[int]], Any], mtp: bool):
        from spdl.pipeline import PipelineBuilder, run_pipeline_in_subprocess

        w = s.pool
        builder: Any = PipelineBuilder[Any, Any]()
        builder.add_source(EpochIndices(n, s.batch), continuous=True)
        builder.pipe(read, concurrency=w, output_order="completion")  # its advice for I/O
        self.source: Iterable[Any] | None = None
        if mtp:
            self.source = run_pipeline_in_subprocess(
                builder.add_sink(2 * w).get_config(), num_threads=w
            )
            builder = PipelineBuilder[Any, Any]().add_source(self.source, continuous=True)
        self.pipeline: Any = None
        if s.cuda:
            from spdl.io import transfer_tensor_h2d

            builder.pipe(transfer_tensor_h2d)  # one at a time, as its docs advise for H2D
        if s.cuda or not mtp:
            self.pipeline = builder.add_sink(2 * w).build(num_threads=w + int(s.cuda))
        self.started = False

    def __iter__(self) -> Iterator[Any]:
        if self.pipeline is None:  # MTP on the CPU: its iterable, as its docs iterate it
            assert self.source is not None
            return iter(self.source)
        if not self.started:  # at the first epoch, not while other systems are being built
            self.pipeline.start()
            self.started = True
        return iter(self.pipeline.get_iterator(timeout=_TIMEOUT_S))

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
        self.pipeline = self.source = None


def _torch(ds: Any, s: Setting) -> Built:
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=s.batch,
        shuffle=True,
        num_workers=s.workers,
        persistent_workers=s.workers > 0,
        pin_memory=s.cuda,
    )
    return loader, s.move


def _stateful(ds: Any, s: Setting) -> Built:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(
        ds,
        batch_size=s.batch,
        shuffle=True,
        num_workers=s.workers,
        persistent_workers=s.workers > 0,
        pin_memory=s.cuda,
    )
    return loader, s.move


def _nodes(method: str, read: type[TorchFetch] | type[ReadBatch]) -> Callable[..., Built]:
    def build(ds: Any, s: Setting) -> Built:
        import torchdata.nodes as tn

        node: Any = tn.SamplerWrapper(torch.utils.data.RandomSampler(ds))
        node = tn.Batcher(node, batch_size=s.batch, drop_last=False)
        node = tn.ParallelMapper(
            node, map_fn=read(ds), num_workers=s.pool, method=method, in_order=True
        )
        if s.cuda:
            node = tn.PinMemory(node)
        node = tn.Prefetcher(node, prefetch_factor=2 * s.pool)
        return tn.Loader(node), s.move

    return build


def _spdl_torch(ds: Any, s: Setting) -> Built:
    from spdl.dataloader import get_pytorch_dataloader

    loader: Iterable[Any] = get_pytorch_dataloader(
        ds, batch_size=s.batch, shuffle=True, num_workers=s.pool, pin_memory=s.cuda
    )
    return loader, s.move


def _spdl_pipe(read: type[TorchFetch] | type[ReadBatch], mtp: bool) -> Callable[..., Built]:
    def build(ds: Any, s: Setting) -> Built:
        return SpdlLoader(len(ds), s, read(ds), mtp), _same

    return build


def _feedpipe(kind: str, workers: int | None) -> Callable[..., Built]:
    def build(ds: Any, s: Setting) -> Built:
        w = s.workers if workers is None else workers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GPUFeedWarning)
            loader = feedpipe.DataLoader(
                ds,
                batch_size=s.batch,
                shuffle=True,
                num_workers=w,
                worker_type=kind,
                device=str(s.device) if s.cuda else None,  # host memory: no device=
                persistent_workers=w > 0,
            )
        return loader, _same

    return build


@dataclass(frozen=True)
class Row:
    """One system in one configuration: ``family`` groups a peer's configurations."""

    key: str
    family: str
    label: str
    build: Callable[[Any, Setting], Built]


_N, _S, _F = "torchdata.nodes", "SPDL", "feedpipe"
ROWS: tuple[Row, ...] = (
    Row("torch", "torch DataLoader", "torch DataLoader, W processes", _torch),
    Row("stateful", "torchdata StatefulDataLoader", "StatefulDataLoader, W processes", _stateful),
    Row("nodes-process", _N, f"{_N}, W processes", _nodes("process", TorchFetch)),
    Row("nodes-thread", _N, f"{_N}, W threads", _nodes("thread", TorchFetch)),
    Row("nodes-thread-rb", _N, f"{_N}, W threads, read_batch", _nodes("thread", ReadBatch)),
    Row("spdl-process", _S, "SPDL get_pytorch_dataloader, W processes", _spdl_torch),
    Row("spdl-mt", _S, "SPDL pipeline MT, W threads", _spdl_pipe(TorchFetch, False)),
    Row("spdl-mt-rb", _S, "SPDL pipeline MT, W threads, read_batch", _spdl_pipe(ReadBatch, False)),
    Row("spdl-mtp", _S, "SPDL pipeline MTP, W threads", _spdl_pipe(TorchFetch, True)),
    Row("feedpipe-thread", _F, "feedpipe, W thread workers", _feedpipe("thread", None)),
    Row("feedpipe-process", _F, "feedpipe, W process workers", _feedpipe("process", None)),
    Row("feedpipe-none", _F, "feedpipe, no workers", _feedpipe("thread", 0)),
)


@dataclass
class Timing:
    """One row's best figures: samples/s over whole epochs, and without each epoch's wait for
    its first batch (``start_ms``, the median of that wait over the epochs after the first)."""

    sps: float = 0.0
    steady: float = 0.0
    starts: list[float] = field(default_factory=list)

    @property
    def start_ms(self) -> float:
        return 1e3 * float(np.median(self.starts)) if self.starts else float("nan")


def timed_epochs(
    loader: Iterable[Any], move: Callable[[Any], Any], s: Setting, n: int, *, seconds: float,
    into: Timing,
) -> None:  # fmt: skip
    """Whole epochs for about ``seconds``, timed from after the first batch; keeps the best
    rates in ``into``. An epoch that does not deliver all ``n`` records raises."""
    samples = steady = 0
    start = steady_s = t_first = 0.0
    while True:
        got, t_iter = 0, time.perf_counter()
        for batch in loader:
            rows = len(move(batch))
            if got == 0:
                s.sync()
                t_first = time.perf_counter()
                if start:
                    into.starts.append(t_first - t_iter)
                    samples += rows
                start = start or t_first
            else:
                samples += rows
                steady += rows
            got += rows
        if got != n:
            raise RuntimeError(f"an epoch delivered {got} records of {n}")
        s.sync()
        now = time.perf_counter()
        steady_s += now - t_first
        if samples and now - start >= seconds:
            break
    into.sps = max(into.sps, samples / (now - start))
    into.steady = max(into.steady, steady / steady_s)


def byte_sum(ds: Any) -> int:
    """The sum of every byte of the dataset (the content check's expected value)."""
    step = max(1, (16 << 20) // ds.record_bytes)
    return sum(
        int(ds.read_batch(np.arange(i, min(i + step, len(ds)))).sum(dtype=torch.int64))
        for i in range(0, len(ds), step)
    )


def check_epoch(loader: Iterable[Any], move: Callable[[Any], Any], n: int, total: int) -> None:
    """One epoch must hold every record once: ``n`` rows whose bytes add up to ``total``."""
    rows = got = 0
    for batch in loader:
        b = move(batch)
        rows += len(b)
        got += int(b.sum(dtype=torch.int64))
    if (rows, got) != (n, total):
        raise RuntimeError(f"one epoch gave {rows} records summing to {got}; want {n}, {total}")


def _failed(e: BaseException) -> str:
    if isinstance(e, ImportError):
        return f"not installed ({e})"
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def _run_row(key: str, fn: Callable[[], None], limit_s: float) -> None:
    """``fn()`` under a watchdog: a row still running after ``limit_s`` dumps every thread's
    stack and ends the run (the tables printed so far stand), rather than hang."""
    faulthandler.dump_traceback_later(limit_s, exit=True)
    try:
        fn()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _opened(path: str, batch: int) -> Any:
    """A ``MemmapDataset`` over ``path`` that has read one batch on this thread: what it sets up
    on its first read (its maps, libc found through ``ldconfig``) is done before any system's
    thread or ``fork`` could race with it."""
    ds = feedpipe.MemmapDataset(path)
    ds.read_batch(np.arange(min(batch, len(ds)), dtype=np.int64))
    return ds


def measure(path: str, rows: Sequence[Row], s: Setting, args: argparse.Namespace) -> dict[str, Any]:
    """A ``Timing`` (best of ``args.reps`` interleaved runs) per row key, or why there is none.

    Each system opens its own ``MemmapDataset`` over the records at ``path``: a dataset one
    system's threads are reading is never the one another system's ``fork`` copies."""
    out: dict[str, Any] = {}
    built: dict[str, Built] = {}
    opened = [_opened(path, s.batch)]
    for row in rows:
        try:
            opened.append(_opened(path, s.batch))
            built[row.key] = row.build(opened[-1], s)
            out[row.key] = Timing()
        except Exception as e:  # a missing or broken peer skips its row only
            out[row.key] = _failed(e)
    n, total = len(opened[0]), byte_sum(opened[0]) if args.check else 0
    for rep in range(-1 if args.check else 0, args.reps):
        for key, (loader, move) in list(built.items()):
            run = (
                partial(check_epoch, loader, move, n, total)
                if rep < 0
                else partial(timed_epochs, loader, move, s, n, seconds=args.seconds, into=out[key])
            )
            try:
                _run_row(key, run, args.row_timeout)
            except Exception as e:
                out[key] = _failed(e)
                del built[key]
    for loader, _ in built.values():
        getattr(loader, "close", lambda: None)()
    built.clear()
    gc.collect()
    for ds in opened:
        ds.close()
    return out


def _size(rec: int) -> str:
    return f"{rec // 1024} KiB" if rec >= 1024 else f"{rec} B"


def _best(result: dict[str, Any], rows: Sequence[Row], family: str) -> tuple[float, str]:
    """The family's best whole-epoch samples/s and the label of the row that gave it."""
    got = [(result[r.key], r.label) for r in rows if r.family == family]
    ok = [(v.sps, label) for v, label in got if isinstance(v, Timing) and v.sps > 0]
    return max(ok) if ok else (0.0, "")


def size_table(rec: int, result: dict[str, Any], rows: Sequence[Row], w: int) -> list[str]:
    """One record size: every row's samples/s, GB/s, ratio to torch, feedpipe's best / it, the
    wait for an epoch's first batch and the rate without it."""
    base = result.get("torch")
    fp, fp_label = _best(result, rows, "feedpipe")
    out = [
        f"**{_size(rec)} records** (feedpipe's best: {fp_label.replace('W', str(w))})",
        "",
        "| system | samples/s | GB/s | x torch | feedpipe best / this | epoch's first batch, ms "
        "| samples/s after each epoch's first batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v, label = result[r.key], r.label.replace("W", str(w))
        if not isinstance(v, Timing) or not v.sps:
            out.append(f"| {label} | {v if not isinstance(v, Timing) else 'no result'} |||||")
            continue
        ratio = f"{v.sps / base.sps:.2f}x" if isinstance(base, Timing) and base.sps else "n/a"
        mine = f"{fp / v.sps:.2f}x" if fp and r.family != "feedpipe" else ""
        out.append(
            f"| {label} | {v.sps:,.0f} | {v.sps * rec / 1e9:.3f} | {ratio} | {mine} "
            f"| {'n/a' if np.isnan(v.start_ms) else f'{v.start_ms:.1f}'} | {v.steady:,.0f} |"
        )
    return out


def summary(results: dict[int, dict[str, Any]], rows: Sequence[Row], w: int) -> list[str]:
    """feedpipe's best over each peer's best configuration, per record size, and the verdict."""
    sizes = sorted(results)
    families = [f for f in dict.fromkeys(r.family for r in rows) if f != "feedpipe"]
    out = [
        "| feedpipe's best / the peer's best | " + " | ".join(_size(x) for x in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    behind: list[str] = []
    for fam in families:
        cells = []
        for rec in sizes:
            fp, _ = _best(results[rec], rows, "feedpipe")
            peer, label = _best(results[rec], rows, fam)
            if not (fp and peer):
                cells.append("n/a")
                continue
            cells.append(f"{fp / peer:.2f}x (its best: {label.replace('W', str(w))})")
            if fp <= peer:
                behind.append(f"{fam} at {_size(rec)} ({fp / peer:.2f}x)")
        out.append(f"| {fam} | " + " | ".join(cells) + " |")
    verdict = (
        "feedpipe is behind or level with: " + "; ".join(behind)
        if behind
        else "feedpipe is ahead of every peer measured, at every record size."
    )
    return [*out, "", verdict]


def report(results: dict[int, dict[str, Any]], rows: Sequence[Row], args: argparse.Namespace,
           cmd: str) -> str:  # fmt: skip
    """The markdown section: how it was measured, the machine, the command, the tables."""
    w, where = args.workers, "on the GPU" if args.device.startswith("cuda") else "in host memory"
    md = [
        f"### Peers side by side, batches {where}: torchdata and SPDL (`benchmarks/peers.py`)",
        "",
        f"Every system reads the same `MemmapDataset` from the page cache in shuffled batches of "
        f"{args.batch} records with W = {w} workers; batches end {where}. Best of {args.reps} "
        f"interleaved repetitions of whole epochs for {args.seconds:g} s each; every epoch "
        "delivered every record. Each peer is written as its docs show (the script's docstring "
        "says how); `read_batch` rows give a peer feedpipe's one-gather read as its map. An "
        "epoch's first batch includes what a system starts per epoch (torchdata.nodes and "
        "`get_pytorch_dataloader` start their workers anew; `n/a`: one epoch per run).",
        "",
        f"Machine: {machine()}  ",
        f"Command: `{cmd}`",
        "",
    ]
    for rec in sorted(results):
        md += [*size_table(rec, results[rec], rows, w), ""]
    md += summary(results, rows, w)
    return "\n".join(md)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--gb", type=float, default=0.25, help="dataset size per record size, GB")
    p.add_argument(
        "--min-batches",
        type=int,
        default=100,
        help="at least this many batches "
        "an epoch, whatever --gb says (so an epoch's start-up is spread out)",
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--records", default="512,8192,262144")
    p.add_argument("--only", default="", help="row keys, comma-separated (torch always runs)")
    p.add_argument("--check", action="store_true", help="check one epoch's bytes per system")
    p.add_argument("--smoke", action="store_true", help="tiny data, short runs, --check")
    p.add_argument(
        "--row-timeout",
        type=float,
        default=300.0,
        help="seconds before a hung row dumps its stacks and ends the run",
    )
    p.add_argument("--dir", default=None, help="where to write the records (default /dev/shm)")
    p.add_argument("--write", action="store_true", help="write the section to docs/benchmarks.md")
    return p


def _settings(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.smoke:  # 4 batches of every record size, a few MB in all
        args.batch, args.seconds, args.reps, args.check = min(args.batch, 8), 0.0, 1, True
        args.gb, args.min_batches = 0.0, 4
    return args


def run(rows: Sequence[Row], s: Setting, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Every record size in turn: write its records, measure every row, print its table."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="peers_", dir=args.dir or shm)
    results: dict[int, dict[str, Any]] = {}
    try:
        for rec in [int(r) for r in args.records.split(",") if r]:
            nbytes = max(int(args.gb * 1e9), args.min_batches * args.batch * rec)
            results[rec] = measure(make_dataset(root, rec, nbytes), rows, s, args)
            print("\n".join(size_table(rec, results[rec], rows, args.workers)) + "\n", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _any_failed(results: dict[int, dict[str, Any]]) -> bool:
    cells = [v for res in results.values() for v in res.values()]
    return any(isinstance(v, str) and v.startswith("failed") for v in cells)


def main(argv: list[str] | None = None) -> int:
    args = _settings(argv)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu")
        return 2
    keys = {k for k in args.only.split(",") if k} | {"torch"}  # the baseline always runs
    rows = [r for r in ROWS if r.key in keys] if args.only else list(ROWS)
    print(f"# {machine()}")
    results = run(rows, Setting(args.batch, args.workers, dev), args)
    cmd = "python benchmarks/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print("\n".join(summary(results, rows, args.workers)))
    if args.write:
        write_section(f"peers_{dev.type}", report(results, rows, args, cmd.strip()))
    return 1 if _any_failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
