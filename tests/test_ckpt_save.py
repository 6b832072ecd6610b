"""Saves: the saved bytes are the tensors' bytes at save time (padding zeroed), staging buffers
that cannot be allocated are clear errors, and ``ckpt.save(path)`` never deletes a path that is
not a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import small_state as _state

import ckpt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager


@pytest.mark.parametrize("gather_host", [False, True])
def test_padding_stays_zero_when_two_plans_take_turns_on_one_buffer(gather_host: bool) -> None:
    """Two saves at once (two threads, one manager) hold two plans; a buffer written by one
    then staged by the other again kept the first one's bytes in its padding (a plan zeroed the
    padding once per buffer, assuming no other plan wrote there since)."""
    from ckpt.saving import plan as saveplan
    from ckpt.saving.flatten import flatten
    from ckpt.saving.pool import Buffer

    def leaves(state: dict) -> list:
        out: list = []
        flatten(state, out)
        return out

    odd = leaves({"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.int8)})
    full = leaves({"a": torch.full((130,), 0x5A, dtype=torch.uint8)})
    stager = saveplan.Stager(gather_host=gather_host)
    first = stager.plan(odd)
    buf = Buffer(256, False)
    first.stage(odd, buf)
    stager.plan(full).stage(full, buf)  # the other save, into the same buffer
    first.stage(odd, buf)  # the first thread's next save, with the plan it holds
    entries, nbytes = saveplan.layout(odd)
    want = torch.zeros(nbytes, dtype=torch.uint8)
    for e in entries:
        want[e["offset"] : e["offset"] + e["nbytes"]] = 1
    assert torch.equal(buf.tensor[:nbytes], want)


_ALLOC_CHILD = r"""
import re, resource, sys, torch
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
m = CheckpointManager(sys.argv[1])
m.save(1, {"a": torch.ones(1000)}).result()
state = {"a": torch.ones(16 << 20)}  # 64 MiB: a new, larger staging buffer
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
vm = int(re.search(r"VmSize:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))
try:
    m.save(2, state).result()
except CheckpointError as exc:
    print("REFUSED", exc)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
m.save(3, state).result()
assert torch.equal(m.restore(3)["a"], state["a"]) and m.steps() == [1, 3], m.steps()
print("OK")
m.close()
"""


def test_a_staging_buffer_that_cannot_be_allocated_is_a_clear_error_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """A real out-of-memory (RLIMIT_AS in a child process) while the first save of a larger
    state allocates its buffer: a ``CheckpointError`` naming the buffer (it was torch's bare
    allocator message), no step written, the manager saves again once memory is back."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _ALLOC_CHILD, str(tmp_path / "ck")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout and "staging buffer of 67108864 bytes" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("gather_host", [False, True])
def test_mutating_every_tensor_right_after_save_returns_changes_no_step(
    tmp_path: Path, gather_host: bool
) -> None:
    """A careless loop: ``save`` then at once an in-place update of every leaf (views of one
    storage, 0-dim, empty, non-contiguous, channels_last, numpy), three saves on one plan."""
    import numpy as np

    from ckpt.saving import plan as saveplan

    base = torch.arange(64, dtype=torch.float32)
    state: dict[str, Any] = {
        "va": base[2:10],
        "vb": base[6:30].view(4, 6),
        "s": torch.tensor(3, dtype=torch.int16),
        "e": torch.zeros(0, 5),
        "t": torch.randn(6, 5).t(),
        "cl": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "h": torch.randn(33).half(),
        "np": np.arange(12.0).reshape(3, 4)[:, ::2],
    }
    snapshots = []
    with CheckpointManager(tmp_path / "ck") as m:
        m._saves.stager = saveplan.Stager(
            gather_host=gather_host
        )  # the CUDA path's runs, on the CPU
        for step in range(3):
            snapshots.append(
                {
                    k: v.clone() if isinstance(v, torch.Tensor) else v.copy()
                    for k, v in state.items()
                }
            )
            handle = m.save(step, state)
            for v in state.values():
                v[...] = v * 2 + 1 if v.dtype != torch.int16 else v + 1
            handle.result()
        assert m._saves.stager.planned == 1 and m._saves.stager.reused == 2
        for step, want in enumerate(snapshots):
            got = m.restore(step)
            for k, v in want.items():
                g = got[k]
                assert np.array_equal(g, v) if isinstance(v, np.ndarray) else torch.equal(g, v), k
        got = m.restore(2)
        assert got["vb"].untyped_storage().data_ptr() == got["va"].untyped_storage().data_ptr()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_save_never_deletes_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    """``ckpt.save("outputs", state)`` over a user's directory refuses; the files stay."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "results.csv").write_text("precious\n")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ckpt.save(outputs, _state(1))
    assert (outputs / "results.csv").read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_save_never_deletes_a_file(tmp_path: Path) -> None:
    """``ckpt.save(path)`` where ``path`` is a regular file refuses; the file stays."""
    victim = tmp_path / "model.pt"
    victim.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ckpt.save(victim, _state(1))
    assert victim.read_bytes() == b"precious"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_save_into_an_empty_directory_and_over_a_checkpoint(tmp_path: Path) -> None:
    """An empty directory and an existing checkpoint are replaced (trailing slash, relative)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    ckpt.save(str(empty) + "/", _state(1))
    assert ckpt.load(empty)["step"] == 1
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ckpt.save("empty/", _state(2))
        assert ckpt.load("empty")["step"] == 2
    finally:
        os.chdir(cwd)
