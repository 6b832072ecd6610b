"""Image decoding + training augmentation throughput, three ways, in one run.

(a) torch DataLoader, PIL decode + random resized crop + flip + normalize, process workers;
(b) a bare DALI pipeline with its own file reader (``fn.readers.file``) and the same transforms;
(c) ``feedpipe.dali.ImageLoader`` over a feedpipe ``MemmapDataset`` of the same JPEGs.

Synthetic JPEGs (500x375, quality 90) are generated in a temp dir. Every path yields batches of
normalized float32 NCHW 224x224 tensors on the target device. Each subject is timed the same way:
one continuous run of ``--epochs`` epochs (``set_epoch`` each), the clock starting after its first
``--warmup-batches`` batches (worker start, pipeline build, allocations); (b) and (c) are measured
``--rounds`` times, alternately, and the best round counts. Prints images/s and the ratios
(c)/(b) and (c)/(a); writes the ``dali_images`` section of docs/benchmarks.md.

    python benchmarks/dali_images.py                           # GPU machine
    python benchmarks/dali_images.py --device cpu --images 256 # smoke run without a GPU
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import machine, write_section

MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255
CROP = 224


def _make_jpeg(args: tuple[str, int]) -> int:
    """One photo-like 500x375 JPEG: smooth colour fields + texture (about 60-70 KB at q90)."""
    from PIL import Image

    path, seed = args
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    img = Image.fromarray(low).resize((500, 375), Image.BICUBIC)
    a = np.asarray(img, np.int16) + rng.normal(0, 10, (375, 500, 3)).astype(np.int16)
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(path, format="JPEG", quality=90)
    return os.path.getsize(path)


def make_images(root: Path, n: int, procs: int) -> tuple[list[str], float]:
    files = [str(root / f"img_{i:06d}.jpg") for i in range(n)]
    with mp.get_context("fork").Pool(procs) as pool:
        sizes = pool.map(_make_jpeg, [(f, i) for i, f in enumerate(files)], chunksize=16)
    return files, float(np.mean(sizes))


# ------------------------------------------------------------------------ (a) PIL + DataLoader
class PILTrainSet(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Decode with PIL; random resized crop (area 0.08-1, ratio 3/4-4/3) + flip + normalize."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        rng = np.random.default_rng()
        with Image.open(self.files[i]) as im:
            img = im.convert("RGB")
        w, h = img.size
        box = (0, 0, w, h)
        for _ in range(10):
            area = w * h * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                box = (x, y, x + cw, y + ch)
                break
        img = img.resize((CROP, CROP), Image.BILINEAR, box=box)
        a = np.asarray(img, np.float32)
        if rng.random() < 0.5:
            a = a[:, ::-1]
        a = (a - MEAN) / STD
        return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))), i


def run_pil(files: list[str], args: argparse.Namespace, device: torch.device) -> float:
    loader = torch.utils.data.DataLoader(
        PILTrainSet(files),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
        prefetch_factor=4,
        timeout=600,
    )
    held = {"loader": loader}
    del loader

    def epoch() -> Any:
        return ((x.to(device, non_blocking=True), y) for x, y in held["loader"])

    rate = _timed(epoch, args, args.baseline_epochs)
    held.clear()  # stop the workers before DALI starts
    gc.collect()
    return rate


# --------------------------------------------------------------------- (b) bare DALI pipeline
def run_bare_dali(files: list[str], args: argparse.Namespace, device_id: int | None) -> float:
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from feedpipe.dali.pipeline import Transform, augment

    @pipeline_def(
        batch_size=args.batch_size,
        num_threads=args.threads,
        device_id=device_id,
        seed=1,
        prefetch_queue_depth=2,
    )
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(
            files=files,
            labels=list(range(len(files))),
            random_shuffle=True,
            initial_fill=1024,
            name="reader",
        )
        dev = "cpu" if device_id is None else "mixed"
        return augment(jpegs, Transform(train=True, crop=CROP), dev, args.hw_decoder_load), labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(
        p,
        ["images", "labels"],
        reader_name="reader",
        auto_reset=True,
        last_batch_policy=LastBatchPolicy.PARTIAL,
    )
    return _timed(lambda: ((b[0]["images"], b[0]["labels"]) for b in it), args, args.epochs)


# ------------------------------------------------------------- (c) feedpipe ImageLoader
def write_dataset(files: list[str], path: Path) -> Any:
    from feedpipe.datasets.memmap import MemmapDataset, MemmapWriter

    with MemmapWriter(path, fields={"label": "int64"}) as w:
        for i, f in enumerate(files):
            w.append(Path(f).read_bytes(), label=i)
    return MemmapDataset(path)


def run_feedpipe(ds: Any, args: argparse.Namespace, device: str) -> tuple[float, Any]:
    from feedpipe.dali import ImageLoader

    loader = ImageLoader(
        ds,
        args.batch_size,
        shuffle=True,
        train=True,
        crop=CROP,
        device=device,
        num_threads=args.threads,
        py_num_workers=args.py_workers,
        hw_decoder_load=args.hw_decoder_load,
    )
    epoch = [0]

    def one_epoch() -> Any:
        loader.set_epoch(epoch[0])
        epoch[0] += 1
        return iter(loader)

    rate = _timed(one_epoch, args, args.epochs)
    meter = loader.meter
    loader.close()
    return rate, meter


# ----------------------------------------------------------------------------- timing
def _timed(epoch_iter: Any, args: argparse.Namespace, epochs: int) -> float:
    """Images/s over ``epochs`` epochs, the clock started after ``args.warmup_batches`` batches."""

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    seen, n, start = 0, 0, 0.0
    for _ in range(epochs):
        for x, _y in epoch_iter():
            seen += 1
            if seen > args.warmup_batches:
                n += x.shape[0]
            elif seen == args.warmup_batches:
                sync()
                start = time.perf_counter()
    sync()
    if seen <= args.warmup_batches:
        raise SystemExit(f"only {seen} batches: fewer than --warmup-batches {args.warmup_batches}")
    return n / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--images", type=int, default=16384)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs for (b), (c)")
    ap.add_argument("--baseline-epochs", type=int, default=1, help="timed epochs for (a)")
    ap.add_argument("--warmup-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternate (b), (c) runs; best counts")
    ap.add_argument("--workers", type=int, default=16, help="DataLoader processes for (a)")
    ap.add_argument("--threads", type=int, default=8, help="DALI num_threads for (b), (c)")
    ap.add_argument("--py-workers", type=int, default=4, help="feedpipe reader processes")
    ap.add_argument("--hw-decoder-load", type=float, default=0.9)
    ap.add_argument("--only", default="abc", help="which of a, b, c to run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device_id = 0 if args.device == "cuda" else None
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="dali-bench-") as tmp:
        t0 = time.perf_counter()
        files, mean_size = make_images(Path(tmp), args.images, os.cpu_count() or 2)
        ds = write_dataset(files, Path(tmp) / "ds")
        print(
            f"{args.images} JPEGs 500x375, mean {mean_size / 1e3:.1f} KB, "
            f"made in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        rates: dict[str, float] = {}
        # (a) first: its workers fork, which must happen before DALI starts its threads
        if "a" in args.only:
            rates["a"] = run_pil(files, args, device)
            print(
                f"(a) DataLoader + PIL, {args.workers} workers: {rates['a']:,.0f} img/s", flush=True
            )
        for r in range(args.rounds):
            if "b" in args.only:
                rate = run_bare_dali(files, args, device_id)
                rates["b"] = max(rates.get("b", 0.0), rate)
                print(f"round {r}: (b) bare DALI (fn.readers.file): {rate:,.0f} img/s", flush=True)
            if "c" in args.only:
                rate, meter = run_feedpipe(ds, args, args.device)
                rates["c"] = max(rates.get("c", 0.0), rate)
                print(
                    f"round {r}: (c) feedpipe ImageLoader: {rate:,.0f} img/s "
                    f"(stalled {meter.stall_s:.2f} s)",
                    flush=True,
                )
    lines = [
        f"Machine: {machine()}",
        "",
        f"`python benchmarks/dali_images.py --device {args.device} --images {args.images} "
        f"--batch-size {args.batch_size} --threads {args.threads} --py-workers {args.py_workers} "
        f"--epochs {args.epochs} --rounds {args.rounds}`"
        f" — {args.images} synthetic 500x375 JPEGs (q90, mean {mean_size / 1e3:.0f} KB), train "
        f"transforms (random resized crop 224, flip, normalize, float32 NCHW), "
        f"hw_decoder_load {args.hw_decoder_load}; timed over {args.epochs} epochs "
        f"((a): {args.baseline_epochs}) after {args.warmup_batches} warm-up batches, "
        f"best of {args.rounds} alternating rounds for (b) and (c).",
        "",
        "| path | images/s |",
        "|---|---|",
    ]
    names = {
        "a": f"(a) torch DataLoader + PIL, {args.workers} process workers",
        "b": "(b) bare DALI pipeline, fn.readers.file",
        "c": "(c) feedpipe.dali.ImageLoader over a MemmapDataset",
    }
    lines += [f"| {names[k]} | {rates[k]:,.0f} |" for k in "abc" if k in rates]
    lines.append("")
    if "c" in rates and "b" in rates:
        r = rates["c"] / rates["b"]
        lines.append(f"- (c)/(b) = {r:.2f} (target >= 0.90: {'met' if r >= 0.9 else 'NOT met'})")
        print(lines[-1])
    if "c" in rates and "a" in rates:
        r = rates["c"] / rates["a"]
        lines.append(f"- (c)/(a) = {r:.2f} (target >= 4: {'met' if r >= 4 else 'NOT met'})")
        print(lines[-1])
    if not args.no_write:
        write_section("dali_images", "\n\n".join(["### DALI image decoding", "\n".join(lines)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
