"""``num_workers="auto"`` against a grid sweep of fixed settings, in the same run.

Three workloads, each read by every grid point (workers x worker kind x prefetch) and by the
auto-tuned loader (``num_workers="auto", worker_type="auto", prefetch_factor="auto"``, default
CPU budget), with the same training step (a sleep: the GPU's compute, releasing the GIL):

- ``memmap``: records converted to a ``MemmapDataset`` (8 KiB rows, ``read_batch``);
- ``gil``: an unchanged per-sample ``Dataset`` over the same rows with a pure-Python transform
  (it holds the GIL: threads do not scale, processes do);
- ``remote``: a per-sample ``Dataset`` that GETs each record over HTTP from a local server
  behind ``benchmarks/_shaping_proxy.py`` (a round trip per request, like an object store).

For each it prints samples/s of every point, the CPU cores the loader used, auto's rate as a
share of the best grid point (target >= 90%) and of the best point within auto's CPU budget,
over the epochs after the first ("tuned": auto has tuned by then; the first epoch is every
point's warm-up) and over the whole run (its tuning included), each the median of
``--repeats`` runs interleaved across the points (a shared host's load changes hit every point
alike), the order rotated by one point each repeat (no point always runs right after
another). The last epoch alone is printed too; on a loaded host (2 cores at load 10) one epoch
of well under a second swings by 2x, so the tuned figure, over all but the first epoch, is the
one the target is judged on. Beside the medians, the best of the repeats (each point's tuned
samples/s in its least disturbed run: a shared host's load only ever slows a run down) and
auto's share of the best grid point by that figure.

    python benchmarks/autotune.py [--quick] [--workloads memmap,gil,remote] [--epochs 4]
    python benchmarks/autotune.py --quick --samples 32768   # the small grid, full-size epochs
    python benchmarks/autotune.py --no-write   # do not rewrite docs/benchmarks.md

The summary table and the full listing go to the ``autotune`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from benchmarks._shaping_proxy import start_proxy
from feedpipe import DataLoader, MemmapDataset, MemmapWriter
from feedpipe.loader.tuner import available_cores

RECORD = 8192  # bytes per record


class Rows(tud.Dataset):  # type: ignore[type-arg]
    """A user's per-sample dataset over the memmap rows, with a pure-Python transform."""

    def __init__(self, ds: MemmapDataset, work: int, n: int) -> None:
        self.ds, self.work, self.n = ds, work, min(n, len(ds))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        row: torch.Tensor = torch.as_tensor(self.ds[i]).clone()
        acc = 0
        for v in range(self.work):  # holds the GIL, as Python augmentations do
            acc = (acc * 31 + v) & 0xFFFF
        row[0] = acc
        return row


class Remote(tud.Dataset):  # type: ignore[type-arg]
    """Each record a GET over HTTP (one connection per request, through the shaping proxy)."""

    def __init__(self, endpoint: str, n: int) -> None:
        self.endpoint, self.n = endpoint, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with urllib.request.urlopen(f"{self.endpoint}/{i % 64}.bin", timeout=30) as r:
            return torch.frombuffer(bytearray(r.read()), dtype=torch.uint8)


def _cpu() -> float:
    """CPU seconds of this process outside the calling thread, plus joined children's."""
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() - time.thread_time() + child.ru_utime + child.ru_stime


def _run(make: Callable[[], DataLoader], epochs: int, step_s: float) -> dict[str, Any]:
    """Iterate ``epochs`` epochs with a ``step_s`` training step per batch."""
    loader = make()
    rates, counts, spans, cpu0, t_all = [], [], [], _cpu(), time.perf_counter()
    for _ in range(epochs):
        t0, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch)
            time.sleep(step_s)
        spans.append(time.perf_counter() - t0)
        rates.append(n / spans[-1])
        counts.append(n)
    wall = time.perf_counter() - t_all
    tuning = loader.tuning
    later = slice(1, None) if epochs > 1 else slice(None)
    return {
        "last": rates[-1],
        "tuned": sum(counts[later]) / sum(spans[later]),
        "all": sum(counts) / wall,
        "cores": (_cpu() - cpu0) / wall,
        "setting": None
        if tuning is None
        else f"{tuning['num_workers']} {tuning['worker_type']} x{tuning['prefetch_factor']}",
        "log": [] if tuning is None else tuning["log"],
    }


def _grid(quick: bool) -> list[tuple[int, str, int]]:
    workers = [1, 2] if quick else [1, 2, 4]
    prefetch = [2] if quick else [2, 4]
    return list(itertools.product(workers, ["thread", "process"], prefetch))


def _workload(name: str, ds: Any, batch: int, args: argparse.Namespace) -> tuple[list[str], str]:
    """Sweep the grid and auto on ``ds``; the report's lines and the summary table's row."""

    def loader(w: Any, kind: str, p: Any) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        return DataLoader(ds, batch, shuffle=True, num_workers=w, worker_type=kind,
                          prefetch_factor=p, generator=gen)  # fmt: skip

    def fixed(w: int, kind: str, p: int) -> Callable[[], DataLoader]:
        return lambda: loader(w, kind, p)

    def auto() -> DataLoader:
        return loader("auto", "auto", "auto")

    lines = [f"## {name} (batch {batch}, step {args.step_ms} ms, {args.epochs} epochs, "
             f"median of {args.repeats} interleaved runs)"]  # fmt: skip
    makers: dict[Any, Callable[[], DataLoader]] = {g: fixed(*g) for g in _grid(args.quick)}
    makers["auto"] = auto
    runs: dict[Any, list[dict[str, Any]]] = {k: [] for k in makers}
    keys = list(makers)
    for rep in range(args.repeats):  # interleaved: a change of the host's load hits every point
        # rotated: each point runs in each position (a point right after a process point may
        # pay for its workers still ending; auto used to run last, after one, in every repeat)
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            runs[key].append(_run(makers[key], args.epochs, args.step_ms / 1e3))
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("last", "tuned", "all", "cores")}
           for k, rs in runs.items()}  # fmt: skip
    for (w, kind, p), r in ((k, v) for k, v in med.items() if k != "auto"):
        lines.append(f"  {w} {kind:<7} x{p}: {r['tuned']:9.0f} samples/s tuned, {r['last']:9.0f} "
                     f"last epoch, {r['all']:9.0f} whole run, {r['cores']:.2f} cores")  # fmt: skip
    top = {k: max(r["tuned"] for r in rs) for k, rs in runs.items()}  # least disturbed run
    top_key = max((k for k in top if k != "auto"), key=top.__getitem__)
    a = med.pop("auto")
    budget = max(1.0, 0.4 * available_cores())
    best = max(med.items(), key=lambda kv: kv[1]["tuned"])
    fits = [kv for kv in med.items() if kv[1]["cores"] <= budget * 1.05] or [best]
    best_in = max(fits, key=lambda kv: kv[1]["tuned"])
    settings = ", ".join(str(r["setting"]) for r in runs["auto"])
    lines += [
        f"  auto ({settings}): {a['tuned']:9.0f} samples/s tuned, {a['last']:9.0f} last epoch, "
        f"{a['all']:9.0f} whole run, {a['cores']:.2f} cores (budget {budget:.2f})",
        f"  auto / best grid point {best[0]}: {a['tuned'] / best[1]['tuned']:.2f} tuned "
        f"(target >= 0.90), {a['last'] / best[1]['last']:.2f} last epoch, "
        f"{a['all'] / best[1]['all']:.2f} whole run",
        f"  auto / best point within the budget {best_in[0]}: "
        f"{a['tuned'] / best_in[1]['tuned']:.2f} tuned",
        f"  best of the repeats: auto {top['auto']:.0f} samples/s tuned / best grid point "
        f"{_point(top_key)} {top[top_key]:.0f}: {top['auto'] / top[top_key]:.2f}",
        *(f"    tuning (last run): {line}" for line in runs["auto"][-1]["log"]),
    ]
    row = (
        f"| {name} | {_point(best[0])} ({best[1]['tuned']:.0f}, {best[1]['cores']:.2f} cores) | "
        f"{_point(best_in[0])} | {settings} ({a['tuned']:.0f}, {a['cores']:.2f} cores) | "
        f"{a['tuned'] / best[1]['tuned']:.2f} | {a['tuned'] / best_in[1]['tuned']:.2f} | "
        f"{a['last'] / best[1]['last']:.2f} | {a['all'] / best[1]['all']:.2f} |"
    )
    return lines, row


def _point(key: Any) -> str:
    w, kind, p = key
    return f"{w} {kind} x{p}"


def _memmap(root: Path, n: int) -> MemmapDataset:
    rng = np.random.default_rng(0)
    with MemmapWriter(root / "rows", shape=(RECORD // 4,), dtype="int32") as w:
        for lo in range(0, n, 1024):
            m = min(1024, n - lo)
            w.append_batch(rng.integers(0, 1 << 30, (m, RECORD // 4), dtype=np.int32))
    return MemmapDataset(root / "rows")


#: http.server's own CLI listens with a backlog of 5: more concurrent connections than that wait
#: for a SYN retry (1 s), which would measure the test server, not the round trips
_SERVER = """
import functools, http.server, sys
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 256
class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
handler = functools.partial(Quiet, directory=sys.argv[1])
Server(("127.0.0.1", int(sys.argv[2])), handler).serve_forever()
"""


def _remote(root: Path, rtt_ms: float) -> tuple[list[subprocess.Popen[bytes]], str]:
    """A local HTTP server of 64 records and the shaping proxy in front of it."""
    files = root / "http"
    files.mkdir()
    for i in range(64):
        (files / f"{i}.bin").write_bytes(os.urandom(RECORD))
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(files), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy, endpoint = start_proxy(f"http://127.0.0.1:{port}", rtt_s=rtt_ms / 1e3, mbps=200.0)
    return [proxy, server], endpoint


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid and dataset")
    parser.add_argument("--workloads", default="memmap,gil,remote")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--rtt-ms", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per point")
    parser.add_argument(
        "--samples", type=int, default=None, help="memmap rows (default 8192 --quick, else 32768)"
    )
    parser.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md")
    args = parser.parse_args()
    args.epochs = args.epochs or (3 if args.quick else 4)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 processes
    n = args.samples or (8192 if args.quick else 32768)
    load = os.getloadavg()[0]
    cmd = "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    print(f"# autotune vs grid sweep\n{machine()}; load average {load:.1f}\n{cmd}")
    listing: list[str] = []
    table: list[str] = []

    def show(result: tuple[list[str], str]) -> None:
        print("\n".join(result[0]), flush=True)
        listing.extend(result[0])
        table.append(result[1])

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = _memmap(root, n)
        chosen = args.workloads.split(",")
        if "memmap" in chosen:
            show(_workload("memmap", rows, 64, args))
        if "gil" in chosen:
            show(_workload("gil", Rows(rows, 2000, n // 8), 16, args))
        if "remote" in chosen:
            procs, endpoint = _remote(root, args.rtt_ms)
            try:
                ds = Remote(endpoint, 128 if args.quick else 256)
                show(_workload("remote", ds, 8, args))
            finally:
                for p in procs:
                    p.terminate()
                    p.wait(10)
    if not args.no_write:
        write_section("autotune", _section(cmd, load, table, listing))


def _section(cmd: str, load: float, table: list[str], listing: list[str]) -> str:
    """The ``autotune`` section of docs/benchmarks.md."""
    return "\n".join([
        "## Auto-tuning against a grid sweep (`num_workers=\"auto\"`)",
        "",
        f"{machine()}; load average {load:.1f} at the start. Command: `{cmd}`. Each workload "
        "is read by every grid point (workers x kind x prefetch) and by the auto loader "
        "(default CPU budget: 0.4 of the cores, at least one core), median of the interleaved "
        "runs; samples/s over the epochs after the first (tuned: auto has tuned by then). Ratio: "
        "auto's samples/s / the point's (target >= 0.90 within the budget).",
        "",
        "| workload | best grid point (samples/s, cores) | best within the budget | auto "
        "(settings of each run; samples/s, cores) | auto / best | auto / best within budget "
        "| auto / best, last epoch | auto / best, whole run |",
        "|---|---|---|---|---|---|---|---|",
        *table,
        "",
        "```",
        *listing,
        "```",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
