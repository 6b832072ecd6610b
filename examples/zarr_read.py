"""Read a Zarr v3 array written by zarr-python, through ``feedpipe.ZarrDataset``.

    python examples/zarr_read.py                      # writes a small group, reads it back
    python examples/zarr_read.py --compressor none    # uncompressed: direct preadv reads

zarr-python writes a group with an ``images`` array (N x 16 x 16 uint8, sharded, zstd by
default) and aligned ``labels`` and ``ids`` arrays. ``feedpipe.ZarrDataset`` reads the group
(samples are dicts ``{"ids": ..., "images": ..., "labels": ...}``) with TensorStore (one batched
read per array per batch, the GIL released), through ``feedpipe.DataLoader`` with thread
workers. Every batch is compared with what zarr-python itself reads for the same ids.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import feedpipe


def write_group(path: Path, n: int, compressor: str) -> None:
    import zarr

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 16, 16), dtype=np.uint8)
    labels = (images.reshape(n, -1).mean(1) > 127.5).astype(np.int64)
    compressors = None if compressor == "none" else zarr.codecs.ZstdCodec(level=3)
    group = zarr.open_group(str(path), mode="w")
    arr = group.create_array(
        "images", shape=images.shape, dtype="uint8", chunks=(64, 16, 16),
        shards=(256, 16, 16), compressors=compressors,
    )  # fmt: skip
    arr[:] = images
    group.create_array("labels", shape=labels.shape, dtype="int64", chunks=(256,))[:] = labels
    group.create_array("ids", shape=(n,), dtype="int64", chunks=(256,))[:] = np.arange(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", help="where to write the Zarr group (default: temporary)")
    p.add_argument("--records", type=int, default=2048)
    p.add_argument("--compressor", choices=("zstd", "none"), default="zstd")
    p.add_argument("--backend", choices=("tensorstore", "zarr"), default="tensorstore")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import zarr

    tmp = tempfile.TemporaryDirectory() if args.path is None else None
    path = Path(tmp.name) / "data.zarr" if tmp else Path(args.path)
    try:
        write_group(path, args.records, args.compressor)
        print(f"zarr-python {zarr.__version__} wrote {path} ({args.compressor})")
        ds = feedpipe.ZarrDataset(path, backend=args.backend)
        print(f"ZarrDataset: {len(ds)} samples, arrays {ds.names}, backend {ds.backend}")
        reference = zarr.open_group(str(path), mode="r")  # zarr-python's own reads
        ref_images, ref_labels = reference["images"][:], reference["labels"][:]
        loader = feedpipe.DataLoader(
            ds,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            worker_type="thread",
            generator=torch.Generator().manual_seed(0),
        )
        start, seen = time.perf_counter(), np.zeros(len(ds), dtype=np.int64)
        for batch in loader:
            ids = batch["ids"].numpy()
            if not np.array_equal(batch["images"].numpy(), ref_images[ids]):
                raise SystemExit(f"samples {ids[:4]}...: images differ from zarr-python's")
            if not np.array_equal(batch["labels"].numpy(), ref_labels[ids]):
                raise SystemExit(f"samples {ids[:4]}...: labels differ from zarr-python's")
            seen[ids] += 1
        if not (seen == 1).all():
            raise SystemExit(f"{int((seen != 1).sum())} samples not read exactly once")
        elapsed = time.perf_counter() - start
        print(f"read all {len(seen)} samples once in {elapsed:.2f} s, equal to zarr-python's")
        print(f"input: {loader.meter.summary()}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
