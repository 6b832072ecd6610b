"""Batched staging (``ckpt.saving.plan``), parallel verified reads
(``ckpt.restoring.read_into``) and the parallel-registered pinned pool
(``ckpt.saving.pool.pinned_empty``): bitwise round trips of states of
thousands of mixed tensors, and no write into the caller's tensors when a chunk is corrupt.
The CUDA paths are ``gpu`` tests (they run on a machine with a GPU)."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt import format as fmt
from ckpt.errors import CorruptCheckpointError
from ckpt.manager import CheckpointManager, WriteOptions
from ckpt.restoring import read_into as read_into_mod
from ckpt.restoring.read_into import read_into

DTYPES = [
    torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.float16, torch.uint8,
    torch.complex64, torch.float8_e4m3fn, torch.int8, torch.float64,
]  # fmt: skip


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` in logical order (bitwise: NaNs and -0.0 compare by their bits)."""
    t = t.detach().cpu().contiguous()
    flat = torch.as_strided(t, (t.numel(),), (1,))  # contiguous bytes, whatever size-1 strides
    return flat.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor(k: int, device: str) -> torch.Tensor:
    """Tensor ``k`` of a mixed state: dtypes, sizes, 0-dim, empty, non-contiguous."""
    dtype = DTYPES[k % len(DTYPES)]
    n = (k * 37) % 300 + 1
    g = torch.Generator().manual_seed(k)
    base = torch.randint(0, 255, (n * 4,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        base &= 1  # a bool byte is 0 or 1 (torch normalises other bytes on copy)
    t = base[: n * 4 // dtype.itemsize * dtype.itemsize].view(dtype)
    kind = k % 7
    if kind == 1:
        t = t[:1].reshape(())  # 0-dim
    elif kind == 2:
        t = t[:0]  # empty
    elif kind == 3 and t.numel() >= 4:
        t = t[: t.numel() // 2 * 2].reshape(2, -1).t()  # non-contiguous (transposed)
    elif kind == 4:
        t = t[::3]  # strided
    return t.to(device)


def _state(n: int, device: str) -> dict[str, Any]:
    state: dict[str, Any] = {f"t{k}": _tensor(k, device) for k in range(n)}
    shared = torch.arange(4096, dtype=torch.float32, device=device)
    state["tied_a"], state["tied_b"] = shared, shared.view(64, 64)[::2]  # one storage
    state["cpu_between"] = torch.arange(5, dtype=torch.int16)
    state["array"] = np.arange(7, dtype=np.float64)
    return state


def _assert_same(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert _raw(got[key]) == _raw(value), key
        else:
            np.testing.assert_array_equal(got[key], value)


def test_3000_mixed_tensors_round_trip_bitwise(tmp_path: Path) -> None:
    state = _state(3000, "cpu")
    with CheckpointManager(tmp_path, write=WriteOptions(chunk_bytes=64 << 10)) as m:
        m.save(1, state).result()
        got = m.restore(1)
    _assert_same(got, state)
    assert got["tied_b"].untyped_storage().data_ptr() == got["tied_a"].untyped_storage().data_ptr()


def _saved(tmp_path: Path, chunk: int = 64 << 10) -> tuple[CheckpointManager, dict, Path]:
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(50_000 + i, generator=g) for i in range(6)}
    state["b"] = torch.randint(0, 2, (999,), generator=g).bool()
    m = CheckpointManager(tmp_path, keep_last=None, write=WriteOptions(chunk_bytes=chunk))
    path = m.save(3, state).result()
    return m, state, path


def test_restore_into_existing_tensors_with_parallel_reads_is_bitwise(tmp_path: Path) -> None:
    m, state, _ = _saved(tmp_path)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    got = m.restore(3, into=into)
    m.close()
    _assert_same(into, state)
    assert {k: v.data_ptr() for k, v in into.items()} == ptrs  # filled in place
    assert all(got[k] is into[k] for k in into)


def _corrupt(path: Path, where: str) -> None:
    data = path / "data.bin"
    raw = bytearray(data.read_bytes())
    pos = {"first": 10, "last": len(raw) - 10}[where]
    raw[pos] ^= 0xFF
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("where", "chunk"), [("first", 64 << 10), ("last", 64 << 10), ("last", 2 << 10)]
)
def test_a_corrupt_chunk_writes_nothing_into_the_callers_tensors(
    tmp_path: Path, where: str, chunk: int
) -> None:
    """Also with hundreds of chunks (more than ``WINDOW`` in flight at once)."""
    m, state, path = _saved(tmp_path, chunk)
    _corrupt(path, where)
    into = {
        k: torch.full_like(v, 7) if v.dtype != torch.bool else v.clone() for k, v in state.items()
    }
    before = {k: _raw(v) for k, v in into.items()}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in chunk"):
        m.restore(3, into=into)
    m.close()
    assert {k: _raw(v) for k, v in into.items()} == before


def test_reads_run_on_several_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _, path = _saved(tmp_path, chunk=16 << 10)
    m.close()
    rec = fmt.read_manifest(path)["files"][0]
    assert len(rec["crc32c"]) >= 32
    seen: set[int] = set()
    original = read_into_mod._Job.chunk
    gate = threading.Barrier(3, timeout=10)

    def chunk(self: Any, i: int) -> float:
        seen.add(threading.get_ident())
        if i < 3:
            gate.wait()  # three chunks in flight at once, or this times out
        return original(self, i)

    monkeypatch.setattr(read_into_mod._Job, "chunk", chunk)
    out = torch.empty(rec["size"], dtype=torch.uint8)
    with ThreadPoolExecutor(4) as pool:
        read_into(path, rec, [(0, out)], True, pool)
    assert len(seen) >= 3
    assert out.numpy().tobytes() == (path / "data.bin").read_bytes()


def test_read_into_memory_is_bounded_by_the_read_size(tmp_path: Path) -> None:
    """A manifest claiming one huge chunk still reads in READ_BYTES pieces (one scratch)."""
    data = tmp_path / "data.bin"
    payload = np.random.default_rng(0).integers(0, 255, 3 * read_into_mod.READ_BYTES + 5, np.uint8)
    data.write_bytes(payload.tobytes())
    from feedpipe.io import crc32c, to_hex

    rec = {
        "name": "data.bin",
        "size": payload.size,
        "chunk_bytes": 1 << 40,
        "crc32c": [to_hex(crc32c(payload.tobytes()))],
    }
    out = torch.empty(payload.size, dtype=torch.uint8)
    read_into(tmp_path, rec, [(0, out)], True, None)
    assert np.array_equal(out.numpy(), payload)


def test_gathered_runs_land_at_their_planned_offsets() -> None:
    """The batched path (here on CPU tensors): a run's bytes land exactly at their planned
    offsets, size-1 dims with odd strides included."""
    from ckpt.saving import plan as saveplan
    from ckpt.saving.flatten import flatten
    from ckpt.saving.pool import Buffer

    state = {f"t{k}": _tensor(k, "cpu") for k in range(200)}
    state = {k: v.contiguous() if not v.is_contiguous() else v for k, v in state.items()}
    state["odd"] = torch.arange(9.0)[::3][:1]  # shape (1,), stride (3,): contiguous
    leaves: list = []
    flatten(state, leaves)
    plan = saveplan.Plan(leaves, gather_host=True)  # the CUDA path's runs, on host tensors
    want = Buffer(plan.nbytes, False)
    want.tensor.zero_()
    fmt.stage(leaves, plan.entries, want)
    got = Buffer(plan.nbytes, False)
    got.tensor.fill_(0xAB)
    plan.stage(leaves, got)
    assert torch.equal(got.tensor, want.tensor)


def test_restore_benchmark_runs_on_a_tiny_state(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "ckpt_restore.py"
    bench = runpy.run_path(str(script), run_name="ckpt_restore_bench")
    args = ["--size-gb", "0.004", "--repeats", "1", "--no-doc", "--dir", str(tmp_path)]
    assert bench["main"](args) == 0
    out = capsys.readouterr().out
    for name in ("ckpt restore(into=)", "torch.load + copy_", "DCP load (in place)", "cold disk"):
        assert name in out
    assert list(tmp_path.iterdir()) == []


# ---- CUDA paths ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_3000_mixed_tensors_round_trip_bitwise(tmp_path: Path) -> None:
    state = _state(3000, "cuda")
    state["big"] = torch.randn(3 << 20, device="cuda")  # beyond SMALL_BYTES: a direct copy
    for i in range(11):  # over 64 MiB in all: the pool buffer is registered by pinned_empty
        state[f"odd{i}"] = torch.randn(3_000_001 + i, device="cuda")
    with CheckpointManager(tmp_path, write=WriteOptions(chunk_bytes=1 << 20)) as m:
        m.save(1, state).result()
        got = m.restore(1)
        into = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
        m.restore(1, into=into)
    _assert_same(got, state)
    _assert_same(into, state)
    assert got["t0"].is_cuda and got["cpu_between"].device.type == "cpu"


@pytest.mark.gpu
def test_gpu_stage_waits_for_the_current_stream(tmp_path: Path) -> None:
    """A save sees every write queued on the caller's (non-default) stream before it."""
    x = torch.zeros(1 << 20, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()
    with CheckpointManager(tmp_path) as m, torch.cuda.stream(side):
        for _ in range(20):
            a = a @ a / 64  # keep the stream busy
        x.fill_(3.0)
        m.save(1, {"x": x, "small": x[:10].clone()}).result()
        got = m.restore(1, map_location="cpu")
    assert bool((got["x"] == 3).all()) and bool((got["small"] == 3).all())


@pytest.mark.gpu
def test_gpu_restore_into_cuda_corrupt_chunk_writes_nothing(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(300_000, device="cuda") for i in range(4)}
    with CheckpointManager(tmp_path, write=WriteOptions(chunk_bytes=1 << 20)) as m:
        path = m.save(1, state).result()
        _corrupt(path, "last")
        into = {k: torch.full_like(v, 5.0) for k, v in state.items()}
        with pytest.raises(CorruptCheckpointError):
            m.restore(1, into=into)
    assert all(bool((v == 5.0).all()) for v in into.values())


@pytest.mark.gpu
def test_gpu_many_tensor_save_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "ckpt_save.py"
    bench = runpy.run_path(str(script), run_name="ckpt_save_bench")
    args = [
        "--device",
        "cuda",
        "--tensors",
        "40",
        "--saves",
        "1",
        "--no-doc",
        "--dir",
        str(tmp_path),
    ]
    assert bench["main"](args) == 0
    assert "transformer + AdamW" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_pinned_empty_is_pinned_and_unregistered_when_collected() -> None:
    from ckpt.saving.pool import pinned_empty

    t, keep = pinned_empty(200 << 20, 4)
    assert keep is not None and t.is_pinned() and t.numel() == 200 << 20
    src = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
    t[: 4 << 20].view(torch.int32).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t[: 4 << 20].view(torch.int32), src.cpu())
    ptr = t.data_ptr()
    del t, keep
    gc.collect()
    # already unregistered: asked through the driver API, whose failure (unlike the runtime's
    # cudaHostUnregister) is not left behind as the "last error" for torch's next CUDA call
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    assert driver.cuMemHostUnregister(ctypes.c_void_p(ptr)) == 713  # HOST_MEMORY_NOT_REGISTERED


def test_restore_into_contiguous_tensors_with_odd_size1_strides(tmp_path: Path) -> None:
    """Found on the H200: ``zeros_like`` of a one-element complex tensor keeps a stride of 3,
    which ``reshape(-1).view(uint8)`` refuses; such a tensor is contiguous, filled in place."""
    state = {
        "c": torch.randn(4, 3, dtype=torch.complex64)[:1, 0],  # shape (1,), stride (3,)
        "f": torch.randn(2, 5)[:, :1].t().contiguous(),
    }
    odd = torch.empty_strided((1, 1), (7, 5), dtype=torch.complex64)
    state["o"] = odd.copy_(torch.tensor([[1 + 2j]]))
    with CheckpointManager(tmp_path) as m:
        m.save(1, state).result()
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert into["c"].stride() == (3,) and into["c"].is_contiguous()
        m.restore(1, into=into)
    for k, v in state.items():
        assert torch.equal(into[k], v), k
