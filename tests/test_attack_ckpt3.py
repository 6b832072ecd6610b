"""Adversarial review (3) of the cached copy plan, the background-pinned first buffer and the
restore into existing tensors: every test is an attack that failed (or must keep failing to
break) the promises of docs/ckpt-format.md: a restore is a complete verified checkpoint,
nothing is written into the caller's tensors before every checksum passed, the saved bytes are
the tensors' bytes at save time, padding zeroed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager, WriteOptions
from ckpt.restoring import reader


def _state(fill: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64, 257), fill + i) for i in range(8)}


def _two_steps(tmp_path: Path) -> tuple[CheckpointManager, Path, Path]:
    """Steps 1 and 2 of the same layout (same data-file size), other values."""
    m = CheckpointManager(tmp_path / "ck", write=WriteOptions(chunk_bytes=64 << 10))
    m.save(1, _state(1.0)).result()
    m.save(2, _state(100.0)).result()
    return m, tmp_path / "ck" / "step-1", tmp_path / "ck" / "step-2"


def _swap_after(
    monkeypatch: pytest.MonkeyPatch, name: str, old: Path, new: Path, fired: list[int]
) -> None:
    """After ``reader.<name>`` (or ``fmt.verify_file``) returns, replace ``old``'s data file by
    ``new``'s (a rename, as an overwriting writer would): same size, other bytes."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if not fired:
                fired.append(1)
                tmp = old / "data.bin.new"
                tmp.write_bytes((new / "data.bin").read_bytes())
                os.replace(tmp, old / "data.bin")
            return out

        return hooked

    monkeypatch.setattr(reader, name, wrap(getattr(reader, name)))
    monkeypatch.setattr(fmt, "verify_file", wrap(fmt.verify_file))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_file_replaced_between_the_verify_pass_and_the_copy_pass_writes_nothing_unverified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """restore(into=host tensors, or CUDA ones without device room) verifies first, then reads
    again: both passes must read the same file (it was half-written into the caller's tensors,
    then failed its checksum)."""
    monkeypatch.setattr(reader, "DEVICE_SCRATCH_SHARE", 0.0)  # CUDA: the two-pass path
    m, one, two = _two_steps(tmp_path)
    fired: list[int] = []
    _swap_after(monkeypatch, "_verify_files", one, two, fired)
    into = {k: torch.full_like(v, -7.0, device=device) for k, v in _state(0.0).items()}
    try:
        m.restore(1, into=into)
    except CheckpointError:  # refusing is fine, as long as nothing was written
        assert all(bool((v == -7.0).all()) for v in into.values())
    else:  # the bytes loaded are the bytes verified: step 1's
        assert all(torch.equal(into[k].cpu(), v) for k, v in _state(1.0).items())
        assert m.stats.last_restore is not None and m.stats.last_restore.passes == 2
    finally:
        m.close()
    assert fired


def test_mmap_restore_maps_the_file_it_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mmap=True verified the file by its path, then mapped the path again: a file replaced in
    between was returned unverified (step 2's values under step 1's manifest)."""
    m, one, two = _two_steps(tmp_path)
    fired: list[int] = []
    _swap_after(monkeypatch, "_verify_files", one, two, fired)
    try:
        got = m.restore(1, mmap=True)
    except CheckpointError:
        pass
    else:
        assert all(torch.equal(got[k], v) for k, v in _state(1.0).items())
    finally:
        m.close()
    assert fired


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


_PIN_CHILD = r"""
import os, signal, sys, torch
from ckpt.saving import pool
from ckpt.manager import CheckpointManager
m = CheckpointManager(sys.argv[1])
m.save(1, {"w": torch.ones(1000, device="cuda")}).result()
pin = pool.Pinning._pin
def killed(self, k, keep):
    pin(self, k, keep)
    if k == 2:  # pieces 0-2 registered, the rest still being faulted in
        os.kill(os.getpid(), signal.SIGKILL)
pool.Pinning._pin = killed
g = torch.Generator(device="cuda").manual_seed(0)
m.save(2, {"w": torch.randn(64 << 20, device="cuda", generator=g)}).result()
print("NOT KILLED")
"""


@pytest.mark.gpu
def test_gpu_sigkill_while_the_first_buffer_is_pinned_in_the_background_loses_nothing(
    tmp_path: Path,
) -> None:
    """A real process SIGKILLed while its first save of a larger state still faults in and
    registers its buffer (``ckpt.saving.pool.Pinning``): step 1 restores, no step 2 half-exists, and
    a new manager saves and restores step 2 (again through a buffer pinned in the background)."""
    import subprocess
    import sys

    directory = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", _PIN_CHILD, str(directory)],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    with CheckpointManager(directory) as m:
        assert m.steps() == [1]
        assert torch.equal(m.restore()["w"].cpu(), torch.ones(1000))
        g = torch.Generator(device="cuda").manual_seed(0)
        want = torch.randn(64 << 20, device="cuda", generator=g)
        m.save(2, {"w": want}).result()
        assert torch.equal(m.restore(2)["w"], want)
        assert sorted(p.name for p in directory.iterdir() if p.name.startswith("step-")) == [
            "step-1", "step-2",
        ]  # fmt: skip


def test_restore_into_conjugate_and_negative_views(tmp_path: Path) -> None:
    """``into`` holding ``t.conj()`` (a contiguous view whose bytes are not its values): the
    raw read refused it with torch's bare ``view`` error; it is loaded by value instead."""
    saved = {
        "c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "n": torch.tensor([1.0, -2.0, 3.0]),
    }
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(1, saved).result()
        base_c, base_n = torch.zeros(2, dtype=torch.complex64), torch.zeros(3)
        into = {"c": base_c.conj(), "n": torch._neg_view(base_n)}
        m.restore(1, into=into)
    assert torch.equal(into["c"].resolve_conj(), saved["c"])
    assert torch.equal(into["n"].resolve_neg(), saved["n"])
    assert torch.equal(base_c, saved["c"].conj()) and torch.equal(base_n, -saved["n"])


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
        m._stager = saveplan.Stager(gather_host=gather_host)  # the CUDA path's runs, on the CPU
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
        assert m._stager.planned == 1 and m._stager.reused == 2
        for step, want in enumerate(snapshots):
            got = m.restore(step)
            for k, v in want.items():
                g = got[k]
                assert np.array_equal(g, v) if isinstance(v, np.ndarray) else torch.equal(g, v), k
        got = m.restore(2)
        assert got["vb"].untyped_storage().data_ptr() == got["va"].untyped_storage().data_ptr()


@pytest.mark.parametrize("mmap", [False, True])
def test_a_resave_of_the_step_during_its_restore_loads_the_verified_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mmap: bool
) -> None:
    """The real writer of the attack above: another manager re-saves ``step-1`` (its commit
    swaps the directories) while a reader restores it, between the verify pass and the copy
    pass (or the mapping). The reader returns the copy it verified, whole."""
    directory = tmp_path / "ck"
    with CheckpointManager(directory) as first:
        first.save(1, _state(1.0)).result()
    mgr = CheckpointManager(directory)
    writer = CheckpointManager(directory)
    verify = reader._verify_files
    fired: list[int] = []

    def resave_after(*args: Any, **kwargs: Any) -> None:
        verify(*args, **kwargs)
        if not fired:
            fired.append(1)
            writer.save(1, _state(100.0)).result()

    monkeypatch.setattr(reader, "_verify_files", resave_after)
    into = {k: torch.full_like(v, -7.0) for k, v in _state(0.0).items()}
    try:
        if mmap:
            got = mgr.restore(1, mmap=True)
        else:
            got = mgr.restore(1, into=into)
            assert all(torch.equal(into[k], v) for k, v in _state(1.0).items())
        assert all(torch.equal(got[k], v) for k, v in _state(1.0).items())
        assert fired
        assert torch.equal(mgr.restore(1)["w0"], _state(100.0)["w0"])  # the new copy now
    finally:
        writer.close()
        mgr.close()


def test_a_resave_between_reading_the_manifest_and_opening_the_data_is_no_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another manager re-saves ``step-1`` right after a reader read its manifest: the reader
    opened the new directory's data file under the old manifest and reported the step corrupt
    (a ``restore()`` then falls back to an older step). It reads the step again instead."""
    directory = tmp_path / "ck"
    with CheckpointManager(directory) as first:
        first.save(1, _state(1.0)).result()
    mgr = CheckpointManager(directory)
    writer = CheckpointManager(directory)
    read_manifest = fmt.read_manifest
    fired: list[int] = []

    def resave_after(*args: Any, **kwargs: Any) -> dict:
        body = read_manifest(*args, **kwargs)
        if not fired:
            fired.append(1)
            writer.save(1, _state(100.0)).result()
        return body

    monkeypatch.setattr(fmt, "read_manifest", resave_after)
    try:
        got = mgr.restore(1)
        assert fired
        assert all(torch.equal(got[k], v) for k, v in _state(100.0).items())
    finally:
        writer.close()
        mgr.close()


_FILES_CHILD = r"""
import resource, sys
from pathlib import Path
import torch
from ckpt import format as fmt
from ckpt.restoring.reader import read_checkpoint
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from feedpipe.io import crc32c, to_hex
root = Path(sys.argv[1])
with CheckpointManager(root) as m:
    m.save(1, {"w": torch.ones(10)}).result()
step = root / "step-1"
body = fmt.read_manifest(step)
for k in range(200):  # a hostile manifest: valid checksums, 200 more (tiny) data files
    (step / f"x{k}.bin").write_bytes(b"x")
    body["files"].append({"name": f"x{k}.bin", "size": 1, "chunk_bytes": 1,
                          "crc32c": [to_hex(crc32c(b"x"))]})
fmt.write_manifest(step, body)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    read_checkpoint(step)
except CheckpointError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.slow  # a child process (about 10 s of imports on a loaded machine)
def test_a_manifest_of_more_data_files_than_may_be_open_is_a_clear_error(tmp_path: Path) -> None:
    """A restore holds every data file of the step open (for its passes): a hostile manifest
    listing more files than the process may open is a ``CheckpointError`` naming the step,
    not a bare ``OSError`` (EMFILE)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FILES_CHILD, str(tmp_path / "ck")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout and "cannot hold its 201 data files open" in proc.stdout
