"""The staging plan cached across saves (``ckpt.saving.plan.Stager``), the first save's pool,
and the
restore's two passes (issue 18, section 3).

A plan is reused only for leaves of the same signature, and the bytes it stages are always the
bytes of the tensors as they are now: every test compares the staged buffer with a fresh
per-leaf copy (``ckpt.format.stage``) of the same leaves. ``gather_host=True`` runs the CUDA
path's runs (storage resized per save, views gathered by dtype) on host tensors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt import format as fmt
from ckpt.manager import CheckpointManager, PoolOptions
from ckpt.restoring import reader
from ckpt.saving import plan as saveplan
from ckpt.saving import pool
from ckpt.saving.flatten import flatten
from ckpt.saving.pool import Buffer


def _leaves(state: Any) -> list:
    leaves: list = []
    flatten(state, leaves)
    return leaves


def _want(leaves: list, layout_of: list | None = None) -> torch.Tensor:
    """The reference: a fresh layout (of ``layout_of``, default ``leaves``: CUDA leaves go
    first), one copy per leaf into a zeroed buffer."""
    entries, nbytes = saveplan.layout(leaves if layout_of is None else layout_of)
    buf = Buffer(nbytes, False)
    buf.tensor.zero_()
    fmt.stage(leaves, entries, buf)
    return buf.tensor


def _staged(stager: saveplan.Stager, state: Any, buf: Buffer | None = None) -> torch.Tensor:
    leaves = _leaves(state)
    plan = stager.plan(leaves)
    if buf is None or buf.nbytes < plan.nbytes:
        buf = Buffer(plan.nbytes, False)
    buf.tensor.fill_(0xAB)  # stale bytes: padding must come out zero
    plan.stage(leaves, buf)
    got = buf.tensor[: plan.nbytes]
    assert torch.equal(got, _want(leaves))
    return got


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {f"w{i}": torch.randn(7 + i, generator=g) for i in range(40)}
    state["half"] = torch.randn(5, 3, generator=g).half()
    state["flag"] = torch.tensor([True, False, True])
    state["scalar"] = torch.tensor(3.0)
    state["arr"] = np.arange(6, dtype=np.int16)
    state["empty"] = torch.empty(0)
    return state


MUTATIONS: dict[str, Callable[[dict], bool]] = {}
"""name -> mutate the state in place; returns whether the signature changes (a new plan)."""


def _mutation(fn: Callable[[dict], bool]) -> Callable[[dict], bool]:
    MUTATIONS[fn.__name__] = fn
    return fn


@_mutation
def values_change(s: dict) -> bool:
    for v in s.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v.add_(1)
    return False


@_mutation
def tensor_swapped(s: dict) -> bool:
    s["w3"] = torch.full_like(s["w3"], 9.0)  # another object, same metadata
    return False


@_mutation
def optimizer_state_recreated(s: dict) -> bool:
    for k in list(s):
        if isinstance(s[k], torch.Tensor):
            s[k] = s[k].clone()  # every object new (e.g. load_state_dict)
            if s[k].is_floating_point():
                s[k].add_(1)
    return False


@_mutation
def storage_replaced(s: dict) -> bool:
    other = torch.full((12,), 4.0, device=s["w5"].device)
    s["w5"].set_(other.untyped_storage(), 0, (12,), (1,))  # same shape
    return False


@_mutation
def shape_change(s: dict) -> bool:
    s["w0"] = torch.randn(8, 1)
    return True


@_mutation
def resized_in_place(s: dict) -> bool:
    s["w1"].resize_(30)
    s["w1"].fill_(2.0)
    return True


@_mutation
def dtype_change(s: dict) -> bool:
    s["w2"] = s["w2"].double()
    return True


@_mutation
def same_bytes_other_dtype(s: dict) -> bool:
    s["w4"] = s["w4"].view(torch.int32)  # same shape and bytes, another dtype
    return True


@_mutation
def non_contiguous_view(s: dict) -> bool:
    s["half"] = s["half"].t()  # (3, 5) strided: copied in logical order
    return True


@_mutation
def strided_same_shape(s: dict) -> bool:
    s["w9"] = torch.arange(32.0, device=s["w9"].device)[::2]  # shape (16,) like w9, stride 2
    return True


@_mutation
def channels_last(s: dict) -> bool:
    s["img"] = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    return True


@_mutation
def aliasing(s: dict) -> bool:
    s["tied"] = s["w6"]  # tied weights: one shared entry
    s["tied_view"] = s["w6"][2:5]
    return True


@_mutation
def leaf_added(s: dict) -> bool:
    s["new"] = torch.ones(4)
    return True


@_mutation
def key_order_change(s: dict) -> bool:
    w = s.pop("w0")
    s["w0"] = w  # same tensors, another order: the layout moves
    return True


@_mutation
def array_change(s: dict) -> bool:
    s["arr"] = np.arange(6, dtype=np.int32)
    return True


@pytest.mark.parametrize("gather_host", [False, True])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_plan_is_reused_only_for_the_same_signature(name: str, gather_host: bool) -> None:
    state = _state()
    stager = saveplan.Stager(gather_host=gather_host)
    _staged(stager, state)
    _staged(stager, state)
    assert (stager.planned, stager.reused) == (1, 1)
    new_plan = MUTATIONS[name](state)
    _staged(stager, state)  # asserts the bytes against a fresh copy
    assert stager.planned == 1 + new_plan
    _staged(stager, state)  # and the new plan is reused in turn
    assert stager.reused == 2 + (not new_plan)


def test_a_plan_holds_no_reference_to_the_callers_tensors() -> None:
    import gc
    import weakref

    state = _state()
    stager = saveplan.Stager(gather_host=True)
    _staged(stager, state)
    refs = [weakref.ref(v) for v in state.values() if isinstance(v, torch.Tensor)]
    del state
    gc.collect()
    assert all(r() is None for r in refs)


def test_buffer_views_die_with_their_buffer() -> None:
    import gc
    import weakref

    state = _state()
    stager = saveplan.Stager()
    leaves = _leaves(state)
    plan = stager.plan(leaves)
    buf = Buffer(plan.nbytes, False)
    plan.stage(leaves, buf)
    storage = weakref.ref(buf)
    del buf
    gc.collect()
    assert storage() is None
    assert len(plan._host_views) == 0


def test_cuda_leaves_are_laid_out_first() -> None:
    """A device's leaves are consecutive in the file, so host leaves between them (AdamW's CPU
    ``step`` scalars) do not cut the device's runs into pieces."""

    class L:
        def __init__(self, device: str, nbytes: int) -> None:
            self.device, self.nbytes = device, nbytes
            self.kind, self.dtype, self.shape = "tensor", "float32", [nbytes // 4]

    leaves = [L("cuda:0", 40), L("cpu", 4), L("cuda:1", 8), L("cuda:0", 64), L("cpu", 4)]
    entries, nbytes = saveplan.layout(leaves)  # type: ignore[arg-type]
    offs = [e["offset"] for e in entries]
    assert offs[0] < offs[3] < offs[2] < offs[1] < offs[4]
    assert [e["nbytes"] for e in entries] == [40, 4, 8, 64, 4]
    assert nbytes == offs[4] + 4


def test_second_save_stages_without_per_tensor_python(tmp_path: Path) -> None:
    """A steady save of 2,000 tensors makes a handful of tensor-method calls from Python while
    staging (one ``_foreach_copy_``), not one or more per tensor."""
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(2000)}
    counted = {"view", "copy_", "as_strided", "is_contiguous", "contiguous"}
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "c_call" and getattr(arg, "__name__", "") in counted:
            calls += 1

    with CheckpointManager(tmp_path, keep_last=1, pool=PoolOptions(buffers=1)) as m:
        m.save(0, state).result()
        m.save(1, state).result()
        for t in state.values():
            t.add_(1)
        sys.setprofile(profile)
        try:
            handle = m.save(2, state)
        finally:
            sys.setprofile(None)
        handle.result()
        got = m.restore(2)
    assert calls < 20, calls
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_manager_saves_survive_signature_changes(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for step, name in enumerate(sorted(MUTATIONS)):
            MUTATIONS[name](state)
            m.save(step, state).result()
            got = m.restore(step)
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(got[k], v), (name, k)
                    assert got[k].shape == v.shape and got[k].dtype == v.dtype
                else:
                    assert np.array_equal(got[k], v)


def test_stage_failing_midway_leaves_the_manager_usable(tmp_path: Path) -> None:
    class Bad:
        def state_dict(self) -> dict:
            raise RuntimeError("boom")

    state = _state()
    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.save(0, state).result()
        with pytest.raises(RuntimeError, match="boom"):
            m.save(1, {**state, "bad": Bad()})
        m.save(2, state).result()
        assert torch.equal(m.restore(2)["w0"], state["w0"])


# ---- CUDA paths ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_gpu_a_plan_is_reused_only_for_the_same_signature(name: str) -> None:
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _state().items()}
    state["cpu_step"] = torch.tensor(5.0)  # a host leaf among device ones
    state["big"] = torch.randn(3 << 20, device="cuda")  # beyond SMALL_BYTES: a direct copy
    stager = saveplan.Stager()

    def staged() -> None:
        leaves = _leaves(state)
        plan = stager.plan(leaves)
        buf = Buffer(plan.nbytes, True)
        buf.tensor.fill_(0xAB)
        plan.stage(leaves, buf)
        cpu = [_leaf_on_cpu(leaf) for leaf in leaves]
        assert torch.equal(buf.tensor[: plan.nbytes], _want(cpu, layout_of=leaves))

    staged()
    staged()
    new_plan = MUTATIONS[name](state)
    for k, v in list(state.items()):
        if isinstance(v, torch.Tensor) and not v.is_cuda and k != "cpu_step":
            state[k] = v.cuda()
    staged()
    assert (stager.planned, stager.reused) == (1 + new_plan, 1 + (not new_plan))


def _leaf_on_cpu(leaf: Any) -> Any:
    import dataclasses

    value = leaf.value.cpu() if isinstance(leaf.value, torch.Tensor) else leaf.value
    return dataclasses.replace(leaf, value=value, device="cpu")


@pytest.mark.gpu
def test_gpu_plan_holds_no_device_memory_between_saves(tmp_path: Path) -> None:
    state = {f"p{i}": torch.randn(1000 + i, device="cuda") for i in range(3000)}
    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.save(0, state).result()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        m.save(1, state).result()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        plan = m._saves.stager.plan(_leaves(state))
        assert m._saves.stager.reused >= 2
        runs = [s for _, s in plan.device_steps if isinstance(s, saveplan._Run)]
        nbytes = sum(v.numel() * 4 for v in state.values())
        assert len(runs) <= nbytes // saveplan.RUN_BYTES + 1
        assert torch.equal(m.restore(1)["p7"], state["p7"])


@pytest.mark.gpu
def test_gpu_adamw_state_round_trips_with_its_cpu_steps(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(50)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    state = {"model": model, "optim": opt}
    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.save(0, state).result()
        opt.step()
        m.save(1, state).result()
        got = m.restore(1)
    assert m._saves.stager.reused == 1
    for k, v in model.state_dict().items():
        assert torch.equal(got["model"][k], v)
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][i][k].cpu(), v.cpu())


def test_plan_overhead_benchmark_runs(capsys: pytest.CaptureFixture) -> None:
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "ckpt_save.py"
    bench = runpy.run_path(str(script), run_name="ckpt_save_bench")
    assert bench["main"](["--plan-overhead", "40"]) == 0
    out = capsys.readouterr().out
    assert "signature check only" in out and "per-tensor staging, earlier versions" in out


# ---- restore(into=): the verify pass, and reading once through device memory -----------------


def _saved_state(tmp_path: Path, device: str = "cpu") -> tuple[CheckpointManager, dict, Path]:
    from ckpt.manager import WriteOptions

    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(300_000 + i, generator=g).to(device) for i in range(4)}
    m = CheckpointManager(tmp_path, keep_last=None, write=WriteOptions(chunk_bytes=2 << 20))
    return m, state, m.save(1, state).result()


def test_the_verify_pass_reads_small_pieces_on_every_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """restore(into=) of host tensors verifies first: pieces of VERIFY_BYTES (the checksum reads
    them from the cache), on ``verify_threads()`` threads; then reads again, into the tensors."""
    import os
    import threading

    from ckpt.restoring import read_into

    m, state, _ = _saved_state(tmp_path)
    sizes: dict[str, list[int]] = {}
    verifiers: set[str] = set()
    real = os.preadv

    def preadv(fd: int, buffers: list, pos: int) -> int:
        name = threading.current_thread().name.split("_")[0]
        sizes.setdefault(name, []).append(len(buffers[0]))
        if name == "ckpt-verify":
            verifiers.add(threading.current_thread().name)
        return real(fd, buffers, pos)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(reader, "verify_threads", lambda: 3)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    m.restore(1, into=into)
    m.close()
    assert all(torch.equal(into[k], v) for k, v in state.items())
    assert m.stats.last_restore is not None and m.stats.last_restore.passes == 2
    assert max(sizes["ckpt-verify"]) <= read_into.VERIFY_BYTES < read_into.READ_BYTES
    assert max(sizes["ckpt-read"]) > read_into.VERIFY_BYTES
    assert 1 <= len(verifiers) <= 3  # the verify pass's own threads


def test_restore_into_host_tensors_corrupt_writes_nothing(tmp_path: Path) -> None:
    from ckpt.errors import CorruptCheckpointError

    m, state, path = _saved_state(tmp_path)
    raw = bytearray((path / "data.bin").read_bytes())
    raw[-5] ^= 0xFF
    (path / "data.bin").write_bytes(bytes(raw))
    into = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError):
        m.restore(1, into=into)
    m.close()
    assert all(bool((v == 7.0).all()) for v in into.values())


@pytest.mark.gpu
def test_gpu_restore_into_cuda_reads_once_and_is_bitwise(tmp_path: Path) -> None:
    m, state, _ = _saved_state(tmp_path, "cuda")
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    got = m.restore(1, into=into)
    m.close()
    stats = m.stats.last_restore
    assert stats is not None and stats.passes == 1
    assert all(torch.equal(into[k], v) for k, v in state.items())
    assert {k: v.data_ptr() for k, v in into.items()} == ptrs and got["w0"] is into["w0"]


@pytest.mark.gpu
def test_gpu_restore_into_cuda_without_room_verifies_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.errors import CorruptCheckpointError

    monkeypatch.setattr(reader, "DEVICE_SCRATCH_SHARE", 0.0)
    m, state, path = _saved_state(tmp_path, "cuda")
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    m.restore(1, into=into)
    assert m.stats.last_restore is not None and m.stats.last_restore.passes == 2
    assert all(torch.equal(into[k], v) for k, v in state.items())
    raw = bytearray((path / "data.bin").read_bytes())
    raw[-5] ^= 0xFF
    (path / "data.bin").write_bytes(bytes(raw))
    into = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError):
        m.restore(1, into=into)
    m.close()
    assert all(bool((v == 7.0).all()) for v in into.values())


@pytest.mark.gpu
def test_gpu_restore_into_cuda_corrupt_in_one_pass_writes_nothing(tmp_path: Path) -> None:
    from ckpt.errors import CorruptCheckpointError

    m, state, path = _saved_state(tmp_path, "cuda")
    raw = bytearray((path / "data.bin").read_bytes())
    raw[10] ^= 0xFF  # the first chunk: the read of later chunks is in flight
    (path / "data.bin").write_bytes(bytes(raw))
    into = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError):
        m.restore(1, into=into)
    m.close()
    torch.cuda.synchronize()
    assert all(bool((v == 7.0).all()) for v in into.values())


# ---- the first save: a buffer registered in pieces while the save copies into it -------------


def _slow_register(
    delay: float, fail: int | None = None, gate: Any = None
) -> tuple[Callable, list]:
    """A registration that takes ``delay`` s, fails at call ``fail`` and, with ``gate`` (an
    event), waits for it first: no piece is ready before the test says so."""
    import time

    done: list[int] = []

    def register(ptr: int, size: int) -> int:
        if gate is not None:
            assert gate.wait(120), "the test never opened the gate"  # a deadlock guard
        time.sleep(delay)
        done.append(ptr)
        return 999 if fail is not None and len(done) == fail else 0

    return register, done


def _big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    state = {f"s{i}": torch.randn(3000 + i, generator=g) for i in range(300)}  # runs
    state.update({f"b{i}": torch.randn(600_000, generator=g) for i in range(4)})  # over pieces
    return state


@pytest.mark.parametrize("gather_host", [False, True])
def test_copies_wait_for_their_piece_of_a_buffer_made_in_the_background(
    monkeypatch: pytest.MonkeyPatch, gather_host: bool
) -> None:
    """The pieces are faulted in (zeroed) and registered slowly, one after another; a copy
    made before its piece was zeroed would be wiped, and one across two pieces would span two
    registrations. No piece is registered until the gate opens, shortly after the save starts
    (so its first copy waits, whatever the machine's load; the test asserts no timing)."""
    import threading

    monkeypatch.setattr(pool, "REGISTER_BYTES", 1 << 20)
    monkeypatch.setattr(pool, "_threads", lambda: 2)
    gate = threading.Event()
    register, done = _slow_register(0.02, gate=gate)
    state = _big_state()
    leaves = _leaves(state)
    plan = saveplan.Stager(gather_host=gather_host).plan(leaves)
    buf = Buffer(plan.nbytes, True, background=True, register=register)
    assert buf.pieces == 1 << 20 and not done  # still pinning: the gate is shut
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    plan.stage(leaves, buf)
    opener.join()
    assert torch.equal(buf.tensor[: plan.nbytes], _want(leaves))
    assert len(done) == -(-buf.nbytes // (1 << 20))


def test_a_piece_that_cannot_be_registered_stays_pageable_and_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    monkeypatch.setattr(pool, "REGISTER_BYTES", 1 << 20)
    register, _ = _slow_register(0.0, fail=2)
    state = _big_state()
    leaves = _leaves(state)
    plan = saveplan.Stager(gather_host=True).plan(leaves)
    buf = Buffer(plan.nbytes, True, background=True, register=register)
    with caplog.at_level("WARNING", logger="ckpt"):
        plan.stage(leaves, buf)
    assert torch.equal(buf.tensor[: plan.nbytes], _want(leaves))
    assert "failed with CUresult 999" in caplog.text and "pageable" in caplog.text


def test_a_stuck_piece_times_out_naming_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ckpt.errors import CheckpointError

    monkeypatch.setattr(pool, "REGISTER_BYTES", 1 << 20)
    release = threading.Event()

    def stuck(ptr: int, size: int) -> int:
        release.wait(10)
        return 0

    buf = Buffer(4 << 20, True, background=True, register=stuck)
    try:
        assert buf._pinning is not None
        with pytest.raises(CheckpointError, match="were not faulted in and registered"):
            buf._pinning.wait(0, 10, timeout=0.05)
    finally:
        release.set()
    buf.wait_all()


@pytest.mark.gpu
def test_gpu_first_save_without_reserve_pins_in_the_background(tmp_path: Path) -> None:
    state = {f"p{i}": torch.randn(200_000 + i, device="cuda") for i in range(500)}  # ~400 MB
    state["big"] = torch.randn(20 << 20, device="cuda")
    with CheckpointManager(tmp_path, keep_last=1, pool=PoolOptions(buffers=1)) as m:
        h = m.save(0, state)
        h.result()
        buf = m.pool._free[0]
        assert buf.pieces is not None and buf._pinning is None  # made in pieces, all done
        assert buf.tensor.is_pinned()
        assert m.pool.allocated_bytes == buf.nbytes
        for t in state.values():
            t.add_(1)
        m.save(1, state).result()
        assert m.pool.allocated_bytes == buf.nbytes  # reused
        got = m.restore(1)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_saves_from_two_threads_share_one_plan_safely(tmp_path: Path) -> None:
    """The runs' storages belong to the plan: concurrent stagings take turns."""
    import threading

    state = _big_state()
    leaves = _leaves(state)
    plan = saveplan.Stager(gather_host=True).plan(leaves)
    bufs = [Buffer(plan.nbytes, False) for _ in range(2)]
    want = _want(leaves)
    errors: list[BaseException] = []

    def loop(buf: Buffer) -> None:
        try:
            for _ in range(5):
                plan.stage(leaves, buf)
                assert torch.equal(buf.tensor[: plan.nbytes], want)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(b,)) for b in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)


@pytest.mark.gpu
def test_gpu_every_dtype_in_runs_and_restored_into_in_one_pass(tmp_path: Path) -> None:
    """Dtypes outside ``BATCHED_DTYPES`` (float8, float4, complex32, uint16...) are copied one
    by one inside their run, and into the caller's tensors one by one after a restore."""
    from ckpt.saving.flatten import TORCH_DTYPES

    g = torch.Generator().manual_seed(3)
    state = {}
    for k, name in enumerate(TORCH_DTYPES):
        raw = torch.randint(0, 255, (64 * (k + 1),), dtype=torch.uint8, generator=g)
        if name == "bool":
            raw &= 1
        state[name] = raw.view(getattr(torch, name)).cuda()
    into = {k: torch.empty_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.save(0, state).result()
        m.save(1, state).result()
        assert m._saves.stager.reused == 1
        m.restore(1, into=into)
        assert m.stats.last_restore is not None and m.stats.last_restore.passes == 1
    for k, v in state.items():
        assert torch.equal(into[k].view(torch.uint8), v.view(torch.uint8)), k


def test_model_and_a_recreated_optimizer_reuse_the_plan(tmp_path: Path) -> None:
    """The torch idiom: ``opt.load_state_dict`` between saves makes every optimizer tensor a
    new object; same signature, so the plan is reused, and the bytes are the new tensors'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()

    step()
    state = {"model": model, "optim": opt}
    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.save(0, state).result()
        opt.load_state_dict(opt.state_dict())  # new tensors
        step()
        m.save(1, state).result()
        assert (m._saves.stager.planned, m._saves.stager.reused) == (1, 1)
        got = m.restore(1)
    for k, v in model.state_dict().items():
        assert torch.equal(got["model"][k], v)
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][i][k], v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision_nan_payloads_survive_save_and_restore(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """``_foreach_copy_``'s CUDA kernel computes half floats in float32, which canonicalises
    NaNs; every bit pattern (NaN payloads, negative NaNs, subnormals) must come back exactly,
    through the gathered save and the one-pass restore into existing tensors."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    state = {f"t{i}": bits[i * 4096 : (i + 1) * 4096].view(dtype).cuda() for i in range(16)}
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.save(0, state).result()
        m.save(1, state).result()  # the reused plan's path
        m.restore(1, into=into)
        fresh = m.restore(1)
    for k, v in state.items():
        assert torch.equal(into[k].view(torch.int16), v.view(torch.int16)), k
        assert torch.equal(fresh[k].cpu().view(torch.int16), v.cpu().view(torch.int16)), k
