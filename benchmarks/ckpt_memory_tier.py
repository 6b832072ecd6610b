"""Memory tier benchmark: saves into shared memory vs the disk, and restore after SIGKILL from
memory vs from disk, each with its baseline in the same run and the ratio printed.

1. Save every step: ``--saves`` saves of the state, each waited until committed, by a manager
   with ``memory=`` (every save into the tmpfs, every ``--persist-every``-th persisted to disk in
   the background) and by a plain manager on the disk (the baseline). Reported: the mean time
   from ``save()`` to committed, and the mean time ``save()`` blocked.
2. Restore after a kill: a child process saves the state with ``memory=`` and
   ``persist_every=1`` (so the disk holds the same step) and SIGKILLs itself; this process then
   restores it, every CRC checked, from the memory tier and from the disk with its page cache
   dropped for the files (``posix_fadvise(DONTNEED)``, the cold restore after a node restart) and
   warm (the page cache), into ``--device`` tensors (``cuda``: the GPU target of >= 20 GB/s).

    .venv/bin/python benchmarks/ckpt_memory_tier.py --size-mb 256             # CPU (this VM)
    python benchmarks/ckpt_memory_tier.py --device cuda --size-mb 4096        # GPU
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine
from ckpt.manager import CheckpointManager
from ckpt.tiers.memory_gc import clear_stale
from ckpt.tiers.memory_options import MemoryOptions

_TENSOR_BYTES = 16 << 20


def make_state(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """``nbytes`` of float32 tensors of 16 MiB on ``device``."""
    state, left, i = {}, nbytes, 0
    while left > 0:
        n = min(_TENSOR_BYTES, left) // 4
        state[f"layer{i}.weight"] = torch.randn(n, device=device)
        left -= n * 4
        i += 1
    return state


def _saves(
    manager: CheckpointManager, state: dict[str, torch.Tensor], n: int
) -> tuple[float, float]:
    """Mean seconds from ``save()`` to committed, and mean seconds blocked, over ``n`` saves."""
    manager.save(0, state).result()  # the first save allocates the staging pool
    total = blocked = 0.0
    for step in range(1, n + 1):
        t0 = time.perf_counter()
        handle = manager.save(step, state)
        blocked += time.perf_counter() - t0
        handle.result()
        total += time.perf_counter() - t0
    manager.wait()
    return total / n, blocked / n


def bench_save(work: Path, state: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
    opts = MemoryOptions(root=args.shm, keep=2, persist_every=args.persist_every)
    with CheckpointManager(work / "mem-run", keep_last=2, memory=opts) as m:
        mem, mem_blocked = _saves(m, state, args.saves)
    with CheckpointManager(work / "disk-run", keep_last=2) as d:
        disk, disk_blocked = _saves(d, state, args.saves)
    print(f"save every step ({args.saves} saves, committed before the next):")
    print(
        f"  memory tier ({args.shm}): {mem * 1e3:8.1f} ms/save  blocked {mem_blocked * 1e3:.1f} ms"
    )
    print(
        f"  disk tier (baseline):   {disk * 1e3:8.1f} ms/save  blocked {disk_blocked * 1e3:.1f} ms"
    )
    print(f"  ratio disk/memory: {disk / mem:.2f}x faster into memory")


_CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
from benchmarks.ckpt_memory_tier import make_state
from ckpt.manager import CheckpointManager
from ckpt.tiers.memory_options import MemoryOptions
m = CheckpointManager({disk!r}, memory=MemoryOptions(root={shm!r}, keep=1, persist_every=1))
m.save(1, make_state({nbytes}, "cpu")).result()
m.wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restore(manager: CheckpointManager, device: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    state = manager.restore(map_location=device)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    stats = manager.stats.last_restore
    assert stats is not None and stats.verified and len(state) > 0
    return stats.nbytes / dt / 1e9, str(stats.path)


def bench_restore(work: Path, args: argparse.Namespace) -> None:
    disk = work / "killed"
    repo = str(Path(__file__).resolve().parent.parent)
    code = textwrap.dedent(_CHILD).format(
        repo=repo, disk=str(disk), shm=args.shm, nbytes=args.nbytes
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    mem = CheckpointManager(disk, memory=MemoryOptions(root=args.shm))
    plain = CheckpointManager(disk)
    rates: dict[str, list[float]] = {"memory": [], "disk cold": [], "disk warm": []}
    for _ in range(args.repeats):
        rate, where = _restore(mem, args.device)
        assert where.startswith(args.shm), where
        rates["memory"].append(rate)
        _drop_cache(disk)
        rates["disk cold"].append(_restore(plain, args.device)[0])
        rates["disk warm"].append(_restore(plain, args.device)[0])
    best = {k: max(v) for k, v in rates.items()}
    print(f"restore after SIGKILL into {args.device} (every CRC checked, best of {args.repeats}):")
    for name, rate in best.items():
        print(f"  {name:<10} {rate:6.2f} GB/s")
    print(f"  ratio memory/disk cold: {best['memory'] / best['disk cold']:.2f}x; "
          f"memory/disk warm: {best['memory'] / best['disk warm']:.2f}x")  # fmt: skip
    if args.device == "cuda":
        print(f"  GPU target >= 20 GB/s from the memory tier: {best['memory']:.2f} GB/s")
    mem.close()
    plain.close()
    print("  " + "; ".join(clear_stale(disk, args.shm, dry_run=False)))  # the killed run's tier


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shm", default="/dev/shm", help="the tmpfs of the memory tier")
    p.add_argument("--dir", default=None, help="the disk directory (default: a temp dir)")
    args = p.parse_args(argv)
    args.nbytes = args.size_mb << 20
    print(machine())
    print(f"state: {args.size_mb} MiB of float32 on {args.device}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt-memtier-bench-") as tmp:
        work = Path(tmp)
        bench_save(work, make_state(args.nbytes, args.device), args)
        bench_restore(work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
