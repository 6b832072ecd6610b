"""A training-like process that saves with a remote tier; the crash test SIGKILLs it mid-upload.

``python _ckpt_upload_worker.py DIR BUCKET ENDPOINT save FIRST LAST``: save steps FIRST..LAST,
printing ``committed N`` after each local commit, then wait for the uploads and print ``uploaded``.
``... resume``: start a manager on DIR (it uploads whatever is missing), wait, print ``uploaded``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

NUMEL = 3 << 19  # 6 MiB of float32: a multipart upload with 5 MiB parts


def state_for(step: int) -> dict[str, Any]:
    """The state saved at ``step`` (deterministic, so the test can check what it restores)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(NUMEL, generator=g), "step": step}


def options(bucket: str, endpoint: str) -> Any:
    from ckpt.remote import RemoteOptions

    return RemoteOptions(
        f"s3://{bucket}/run",
        storage_options={
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        },
        threads=4,
        block_bytes=5 << 20,
        deadline_s=30.0,
    )


def main(argv: list[str]) -> int:
    from ckpt.manager import CheckpointManager

    directory, bucket, endpoint, mode = argv[:4]
    with CheckpointManager(directory, keep_last=2, remote=options(bucket, endpoint)) as m:
        if mode == "save":
            for step in range(int(argv[4]), int(argv[5]) + 1):
                m.save(step, state_for(step)).result(timeout=60)
                print(f"committed {step}", flush=True)
        m.wait(timeout=120, uploads=True)
    print("uploaded", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
