"""What one CUDA call costs the consuming thread while worker threads run: the GIL hand-off.

torch's bindings let the GIL go around every CUDA call (``Event.record``, ``Stream.wait_event``,
``Tensor.to``, ``record_stream``, ``Event.query``). With worker threads busy, the caller must then
win the GIL back, which can take far longer than the call. This prints the per-call time of each
with 0 and ``--threads`` busy threads (a gather loop like a thread worker's: ``index_select`` on a
CPU tensor and a little Python), and the same event calls made through ``libcudart`` with the
GIL held (``ctypes.PyDLL``), for comparison.

    python benchmarks/diagnostics/gil_handoff.py --threads 8     # the GPU machine
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time
from collections.abc import Callable

import torch


def _busy(stop: threading.Event, rows: int, width: int) -> None:
    src = torch.randn(4096, width)
    while not stop.is_set():
        idx = torch.randint(0, 4096, (rows,))
        out = src.index_select(0, idx)
        _ = [int(i) for i in idx[:16]]  # some Python, as a worker's bookkeeping
        del out


def _cudart() -> ctypes.PyDLL:
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "/libcudart" in line})
    for path in paths:
        return ctypes.PyDLL(path)
    return ctypes.PyDLL(None)


def _per_call(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _calls(dev: torch.device) -> dict[str, Callable[[], object]]:
    stream = torch.cuda.Stream(dev)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    torch.cuda.synchronize(dev)
    host = torch.empty(8192 * 64, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(host, device=dev)
    lib = _cudart()
    rec, wait, query = lib.cudaEventRecord, lib.cudaStreamWaitEvent, lib.cudaEventQuery
    for f in (rec, wait, query):
        f.restype = ctypes.c_int
    rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    query.argtypes = [ctypes.c_void_p]
    e, s = ev.cuda_event, stream.cuda_stream
    cur = torch.cuda.current_stream(dev)
    return {
        "torch Event.record": lambda: ev.record(stream),
        "torch Stream.wait_event": lambda: cur.wait_event(ev),
        "torch Event.query": ev.query,
        "torch Tensor.to(non_blocking)": lambda: host.to(dev, non_blocking=True),
        "torch Tensor.record_stream": lambda: dst.record_stream(cur),
        "torch cuda.current_stream": lambda: torch.cuda.current_stream(dev),
        "cudart cudaEventRecord (GIL held)": lambda: rec(e, s),
        "cudart cudaStreamWaitEvent (GIL held)": lambda: wait(cur.cuda_stream, e, 0),
        "cudart cudaEventQuery (GIL held)": lambda: query(e),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--width", type=int, default=2048)
    args = p.parse_args()
    dev = torch.device("cuda")
    calls = _calls(dev)
    for threads in (0, args.threads):
        stop = threading.Event()
        pool = [
            threading.Thread(target=_busy, args=(stop, args.rows, args.width), daemon=True)
            for _ in range(threads)
        ]
        for t in pool:
            t.start()
        time.sleep(0.2)
        print(f"\n{threads} busy threads: us per call on the main thread")
        for name, fn in calls.items():
            us = _per_call(fn, args.calls)
            torch.cuda.synchronize(dev)
            print(f"  {name:<40} {us:9.2f}")
        stop.set()
        for t in pool:
            t.join()


if __name__ == "__main__":
    main()
