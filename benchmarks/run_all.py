"""Run every benchmark and rewrite the tables in docs/benchmarks.md (``make bench``).

    .venv/bin/python benchmarks/run_all.py               # CPU benchmarks, quick settings
    .venv/bin/python benchmarks/run_all.py --full        # CPU benchmarks, their own defaults
    .venv/bin/python benchmarks/run_all.py --gpu         # GPU benchmarks (on a GPU machine)
    .venv/bin/python benchmarks/run_all.py --only datasets,staging
    .venv/bin/python benchmarks/run_all.py --headline    # only regenerate the headline lists

Each benchmark is its own script: it runs its baseline in the same run, prints the ratio, and
rewrites its own section of docs/benchmarks.md (machine, command and date included) through
``benchmarks/_report.write_section``. This script runs them one after another as subprocesses,
reports which succeeded, and then regenerates the "headline" list of measured ratios in
``README.md`` and ``docs/index.md`` from the tables now in docs/benchmarks.md, so the front
pages never quote a number the tables do not hold. A benchmark that fails does not stop the
others; the exit status is 1 if any failed. The scripts in ``benchmarks/diagnostics/`` explain a
figure rather than produce one; this script does not run them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
FRONT_PAGES = (ROOT / "README.md", ROOT / "docs" / "index.md")

__all__ = ["BENCHMARKS", "Benchmark", "headline", "main", "update_headlines"]


@dataclass(frozen=True)
class Benchmark:
    """One script: its quick and full arguments, and whether it needs a GPU."""

    name: str
    quick: tuple[str, ...]
    full: tuple[str, ...] = ()
    gpu: bool = False


_DALI_FULL = ("--device", "cuda", "--images", "16384", "--batch-size", "256", "--threads", "8",
              "--py-workers", "4", "--epochs", "3", "--rounds", "2")  # fmt: skip

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("loader_overhead", ("--repeats", "3", "--mib", "32"), ("--repeats", "5")),
    Benchmark("datasets", ("--quick",), ("--full",)),
    Benchmark("datasets", ("--shards",), ("--shards", "--full")),  # the shard-count axis
    Benchmark("token_windows", ("--docs", "4000"), ("--docs", "20000", "--seconds", "5")),
    Benchmark("mixed", (), ("--full",)),
    Benchmark("memmap_vs_take", ("--mb", "32", "--reps", "3", "--write"), ("--write",)),
    Benchmark("host_device", ("--write",), ("--write", "--reps", "9", "--seconds", "1")),
    Benchmark("convert_fn", (), ("--full",)),
    Benchmark("tar_read", (), ("--full",)),
    Benchmark("stall_overhead", ("--batches", "20000", "--reps", "3")),
    Benchmark("staging", ("--shards", "16", "--shard-mb", "4", "--repeat", "1")),
    Benchmark("cache_policy", ()),
    Benchmark("autotune", ("--quick", "--repeats", "2"), ("--repeats", "2")),
    Benchmark("ckpt_auto_interval", ("--budget", "4", "--rounds", "2")),
    Benchmark(
        "ckpt_save",
        ("--device", "cpu", "--size-gb", "0.5", "--saves", "3"),
        ("--device", "cpu", "--size-gb", "2.0", "--saves", "3"),
    ),
    Benchmark("ckpt_save", ("--cpu-tensors", "3000", "--saves", "3")),  # many small tensors
    Benchmark("ckpt_remote", ("--size-mb", "64", "--repeats", "1")),
    Benchmark("gpu_feed", ("--gb", "1", "--seconds", "2"), (), gpu=True),
    Benchmark(
        "dali_images",
        ("--device", "cuda", "--images", "4096", "--epochs", "2", "--rounds", "1"),
        _DALI_FULL,
        gpu=True,
    ),
)


# ---------------------------------------------------------------------------- headline list
def _section(text: str, name: str) -> str:
    m = re.search(rf"<!-- BEGIN {name} -->(.*?)<!-- END {name} -->", text, re.S)
    return m.group(1) if m else ""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _row(section: str, *starts: str) -> list[str] | None:
    """The first table row whose leading cells start with ``starts``."""
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) >= len(starts) and all(
            c.startswith(s) for c, s in zip(cells, starts, strict=False)
        ):
            return cells
    return None


def headline(doc_text: str) -> list[str]:
    """Bullet lines of measured ratios, each copied from a table in docs/benchmarks.md.

    Lines whose source row is absent (a benchmark not run, or its table changed shape) are left
    out rather than guessed.
    """
    out: list[str] = []
    lo = _section(doc_text, "loader_overhead")
    small = _row(lo, "8 KiB", "2", "feedpipe thread")
    large = _row(lo, "256 KiB", "2", "feedpipe thread")
    if small and large:
        out.append(
            f"`feedpipe.DataLoader` with thread workers on a per-sample memmap dataset, same "
            f"`num_workers=2`: **{small[-1]}** (8 KiB records) and **{large[-1]}** (256 KiB) "
            "torch's throughput" + (" (median of paired epochs)." if "paired" in lo else ".")
        )
    ds = _section(doc_text, "datasets")
    per_sample = _row(ds, "MemmapDataset / (a)")
    if per_sample and len(per_sample) >= 5:
        out.append(
            f"`MemmapDataset` batched reads vs per-sample `__getitem__` in torch's DataLoader: "
            f"**{per_sample[2]}** at 512 B, **{per_sample[3]}** at 8 KiB, "
            f"**{per_sample[4]}** at 256 KiB records."
        )
    gf = _section(doc_text, "gpu_feed")
    big, small = _row(gf, "256 KiB"), _row(gf, "8 KiB")
    gpu_name = re.search(r"(NVIDIA [^;,]+)", gf)
    if big and small:
        # the bold cell: the path DataLoader(device=...) takes by default for that record size
        picks = [
            next(
                (m for c in r[2:] if (m := re.search(r"\*\*([0-9.]+)\*\*.*\*\*([0-9.]+x)\*\*", c))),
                None,
            )
            for r in (big, small)
        ]
        if all(picks):
            b, s8 = picks
            assert b is not None and s8 is not None
            where = f"on an {gpu_name.group(1)}" if gpu_name else "on a GPU"
            out.append(
                f'`feedpipe.DataLoader(device="cuda")` vs torch\'s `pin_memory=True` + '
                f"`.to(device, non_blocking=True)` {where}: **{b.group(2)}** the bytes delivered "
                f"to the GPU per second at 256 KiB records ({b.group(1)} GB/s), "
                f"**{s8.group(2)}** at 8 KiB ({s8.group(1)} GB/s)."
            )
    st = _section(doc_text, "staging")
    shaped = _row(st, "proxy", "`feedpipe.stage`")  # through the shaping proxy, if it ran
    stage = shaped or _row(st, "`feedpipe.stage`")
    if stage:
        link = f" ({stage[0]})" if shaped else ""
        out.append(
            f"`feedpipe.stage` from S3{link} vs a sequential `fs.get` loop: **{stage[-1]}** "
            "the throughput, every file CRC32C-verified."
        )
    cs = _section(doc_text, "ckpt_save")
    parts = []
    for sub in re.split(r"^### ", cs, flags=re.M):
        m = re.search(r"ckpt steady blocked / DCP async_save[^:]*:\s*([0-9.]+x)", sub)
        if not m:
            continue
        gpu_name = re.search(r"(NVIDIA [^;,]+)", sub)
        if sub.startswith("GPU"):
            where = f"CUDA state on an {gpu_name.group(1)}" if gpu_name else "CUDA state"
        else:
            where = "CPU state"
        parts.append(f"**{m.group(1)}** ({where})")
    if parts:
        out.append(
            "ckpt async save: the training loop is blocked "
            + ", ".join(parts)
            + " as long as with `torch.distributed.checkpoint.async_save` (steady state)."
        )
    dali = _section(doc_text, "dali_images")
    vs_pil = re.search(r"\(c\)/\(a\) = ([0-9.]+)", dali)
    vs_dali = re.search(r"\(c\)/\(b\) = ([0-9.]+)", dali)
    gpu = re.search(r"(NVIDIA [^;,]+)", dali)
    if vs_pil and vs_dali:
        where = f"on an {gpu.group(1)}" if gpu else "on a GPU"
        out.append(
            f"DALI image decoding through `feedpipe.dali.ImageLoader` {where}: "
            f"**{vs_pil.group(1)}** times the images/s of a torch DataLoader decoding with PIL, "
            f"**{vs_dali.group(1)}** times a bare DALI pipeline."
        )
    missed = [
        name
        for name in re.findall(r"<!-- BEGIN (\w+) -->", doc_text)
        if re.search(r"\bNOT met\b|\bnot reached\b|\bmissed\b", _section(doc_text, name), re.I)
    ]
    if missed:
        out.append(
            "Sections that report a target as not met: "
            + ", ".join(f"`{name}`" for name in missed)
            + " (the other tables also give each target next to the figure reached)."
        )
    return out


def update_headlines(pages: tuple[Path, ...] = FRONT_PAGES, doc: Path = DOC) -> list[str]:
    """Rewrite the ``headline`` block of each page that has one; returns the lines written."""
    lines = headline(doc.read_text())
    block = "\n".join(f"- {line}" for line in lines) or "- (no benchmark results yet)"
    block += "\n\nSource: [docs/benchmarks.md](" + "{link})."
    for page in pages:
        if not page.exists():
            continue
        text = page.read_text()
        begin, end = "<!-- BEGIN headline -->", "<!-- END headline -->"
        if begin not in text:
            continue
        link = "benchmarks.md" if page.parent.name == "docs" else "docs/benchmarks.md"
        new = f"{begin}\n{block.replace('{link}', link)}\n{end}"
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), new.replace("\\", r"\\"), text,
                      flags=re.S)  # fmt: skip
        page.write_text(text)
    return lines


# ---------------------------------------------------------------------------- running
def _gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="each benchmark's own (longer) settings")
    ap.add_argument("--gpu", action="store_true", help="run the GPU benchmarks instead")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--headline", action="store_true", help="only regenerate the headlines")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    args = ap.parse_args(argv)
    if not args.headline:
        only = {n for n in args.only.split(",") if n}
        unknown = only - {b.name for b in BENCHMARKS}
        if unknown:
            ap.error(f"unknown benchmarks {sorted(unknown)}")
        if args.gpu and not _gpu_available():
            ap.error("--gpu needs a CUDA GPU")
        chosen = [b for b in BENCHMARKS if (b.name in only if only else b.gpu == args.gpu)]
        listed = {b.name for b in BENCHMARKS}
        for path in sorted((ROOT / "benchmarks").glob("[!_]*.py")):
            if path.stem not in listed and path.stem != "run_all":
                print(f"note: benchmarks/{path.name} is not in run_all.BENCHMARKS; not run")
        failed: list[str] = []
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        for bench in chosen:
            script = ROOT / "benchmarks" / f"{bench.name}.py"
            if not script.exists():
                print(f"== {bench.name}: benchmarks/{script.name} not found; skipped")
                continue
            extra = bench.full if args.full else bench.quick
            cmd = [sys.executable, str(script), *extra]
            print(f"== {bench.name}: {' '.join(['python', f'benchmarks/{script.name}', *extra])}")
            sys.stdout.flush()
            t0 = time.perf_counter()
            try:
                code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout, check=False)
                rc = code.returncode
            except subprocess.TimeoutExpired:
                rc = -1
                print(f"== {bench.name}: timed out after {args.timeout:.0f} s")
            print(f"== {bench.name}: exit {rc} in {time.perf_counter() - t0:.0f} s")
            if rc != 0:
                failed.append(bench.name)
        if failed:
            print(f"failed: {', '.join(failed)}")
    lines = update_headlines()
    print(f"headline ratios rewritten in README.md and docs/index.md ({len(lines)} lines)")
    return 1 if not args.headline and failed else 0


if __name__ == "__main__":
    sys.exit(main())
