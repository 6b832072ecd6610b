"""Overlapped saves (``ckpt.saving.overlap``, ``CheckpointManager(overlap=True)``, issue 27
item 1). CPU: a CPU state saved with overlap gives the same bytes as without, and the hook
machinery (one-shot optimizer step pre-hooks and module forward pre-hooks) on real optimizers
and modules, with events that count their waits in place of CUDA events (no GPU here). GPU
(``-m gpu``): a snapshot taken with overlap, training going on right after it, is bit-identical
to one taken with a full synchronisation at the same moment."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.format.manifest import read_manifest
from ckpt.manager import CheckpointManager
from ckpt.saving.overlap import CLONE_BYTES, Overlap, owners

CPU = frozenset({"cpu"})


class Counted:
    """A stand-in for a CUDA event: counts the GPU-side waits and the host waits."""

    def __init__(self) -> None:
        self.waits = 0
        self.syncs = 0
        self.passed = False

    def wait(self) -> None:
        self.waits += 1

    def synchronize(self) -> None:
        self.syncs += 1
        self.passed = True

    def query(self) -> bool:
        return self.passed


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("table", torch.zeros(CLONE_BYTES // 4 + 1))  # a large buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _step(net, opt)
    return net, opt


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    net(torch.randn(8, 4)).sum().backward()
    opt.step()


@pytest.fixture
def overlap() -> Any:
    """An ``Overlap`` of CPU copies, closed after the test (its global hook removed)."""
    ov = Overlap(CPU)
    yield ov
    ov.close()


def test_hooks_fire_once_wait_on_the_gpu_and_remove_themselves(overlap: Overlap) -> None:
    net, opt = _trained()
    event = Counted()
    overlap.arm({"model": net, "optim": opt}, {"cpu": event})
    # the optimizer, the module holding the large buffer, every optimizer's step (global)
    assert overlap.armed == 3
    _step(net, opt)  # the forward pre-hook, the step pre-hook and the global hook fire
    assert (event.waits, event.syncs) == (3, 0)  # the GPU waited, the host never did
    assert overlap.armed == 1  # the one-shot hooks are gone; the global one waits on
    _step(net, opt)
    assert event.waits == 4  # only the global hook: the copies have not passed
    event.passed = True
    _step(net, opt)  # passed: no wait, and the global hook removes itself
    assert (event.waits, overlap.armed) == (4, 0)


def test_an_optimizer_not_in_the_state_waits_too(overlap: Overlap) -> None:
    net, opt = _trained()
    event = Counted()
    overlap.arm({"weights": net.state_dict()}, {"cpu": event})  # tensors only: no owner
    assert overlap.armed == 1
    _step(net, opt)
    assert event.waits == 1


def test_hooks_are_registered_once_and_a_second_save_before_the_step_is_waited_for(
    overlap: Overlap,
) -> None:
    net, opt = _trained()
    first, second = Counted(), Counted()
    state = {"model": net, "optim": opt}
    overlap.arm(state, {"cpu": first})
    overlap.arm(state, {"cpu": second})  # a second save before the step
    assert overlap.armed == 3
    opt.step()
    assert (first.waits, second.waits) == (0, 2)  # the newest copies (same side stream) only
    assert overlap.armed == 2  # the module's hook and the global one


def test_nothing_is_hooked_without_device_copies(overlap: Overlap) -> None:
    net, opt = _trained()
    overlap.arm({"model": net, "optim": opt}, {})
    assert overlap.armed == 0


def test_close_removes_every_hook_and_waits_on_the_host() -> None:
    net, opt = _trained()
    ov, event = Overlap(CPU), Counted()
    ov.arm([net, (opt,)], {"cpu": event})
    assert ov.armed == 3
    ov.close()
    assert ov.armed == 0 and event.syncs == 1
    event.passed = False
    _step(net, opt)
    assert event.waits == 0


def test_the_optimizer_state_dict_and_pickling_are_unaffected(overlap: Overlap) -> None:
    net, opt = _trained()
    _, twin_opt = _trained()
    ov = overlap
    ov.arm({"model": net, "optim": opt}, {"cpu": Counted()})
    armed, plain = opt.state_dict(), twin_opt.state_dict()
    assert armed["param_groups"] == plain["param_groups"]
    assert armed["state"].keys() == plain["state"].keys()
    for k in plain["state"]:
        assert all(torch.equal(armed["state"][k][n], v) for n, v in plain["state"][k].items())
    again = pickle.loads(pickle.dumps(opt))
    assert again.state_dict()["param_groups"] == plain["param_groups"]
    clone = copy.deepcopy(net)  # a module armed with a forward pre-hook: the copy's is inert
    clone(torch.randn(8, 4))
    pickle.loads(pickle.dumps(net))(torch.randn(8, 4))
    assert ov.armed == 3  # the copies' hooks are not ours: the originals are still armed


def test_wait_for_snapshot_and_editing(overlap: Overlap) -> None:
    ov, event = overlap, Counted()
    net, _ = _trained()
    ov.arm(net, {"cpu": event})
    with ov.editing():
        assert event.waits == 1
    ov.wait_for_snapshot(host=True)
    assert event.syncs == 1
    ov.wait_for_snapshot()  # passed: dropped, nothing more to wait for
    assert (event.waits, event.syncs) == (1, 1)


def test_small_leaves_are_cloned_and_large_ones_read_in_place() -> None:
    from ckpt.saving.flatten import flatten

    small, large = torch.ones(4), torch.ones(CLONE_BYTES // 4 + 1)
    leaves: list[Any] = []
    flatten({"s": small, "l": large}, leaves)
    sources = Overlap(CPU).prepare(leaves)
    assert leaves[0].value is not small and torch.equal(leaves[0].value, small)
    assert leaves[1].value is large
    assert sources == [leaf.value for leaf in leaves]


def test_owners_finds_optimizers_and_modules_once_each_in_order() -> None:
    net, opt = _trained()
    found = list(owners({"a": {"m": net, "t": torch.ones(2)}, "b": [opt, 3], "c": "x"}))
    assert found[0] is net and found[1] is opt and len(found) == 2


def _files(root: Path) -> tuple[bytes, Any]:
    body = read_manifest(root / "step-1")
    return (root / "step-1" / "data.bin").read_bytes(), (body["tree"], body["entries"])


def test_overlap_on_a_cpu_state_gives_the_same_bytes(tmp_path: Path) -> None:
    net, opt = _trained()
    state = {"model": net, "optim": opt, "extra": torch.arange(5)}
    with CheckpointManager(tmp_path / "sync") as sync:
        sync.save(1, state).result(30)
    with CheckpointManager(tmp_path / "ov", overlap=True) as ov:
        handle = ov.save(1, state)
        _step(net, opt)  # changes after save() returned do not reach the snapshot
        with ov.editing(), torch.no_grad():
            net.lin.weight.mul_(2)
        ov.wait_for_snapshot(host=True)
        handle.result(30)
    assert _files(tmp_path / "sync") == _files(tmp_path / "ov")


# ---- GPU: bit-identical to a fully synchronised snapshot (not run without a GPU) ----------


def _amp_step(net: torch.nn.Module, opt: Any, scaler: Any) -> None:
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = net(torch.randn(64, 256, device="cuda")).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _gpu_setup(kind: str) -> tuple[dict[str, Any], Callable[[], None]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 256)
    ).cuda()
    if kind == "tied":
        net[2].weight = torch.nn.Parameter(net[0].weight.t())  # a view of another parameter
    make = {
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
        "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    }.get(kind, lambda p: torch.optim.AdamW(p, lr=1e-3))
    opt = make(net.parameters())
    state: dict[str, Any] = {"model": net, "optim": opt}
    if kind == "amp":
        scaler = torch.amp.GradScaler("cuda")
        state["scaler"] = scaler
        return state, lambda: _amp_step(net, opt, scaler)

    def step() -> None:
        opt.zero_grad()
        net(torch.randn(64, 256, device="cuda")).pow(2).sum().backward()
        opt.step()

    return state, step


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind", ["adamw_fused", "adamw_foreach", "sgd_momentum", "amp", "tied", "hand_edit"]
)
def test_gpu_overlapped_snapshot_is_bit_identical_to_a_synchronised_one(
    tmp_path: Path, kind: str
) -> None:
    state, step = _gpu_setup(kind)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with (
        CheckpointManager(tmp_path / "sync") as sync,
        CheckpointManager(tmp_path / "ov", overlap=True) as ov,
    ):
        sync.save(1, state).result(60)  # a full synchronisation: the reference
        handle = ov.save(1, state)  # returns with the copies queued
        if kind == "hand_edit":
            with ov.editing(), torch.no_grad():
                for p in state["model"].parameters():
                    p.mul_(0.5)
        for _ in range(3):  # the optimizer steps and BatchNorm updates right after the save
            step()
        handle.result(60)
    assert _files(tmp_path / "sync") == _files(tmp_path / "ov")


@pytest.mark.gpu
def test_gpu_a_second_overlapped_save_before_the_step(tmp_path: Path) -> None:
    state, step = _gpu_setup("adamw_foreach")
    step()
    torch.cuda.synchronize()
    with (
        CheckpointManager(tmp_path / "sync") as sync,
        CheckpointManager(tmp_path / "ov", overlap=True) as ov,
    ):
        sync.save(1, state).result(60)
        first = ov.save(1, state)
        second = ov.save(2, state)  # before any step: both hold the same bytes
        step()
        first.result(60)
        second.result(60)
    assert _files(tmp_path / "sync") == _files(tmp_path / "ov")
    assert (tmp_path / "ov" / "step-2" / "data.bin").read_bytes() == _files(tmp_path / "sync")[0]
