"""CheckpointManager and ckpt.save/load: round trips, stateful objects, RNG, restore modes,
back-pressure, background errors, retention and manifest validation."""

from __future__ import annotations

import json
import logging
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.manager import CheckpointManager, PoolOptions
from ckpt.saving import commit

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.bool, torch.complex64,
]  # fmt: skip


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        str(dt).removeprefix("torch."): (torch.randn(7, 5, generator=gen) * 10).to(dt)
        for dt in DTYPES
    }
    return {
        "tensors": tensors,
        "scalar_t": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(24.0).view(4, 6).t(),  # non-contiguous
        "arr": np.arange(12, dtype=np.float32).reshape(3, 4),
        "arr_u2": np.array(["ab", "c"]),
        "np_scalar": np.int64(7),
        "nested": [1, 2.5, "x", None, True, (3, [4])],
        "nonfinite": [float("inf"), float("-inf")],
        "blob": b"\x00\xff",
        "int_keys": {0: "zero", 1: {"lr": 0.1}},
        "dtype": torch.bfloat16,
    }


def _assert_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
            b.view(torch.uint8) if b.dtype.itemsize == 1 else b,
        )
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert type(a) is type(b) and a == b


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_every_dtype_and_leaf(tmp_path: Path, mmap: bool) -> None:
    state = _state()
    with CheckpointManager(tmp_path) as m:
        m.reserve(state)
        handle = m.save(10, state)
        assert handle.result(timeout=60) == tmp_path / "step-10"
        restored = m.restore(mmap=mmap)
    _assert_equal(state, restored)
    assert m.latest_step() == 10 and m.steps() == [10]
    assert (tmp_path / "latest").read_text().strip() == "step-10"


def test_modules_optimizers_and_rng_into(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    with CheckpointManager(tmp_path) as m:
        m.save(2, {"model": model, "opt": opt, "sched": sched, "epoch": 2}, rng=True).result()
        expected = (torch.rand(3), np.random.rand(), random.random())
        torch.manual_seed(123), np.random.seed(1), random.seed(2)
        model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
        into = {"model": model2, "opt": opt2, "sched": sched2, "epoch": 0}
        m.restore(into=into)
    assert into["epoch"] == 2
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    assert sched2.state_dict() == sched.state_dict()
    # the RNG streams continue exactly where they were at save time
    assert torch.equal(torch.rand(3), expected[0])
    assert np.random.rand() == expected[1] and random.random() == expected[2]


def test_into_copies_tensors_in_place(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(0, {"w": torch.arange(6.0), "cfg": {"a": 1}}).result()
        target = torch.zeros(6)
        into = {"w": target, "cfg": {"a": 0}}
        m.restore(into=into)
    assert into["w"] is target and torch.equal(target, torch.arange(6.0)) and into["cfg"]["a"] == 1


def test_map_location_and_saved_device(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(0, {"w": torch.ones(2)}).result()
        assert m.restore(map_location="cpu")["w"].device.type == "cpu"
    body = fmt.read_manifest(tmp_path / "step-0")
    assert body["entries"][0]["device"] == "cpu"


def test_simple_save_load_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "one"
    ckpt.save(path, {"x": torch.arange(3), "name": "a"})
    ckpt.save(path, {"x": torch.arange(4), "name": "b"})
    out = ckpt.load(path)
    assert out["name"] == "b" and torch.equal(out["x"], torch.arange(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one"]
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        ckpt.load(tmp_path / "missing")


def test_unsupported_leaves_are_named(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        with pytest.raises(CheckpointError, match=r"state\['bad'\]\[1\]: cannot save a object"):
            m.save(0, {"bad": [1, object()]})
        with pytest.raises(CheckpointError, match="object/structured"):
            m.save(0, {"o": np.array([object()])})
        with pytest.raises(CheckpointError, match="dict key"):
            m.save(0, {(1, 2): 3})
        with pytest.raises(ValueError, match="non-negative"):
            m.save(-1, {})
    assert commit.leftovers(tmp_path) == [] and m.steps() == []


def test_backpressure_waits_for_a_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = fmt.write_file

    def gated(*args: object, **kwargs: object) -> dict:
        assert gate.wait(60)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fmt, "write_file", gated)
    m = CheckpointManager(tmp_path, pool=PoolOptions(buffers=1))
    m.save(0, {"w": torch.ones(1000)})
    second: list = []
    t = threading.Thread(target=lambda: second.append(m.save(1, {"w": torch.zeros(1000)})))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not second, "the second save must wait for the only buffer"
    gate.set()
    t.join(60)
    m.wait(60)
    assert second[0].stats.backpressure_s > 0
    assert m.stats.backpressure_waits == 1 and m.pool.allocated_bytes == m.pool.buffer_bytes
    assert torch.equal(m.restore(1)["w"], torch.zeros(1000))
    assert torch.equal(m.restore(0)["w"], torch.ones(1000))
    m.close()


def test_budget_is_never_exceeded(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, pool=PoolOptions(budget_bytes=8 << 20, buffers=2))
    assert m.pool.allocated_bytes == 8 << 20  # allocated in the constructor, before any save
    with pytest.raises(CheckpointError, match="does not fit a pool buffer"):
        m.save(0, {"w": torch.empty(5 << 20, dtype=torch.uint8)})
    for step in range(4):
        m.save(step, {"w": torch.full((1 << 20,), step, dtype=torch.uint8)})
    m.close()
    assert m.pool.allocated_bytes == 8 << 20
    assert m.restore()["w"][0] == 3


def test_background_error_is_raised_by_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> dict:
        raise OSError(5, "Input/output error")

    m = CheckpointManager(tmp_path)
    m.save(0, {"w": torch.ones(3)}).result()
    monkeypatch.setattr(fmt, "write_file", boom)
    handle = m.save(1, {"w": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"step 1 failed: .*Input/output error"):
        handle.result(60)
    with pytest.raises(CheckpointError, match="background save of step 1 failed"):
        m.save(2, {"w": torch.ones(3)})
    monkeypatch.undo()
    m.save(3, {"w": torch.ones(3)}).result()  # training continues
    m.close()
    assert m.steps() == [0, 3] and commit.leftovers(tmp_path) == []


def test_retention_keeps_last_and_respects_guards_and_readers(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=2)
    m.evict_guards.append(lambda step: step != 1)  # e.g. "not uploaded yet"
    committed: list[int] = []
    m.on_commit.append(lambda step, path: committed.append(step))
    for step in range(5):
        m.save(step, {"s": step}).result()
    assert committed == [0, 1, 2, 3, 4]
    assert m.steps() == [1, 3, 4]
    m.evict_guards.clear()
    with commit.reading(tmp_path / "step-1"):  # a reader holds step 1: never evicted under it
        assert m.gc() == []
        assert m.steps() == [1, 3, 4]
    assert m.gc() == [1]
    assert m.steps() == [3, 4]
    m.close()


def test_retention_never_deletes_the_newest_verified(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"x": torch.ones(10)}).result()
        m.save(2, {"x": torch.ones(10)}).result()
    data = tmp_path / "step-2" / "data.bin"
    data.write_bytes(b"\x01" + data.read_bytes()[1:])  # corrupt the newest
    m = CheckpointManager(tmp_path, keep_last=1)
    assert torch.equal(m.restore()["x"], torch.ones(10))  # falls back to step 1 and verifies it
    assert m.gc() == []  # step 1 is the newest verified: kept
    assert m.steps() == [1, 2]
    m.close()


def test_restore_errors_are_clear(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"no valid checkpoint.*no committed steps"):
        m.restore()
    with pytest.raises(CheckpointError, match="step-7: checkpoint does not exist"):
        m.restore(7)


@pytest.mark.parametrize("bad", ["../escape.bin", "/etc/passwd", "a/../../b", "", ".hidden"])
def test_manifest_paths_are_validated(tmp_path: Path, bad: str) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(0, {"x": torch.ones(2)}).result()
    step = tmp_path / "step-0"
    body = fmt.read_manifest(step)
    body["files"][0]["name"] = bad
    body["entries"][0]["file"] = bad
    fmt.write_manifest(step, body)  # correctly checksummed, but hostile
    with pytest.raises(CorruptCheckpointError, match="unsafe file name"):
        ckpt.load(step)


def test_manifest_has_no_pickle_and_is_documented_json(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(0, {"x": torch.ones(2), "y": "s"}).result()
    doc = json.loads((tmp_path / "step-0" / "manifest.json").read_text())
    assert doc["body"]["format"] == "ckpt" and doc["body"]["version"] == fmt.FORMAT_VERSION
    assert {"dtype", "shape", "file", "offset", "nbytes"} <= set(doc["body"]["entries"][0])
    assert sorted(p.name for p in (tmp_path / "step-0").iterdir()) == ["data.bin", "manifest.json"]


def test_restore_logs_skipped_steps(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(0, {"x": torch.ones(2)}).result()
        m.save(1, {"x": torch.ones(2)}).result()
    (tmp_path / "step-1" / "data.bin").unlink()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        CheckpointManager(tmp_path).restore()
    assert "skipping step 1" in caplog.text and "data.bin: data file missing" in caplog.text


def test_failing_listener_is_reported_as_post_commit(tmp_path: Path) -> None:
    def upload(step: int, path: Path) -> None:
        raise ConnectionError("remote unreachable")

    m = CheckpointManager(tmp_path)
    m.on_commit.append(upload)
    handle = m.save(0, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"committed to .*step-0, but a post-commit action"):
        handle.result(60)
    with pytest.raises(CheckpointError, match="remote unreachable"):
        m.wait()
    m.on_commit.clear()
    m.close()
    assert m.steps() == [0] and torch.equal(m.restore(0)["x"], torch.ones(2))
