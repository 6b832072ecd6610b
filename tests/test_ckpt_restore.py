"""Restores, ``into=`` included: nothing is written into the caller's tensors before every checksum
passed and every shape matched, and a restore racing a re-save or a replaced file reads only
verified bytes."""

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


@pytest.mark.parametrize("mmap", [False, True])
def test_into_shape_mismatch_writes_nothing(tmp_path: Path, mmap: bool) -> None:
    """A shape mismatch anywhere in ``into`` is a CheckpointError naming it, raised before any
    tensor of ``into`` is written (it used to stream ``a`` in, then fail at ``b`` with a raw
    RuntimeError; a shape that broadcasts was silently broadcast)."""
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"a": torch.ones(4), "b": torch.ones(3), "c": torch.full((1,), 7.0)}).result()
        for bad in ({"b": torch.zeros(5)}, {"c": torch.zeros(3)}):
            into = {"a": torch.zeros(4), "b": torch.zeros(3), "c": torch.zeros(1), **bad}
            before = {k: v.clone() for k, v in into.items()}
            with pytest.raises(CheckpointError, match=r"shape"):
                m.restore(into=into, mmap=mmap)
            for k, v in into.items():
                assert torch.equal(v, before[k]), k


def test_into_module_shape_mismatch_writes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        m.save(1, {"model": src}).result()
        dst = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
        before = [p.detach().clone() for p in dst.parameters()]
        with pytest.raises(CheckpointError, match=r"shape"):
            m.restore(into={"model": dst})
        for p, b in zip(dst.parameters(), before, strict=True):
            assert torch.equal(p.detach(), b)


def test_into_list_length_mismatch_writes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"a": torch.ones(2), "l": [torch.ones(1), torch.ones(1)]}).result()
        into = {"a": torch.zeros(2), "l": [torch.zeros(1)]}
        with pytest.raises(CheckpointError, match=r"list"):
            m.restore(into=into)
        assert torch.equal(into["a"], torch.zeros(2))


@pytest.mark.parametrize(
    "into",
    [
        lambda: ({"a": torch.zeros(4)}, {"a": torch.zeros(4), "n": {}}),  # 5 into a dict
        lambda: (None, (torch.zeros(4),)),  # a tuple: apply_into refuses it
        lambda: ({"a": torch.zeros(4)}, {"a": torch.zeros(4), "l": [torch.zeros(1), {}]}),
    ],
)
def test_into_that_apply_into_refuses_writes_nothing(tmp_path: Path, into: Any) -> None:
    """``apply_into`` raised "cannot load ..." after the matching tensors had been streamed in."""
    _, target = into()
    with CheckpointManager(tmp_path, keep_last=None) as m:
        if isinstance(target, tuple):
            m.save(1, (torch.ones(4),)).result()
        else:
            m.save(1, {"a": torch.ones(4), "n": 5, "l": [torch.ones(1), 3]}).result()
        with pytest.raises(CheckpointError, match="cannot load"):
            m.restore(into=target)
        first = target["a"] if isinstance(target, dict) else target[0]
        assert torch.equal(first, torch.zeros(4))


def test_into_module_with_missing_keys_writes_nothing(tmp_path: Path) -> None:
    """Broke: torch's strict load_state_dict refused the module only after ckpt had streamed
    the matching parameters into it."""
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"model": torch.nn.Linear(3, 4)}).result()
        dst = torch.nn.Linear(3, 4, bias=False)  # the saved "bias" has nowhere to go
        before = dst.weight.detach().clone()
        with pytest.raises(CheckpointError):
            m.restore(into={"model": dst})
        assert torch.equal(dst.weight.detach(), before)


@pytest.mark.parametrize("bad", ["3", -1, 3.0, True, 2**60])
def test_restore_of_a_step_that_is_not_one_names_the_accepted_steps(
    tmp_path: Path, bad: object
) -> None:
    # "3" was a raw TypeError and -1 a missing path "step--1": the rule save applies
    with CheckpointManager(tmp_path / "ck") as m:
        m.save(3, {"w": torch.ones(1)}).result()
        for call in (m.restore, m.fetch):
            with pytest.raises(ValueError, match=r"must be an int from 0 to 2\*\*53 \(non-neg"):
                call(bad)  # type: ignore[arg-type]
        assert m.restore(3)["w"].tolist() == [1.0]
