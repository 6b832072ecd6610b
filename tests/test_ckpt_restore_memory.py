"""Restore memory is bounded by what exists: data file sizes are checked before anything is
allocated, ``restore(into=)`` streams chunk by chunk into the caller's tensors, and a tensor too
large for this host is a clear error. Each case runs in a subprocess under ``RLIMIT_AS``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckpt import format as fmt
from feedpipe.io.crc import crc32c, to_hex

CHUNK = 16 << 20
NBYTES = 512 << 20  # the data file (mostly a hole); an up-front buffer of it breaks the limit
MARGIN = 192 << 20  # address space allowed beyond the caller's own tensors

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS, /proc, sparse files")


def _sparse_step(step_dir: Path, nbytes: int, claim: int | None = None) -> torch.Tensor:
    """A step holding one float32 tensor ``w`` of ``nbytes`` in a sparse data file: real bytes in
    its first and last chunk, a hole between. Returns the tensor's expected head (first 256)."""
    step_dir.mkdir(parents=True)
    head = torch.arange(64, dtype=torch.float32) + 1
    tail = torch.full((64,), 7.0)
    data = step_dir / "data.bin"
    with open(data, "wb") as f:
        f.truncate(nbytes)
        f.write(head.numpy().tobytes())
        f.seek(nbytes - 256)
        f.write(tail.numpy().tobytes())
    zero = to_hex(crc32c(bytes(CHUNK)))
    n_chunks = -(-nbytes // CHUNK)
    crcs = [zero] * n_chunks
    with open(data, "rb") as f:
        for i in (0, n_chunks - 1):
            f.seek(i * CHUNK)
            crcs[i] = to_hex(crc32c(f.read(CHUNK)))
    size = nbytes if claim is None else claim
    body = {
        "format": "ckpt",
        "version": fmt.FORMAT_VERSION,
        "step": int(step_dir.name.split("-")[1]),
        "nbytes": size,
        "tree": {
            "t": "dict",
            "items": [["w", {"t": "tensor", "i": 0}], ["step", {"t": "v", "v": 1}]],
        },
        "entries": [
            {
                "kind": "tensor",
                "dtype": "float32",
                "shape": [size // 4],
                "file": "data.bin",
                "offset": 0,
                "nbytes": size,
                "device": "cpu",
            },
        ],
        "files": [
            {
                "name": "data.bin",
                "size": size,
                "chunk_bytes": CHUNK,
                "crc32c": crcs + [zero] * (-(-size // CHUNK) - n_chunks),
            },
        ],
        "metadata": {},
    }
    fmt.write_manifest(step_dir, body)
    return head


CHILD = """
import resource, sys, torch
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.manager import CheckpointManager

root, nbytes, margin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = torch.empty(nbytes // 4)  # the caller's tensor (untouched pages: address space only)
into = {"w": target, "step": -1}
m = CheckpointManager(root, keep_last=None)

def vm():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmSize"))
    return int(line.split()[1]) * 1024

limit = vm() + margin
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    torch.empty(nbytes, dtype=torch.uint8)
    print("UPFRONT-FITS")
except RuntimeError:
    print("UPFRONT-REFUSED")
{body}
"""

STREAM = """
state = m.restore(into=into)
assert state["w"] is target and into["step"] == 1, (type(state["w"]), into["step"])
print("STREAMED", float(target[:64].sum()), float(target[-64:].sum()), float(target.sum()))
print("SKIPPED", m.stats.last_restore.skipped)
"""

TOO_BIG = """
try:
    m.restore()
    print("NO-ERROR")
except CorruptCheckpointError as exc:
    print("CORRUPT", exc)
except CheckpointError as exc:
    print("REFUSED", exc)
"""


def _run(root: Path, body: str) -> str:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    script = CHILD.replace("{body}", textwrap.dedent(body))
    out = subprocess.run(
        [sys.executable, "-c", script, str(root), str(NBYTES), str(MARGIN)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_restore_into_streams_under_an_address_space_limit(tmp_path: Path) -> None:
    head = _sparse_step(tmp_path / "step-1", NBYTES)
    # step 2 claims a 64 GiB file that is 512 MiB on disk: refused before any allocation
    _sparse_step(tmp_path / "step-2", NBYTES, claim=64 << 30)
    out = _run(tmp_path, STREAM)
    assert "UPFRONT-REFUSED" in out  # the limit bites: the old whole-file buffer cannot exist
    want = f"STREAMED {float(head.sum())} {7.0 * 64} {float(head.sum()) + 7.0 * 64}"
    assert want in out, out
    assert "SKIPPED [(2, " in out and "size 536870912 != 68719476736 bytes" in out, out


def test_a_tensor_too_big_for_this_host_is_a_clear_error(tmp_path: Path) -> None:
    _sparse_step(tmp_path / "step-1", 8 << 30)  # a consistent 8 GiB sparse step
    out = _run(tmp_path, TOO_BIG)
    assert "REFUSED" in out and "cannot allocate entries[0] (8589934592 bytes" in out, out
