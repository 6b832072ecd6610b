"""Remote-tier upload benchmark: sequential ``fs.put`` of a checkpoint directory vs ckpt's uploader.

A local S3 API server (moto, server mode, in its own process) stands in for S3. One committed
checkpoint directory (``--size-mb`` of tensors, written by ``CheckpointManager``) is uploaded by:

- ``fs.put`` sequential: one file at a time, one multipart part at a time (the baseline);
- ``fs.put`` with s3fs's defaults (files and parts concurrent; no verification);
- ckpt's uploader (``RemoteTier``): parts in parallel, verified by size, then by CRC32C read-back.

Each is run ``--repeats`` times into a fresh prefix; the median MB/s is reported with the ratio to
the baseline, and the section ``ckpt_remote`` of docs/benchmarks.md is rewritten.

    .venv/bin/python benchmarks/ckpt_remote.py --size-mb 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, write_section
from benchmarks._s3 import create_bucket, s3_options, start_moto
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions, RemoteTier


def _options(endpoint: str) -> dict[str, Any]:
    return {**s3_options(endpoint), "skip_instance_cache": True}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (Linux ``/proc``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_rate(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    med = statistics.median(seconds)
    return nbytes / med / 1e6, med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--block-mb", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="do not update docs")
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    import s3fs

    proc, endpoint = start_moto()
    try:
        fs = s3fs.S3FileSystem(**_options(endpoint))
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        create_bucket(endpoint, bucket)
        with tempfile.TemporaryDirectory(prefix="ckpt-remote-bench-") as tmp:
            root = Path(tmp)
            n = args.size_mb << 20
            state = {f"t{i}": torch.randn((n // 4) // 8) for i in range(8)}
            with CheckpointManager(root) as m:
                m.save(1, state).result()
            step = root / "step-1"
            nbytes = sum(p.stat().st_size for p in step.iterdir())
            block = args.block_mb << 20
            keys = ("seq", "put", "ckpt_size", "ckpt_readback")
            times: dict[str, list[float]] = {k: [] for k in keys}
            busy: dict[str, list[float]] = {k: [] for k in keys}  # server CPU per wall second
            for r in range(args.repeats):  # interleaved, so drift affects every method alike
                t0, c0 = time.perf_counter(), _cpu_s(proc.pid)
                for f in sorted(step.iterdir()):
                    fs.put_file(str(f), f"{bucket}/seq{r}/step-1/{f.name}", max_concurrency=1)
                times["seq"].append(time.perf_counter() - t0)
                busy["seq"].append((_cpu_s(proc.pid) - c0) / times["seq"][-1])
                t0, c0 = time.perf_counter(), _cpu_s(proc.pid)
                fs.put(str(step), f"{bucket}/put{r}/step-1", recursive=True)
                times["put"].append(time.perf_counter() - t0)
                busy["put"].append((_cpu_s(proc.pid) - c0) / times["put"][-1])
                for verify in ("size", "readback"):
                    url = f"s3://{bucket}/ckpt-{verify}{r}"
                    opts = RemoteOptions(
                        url,
                        storage_options=_options(endpoint),
                        threads=args.threads,
                        block_bytes=block,
                        verify=verify,
                    )
                    t0, c0 = time.perf_counter(), _cpu_s(proc.pid)
                    tier = RemoteTier(root, opts, keep_last=None)  # finds step 1, uploads it
                    tier.wait()
                    times[f"ckpt_{verify}"].append(time.perf_counter() - t0)
                    busy[f"ckpt_{verify}"].append(
                        (_cpu_s(proc.pid) - c0) / times[f"ckpt_{verify}"][-1]
                    )
                    tier.raise_pending()
                    assert tier.stats.uploads[1].state == "done"
                    tier.close()
                    (root / "upload-status.json").unlink()
    finally:
        proc.kill()
        proc.wait()
    seq_rate = _median_rate(nbytes, times["seq"])[0]
    rows = [
        ("`fs.put_file` sequential (baseline)", "seq"),
        ("`fs.put(dir)`, s3fs defaults", "put"),
        ("ckpt uploader, verify=size", "ckpt_size"),
        ("ckpt uploader, verify=readback (CRC32C)", "ckpt_readback"),
    ]
    lines = [
        f"Machine: {machine()}",
        "",
        f"Command: `.venv/bin/python benchmarks/ckpt_remote.py --size-mb {args.size_mb} "
        f"--repeats {args.repeats} --threads {args.threads} --block-mb {args.block_mb}`",
        "",
        f"One committed checkpoint ({nbytes / 1e6:.0f} MB: `data.bin` + manifest) uploaded to a "
        "local moto S3 server (its own process) through s3fs; median of the repeats.",
        "",
        "| method | seconds | MB/s | vs sequential | S3 server CPU (cores busy) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key in rows:
        rate, sec = _median_rate(nbytes, times[key])
        cores = statistics.median(busy[key])
        lines.append(f"| {label} | {sec:.2f} | {rate:.0f} | {rate / seq_rate:.2f}x | {cores:.2f} |")
    best = _median_rate(nbytes, times["ckpt_size"])[0] / seq_rate
    verdict = "met" if best >= 3 else "NOT met"
    lines += [
        "",
        f"Target (ckpt >= 3x sequential `fs.put`): {verdict} ({best:.2f}x with verify=size). "
        "The last column is the moto server's CPU time per wall second: near 1.0 means the "
        "server (one Python process, GIL-bound) is saturated, so parallel parts cannot raise "
        "the rate here; on a real object store each connection is bandwidth-limited and parts "
        "in flight add up. Read-back verification downloads every byte again, which lowers "
        "the rate further. Other jobs shared this 2-core machine during the run.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("ckpt_remote", text)


if __name__ == "__main__":
    main()
