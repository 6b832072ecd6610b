"""Read a dataset that lives in S3: stage it to local disk, or read it lazily through a cache.

    python examples/s3_staging.py                                   # starts a local S3 server
    python examples/s3_staging.py --endpoint http://127.0.0.1:9000  # any S3 API endpoint

Without ``--endpoint`` the script starts a local S3 API server (moto, from the ``test`` extra).
It writes a small dataset locally, uploads it to ``s3://BUCKET/PREFIX`` with s3fs, then reads it
back two ways:

1. ``feedpipe.stage(url, local_dir)``: copy every file in parallel, each verified against the
   CRC32C in ``index.json`` (written last), then read the local copy. Running it again copies
   nothing (files present and verified are kept).
2. ``feedpipe.MemmapDataset(url, cache_dir=...)``: lazy mode, shards are fetched into a bounded,
   crash-safe local cache the first time a batch touches them.

Both are checked against the original records.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

import feedpipe


def storage_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def start_local_server() -> tuple[Any, str]:
    import logging
    import socket

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", help="S3 endpoint URL (default: start a local moto server)")
    p.add_argument("--bucket", help="bucket (created if missing; default: a fresh name)")
    p.add_argument("--prefix", default="datasets/demo")
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--record-bytes", type=int, default=1024)
    p.add_argument("--shard-bytes", type=int, default=512 << 10)
    p.add_argument("--workdir", help="local staging and cache directories (default: temporary)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        server, endpoint = start_local_server()
        print(f"started a local S3 server at {endpoint}")
    opts = storage_options(endpoint)
    bucket = args.bucket or f"feedpipe-demo-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/{args.prefix}"
    tmp = tempfile.TemporaryDirectory() if args.workdir is None else None
    work = Path(tmp.name if tmp else args.workdir)
    try:
        import s3fs

        fs = s3fs.S3FileSystem(**opts)
        if not fs.exists(bucket):
            fs.call_s3("create_bucket", Bucket=bucket)

        # 1. a dataset, written locally and uploaded
        rng = np.random.default_rng(0)
        records = rng.integers(0, 256, (args.records, args.record_bytes), dtype=np.uint8)
        records[:, :8] = np.arange(args.records, dtype="<i8")[:, None].view(np.uint8)  # own id
        labels = np.arange(args.records) % 10
        local = work / "original"
        with feedpipe.MemmapWriter(
            local, shape=(args.record_bytes,), fields={"label": "int64"},
            shard_bytes=args.shard_bytes, overwrite=True,
        ) as w:  # fmt: skip
            w.append_batch(records, label=labels)
        fs.put(str(local) + "/", f"{bucket}/{args.prefix}/", recursive=True)
        print(f"uploaded {len(os.listdir(local))} files to {url}")

        # 2. stage everything to local disk (verified), read the copy
        staged = work / "staged"
        result = feedpipe.stage(url, staged, storage_options=opts, progress=False)
        print(
            f"staged: {result.copied} files copied, {result.skipped} skipped, "
            f"{result.bytes_copied / 2**20:.1f} MiB in {result.seconds:.2f} s"
        )
        again = feedpipe.stage(url, staged, storage_options=opts, progress=False)
        print(f"staged again: {again.copied} copied, {again.skipped} already present and verified")
        check(feedpipe.MemmapDataset(staged), records, labels, "staged copy")

        # 3. lazy: read straight from S3 through a bounded local cache
        lazy = feedpipe.MemmapDataset(
            url, cache_dir=work / "cache", cache_limit_bytes=64 << 20, storage_options=opts
        )
        check(lazy, records, labels, "lazy cache")
        lazy.close()
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()
    return 0


def check(ds: Any, records: np.ndarray, labels: np.ndarray, what: str) -> None:
    loader = feedpipe.DataLoader(ds, batch_size=256, shuffle=True, num_workers=2,
                                 worker_type="thread",
                                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    seen = np.zeros(len(records), dtype=np.int64)
    for batch in loader:
        data = batch["data"].numpy()
        ids = data[:, :8].copy().view("<i8")[:, 0]  # each record starts with its own index
        if not (data == records[ids]).all() or not (batch["label"].numpy() == labels[ids]).all():
            raise SystemExit(f"{what}: records or labels differ from the originals")
        seen[ids] += 1
    if not (seen == 1).all():
        raise SystemExit(f"{what}: {int((seen != 1).sum())} records not read exactly once")
    print(f"{what}: read all {len(seen)} records, contents verified; {loader.meter.summary()}")


if __name__ == "__main__":
    sys.exit(main())
