"""The flattening cached across saves (``ckpt.saving.flatten_cache.FlattenCache``, issue 27
item 5): a cached flatten is the uncached one byte for byte, and every change that would make
a stale cache wrong (structure, shape, dtype, a tensor replaced, a tie made or broken, a dict
reordered) is seen. Each test flattens with a warm cache after the change and compares the
tree and every leaf (its record and bytes) with a fresh ``flatten`` of the same state."""

from __future__ import annotations

import gc
import itertools
import runpy
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _flatten_snapshot import leaf_bytes, same, snap

from ckpt.errors import CheckpointError
from ckpt.format.manifest import read_manifest
from ckpt.manager import CheckpointManager
from ckpt.saving.flatten import Leaf, flatten
from ckpt.saving.flatten_cache import FlattenCache
from ckpt.saving.plan import SavePlan, Stager
from ckpt.saving.pool import Buffer


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.out = torch.nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.bn(self.emb(x).flatten(0, 1)))
        return out


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "arr": np.arange(5, dtype=np.int16),
        "half": torch.arange(6, dtype=torch.bfloat16)[::2],  # a strided view
        "lr": 0.5,
    }


def test_a_warm_cache_is_hit_and_gives_the_uncached_snapshot() -> None:
    state, cache = _state(), FlattenCache()
    same(state, cache)
    assert (cache.hits, cache.misses) == (0, 1)
    for value in (0.25, 0.125):  # scalars change between saves: the tree carries the new ones
        state["lr"] = value
        state["model"].emb.weight.data.add_(1.0)  # in place: same keys
        same(state, cache)
    assert (cache.hits, cache.misses) == (2, 1)


def test_a_changed_structure_misses() -> None:
    state, cache = _state(), FlattenCache()
    same(state, cache)
    state["extra"] = torch.ones(3)
    same(state, cache)
    del state["arr"]
    same(state, cache)
    assert cache.misses == 3


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.__setitem__("half", torch.arange(6, dtype=torch.bfloat16)[:3]),  # strides
        lambda s: s.__setitem__("half", torch.arange(3, dtype=torch.float16)),  # dtype
        lambda s: s.__setitem__("half", torch.arange(4, dtype=torch.bfloat16)),  # shape
        lambda s: s["model"].bn.running_mean.set_(torch.zeros(5)),  # storage swapped in place
        lambda s: s.__setitem__("arr", np.arange(5, dtype=np.int32)),  # array dtype
    ],
    ids=["strides", "dtype", "shape", "set_", "array"],
)
def test_a_changed_shape_dtype_or_strides_misses(change: Any) -> None:
    state, cache = _state(), FlattenCache()
    same(state, cache)
    change(state)
    same(state, cache)
    assert (cache.hits, cache.misses) == (0, 2)


def test_a_tensor_replaced_by_another_object_with_the_same_key() -> None:
    state, cache = _state(), FlattenCache()
    model = state["model"]
    same(state, cache)
    # the tie is broken by a new Parameter of the same shape, dtype and device: a stale cache
    # would still store "out.weight" as a view of the embedding's entry
    model.out.weight = torch.nn.Parameter(model.emb.weight.detach() * 2)
    tree, _ = snap(state, cache)
    assert tree == snap(state)[0] and '"view"' not in tree
    assert cache.misses == 2
    model.out.weight = model.emb.weight  # tied again
    tree, _ = snap(state, cache)
    assert tree == snap(state)[0] and '"view"' in tree
    state["half"] = state["half"].clone()  # same key but for the address: a copy, not a view
    same(state, cache)
    assert cache.misses == 4


def test_a_dict_with_the_same_keys_in_another_order() -> None:
    cache = FlattenCache()
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    same({"a": a, "b": b}, cache)
    swapped = {"b": b, "a": a}
    assert snap(swapped, cache) == snap(swapped)
    assert snap(swapped)[1][0][-1] == b.numpy().tobytes()  # b's bytes first now
    views = {"x": a[:2], "y": a[2:]}  # two views of one storage: one shared entry
    same(views, cache)
    same({"y": views["y"], "x": views["x"]}, cache)
    assert cache.hits == 0


def test_conjugate_and_negative_views_are_resolved_on_a_hit() -> None:
    cache = FlattenCache()
    z = torch.tensor([1 + 2j, 3 - 4j])
    state = {"conj": z.conj(), "plain": z}
    same(state, cache)
    z.mul_(2)
    same(state, cache)
    assert cache.hits == 1


def test_the_cache_holds_no_reference_to_the_state() -> None:
    cache = FlattenCache()
    t = torch.ones(1000)
    ref = weakref.ref(t)
    same({"t": t, "u": t[:10]}, cache)
    del t
    gc.collect()
    assert ref() is None


def test_manager_saves_with_a_warm_cache_equal_a_fresh_managers(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path / "warm", keep_last=None) as warm:
        warm.save(0, state).result(30)
        state["model"].out.weight = torch.nn.Parameter(torch.zeros(6, 4))  # untied
        state["model"].emb.weight.data.add_(1.0)
        warm.save(1, state).result(30)
        got = warm.restore(1)
    with CheckpointManager(tmp_path / "cold", keep_last=None) as cold:
        cold.save(1, state).result(30)
    for name in ("data.bin", "manifest.json"):
        w, c = (tmp_path / d / "step-1" for d in ("warm", "cold"))
        if name == "manifest.json":
            keep = ("tree", "entries", "nbytes")
            wj, cj = (read_manifest(p) for p in (w, c))
            assert {k: wj[k] for k in keep} == {k: cj[k] for k in keep}
        else:
            assert (w / name).read_bytes() == (c / name).read_bytes()
    weights = got["model"]
    assert torch.equal(weights["out.weight"], torch.zeros(6, 4))
    assert weights["out.weight"].untyped_storage().data_ptr() != (
        weights["emb.weight"].untyped_storage().data_ptr()
    )


@pytest.mark.gpu
def test_a_tensor_moved_to_another_device_misses() -> None:
    state, cache = _state(), FlattenCache()
    same(state, cache)
    state["half"] = state["half"].cuda()
    same(state, cache)
    state["model"].cuda()
    same(state, cache)
    assert cache.misses == 3


def test_the_many_tensor_cpu_benchmark_row_runs(tmp_path: Path) -> None:
    """``benchmarks/ckpt_save.py --cpu-tensors`` end to end on a tiny state (no timing
    asserted): a ratio of the save to its ceiling, and the steady saves counted."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "_ckpt_many_cpu.py"
    bench = runpy.run_path(str(script), run_name="ckpt_many_cpu_bench")
    row = bench["_row"]("tiny", bench["_small_state"](40), lambda: None, 2, tmp_path)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "tiny" and cells[1] == "40"
    assert cells[5].endswith("x**") and cells[-1] == "2"
    assert cells[7].endswith("x**") and cells[10].endswith("x**") and cells[11].endswith("x")
    assert list(tmp_path.iterdir()) == []


def _mixed() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "f32": torch.randn(3, 1, 4, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f64": torch.randn(2, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
        "i8": torch.randint(-100, 100, (5,), generator=g, dtype=torch.int8),
        "bool": torch.rand(9, generator=g) > 0.5,
        "c128": torch.randn(3, generator=g, dtype=torch.complex128),
        "scalar": torch.tensor(3.0),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "arr": np.arange(7, dtype=np.float32),
    }


@pytest.mark.parametrize("extra", [0, 3])
def test_host_leaves_are_staged_byte_for_byte_into_a_new_buffer(extra: int) -> None:
    """The host views of a new buffer (one ``as_strided`` per leaf of a whole-buffer view per
    dtype) put every leaf's bytes at its entry, also in a buffer whose size is no multiple of
    the widest dtype."""
    leaves: list[Leaf] = []
    flatten(_mixed(), leaves)
    plan = Stager().plan(leaves)
    for fill in (0xAB, 0x00):  # a second buffer: views made afresh for it
        buf = Buffer(plan.nbytes + extra, pin=False)
        buf.array[:] = fill
        plan.stage(leaves, buf)
        for leaf, e in zip(leaves, plan.entries, strict=True):
            got = buf.array[e["offset"] : e["offset"] + e["nbytes"]].tobytes()
            assert got == leaf_bytes(leaf), leaf.path
        ends = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in plan.entries)
        for (_, a), (b, _) in itertools.pairwise(ends):
            assert not buf.array[a:b].any()  # padding zeroed


def test_a_cache_hit_reuses_the_plan_without_checking_its_signature(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose flattening hit the cache of the save before (same generation) reuses the
    plan without the per-leaf signature check; a miss (a shape changed) checks it and plans
    anew, and the files restore to the state saved."""
    checks: list[int] = []
    matches = SavePlan.matches

    def counted(self: SavePlan, leaves: Any) -> bool:
        checks.append(1)
        return matches(self, leaves)

    monkeypatch.setattr(SavePlan, "matches", counted)
    state = _mixed()
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for step in range(3):
            m.save(step, state).result(30)
        stager = m._saves.stager
        assert (stager.planned, len(checks)) == (1, 1)  # the 2nd save checked, the 3rd not
        state["f32"] = torch.randn(3, 2)
        m.save(3, state).result(30)
        assert (stager.planned, len(checks)) == (2, 2)
        got = m.restore(3)
    assert torch.equal(got["f32"], state["f32"]) and torch.equal(got["bf16"], state["bf16"])
    assert torch.equal(got["f64"], state["f64"]) and torch.equal(got["bool"], state["bool"])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: torch.randn(3).to_sparse(), "dense strided"),
        (lambda: torch.empty(3, device="meta"), "meta tensor"),
        (lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8), "dense strided"),
        (lambda: torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "bits8 is not supported"),
    ],
)
def test_an_unsupported_tensor_raises_naming_its_path_cold_and_on_a_warm_cache(
    make: Any, match: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated
        bad = make()
    with pytest.raises(CheckpointError, match=match) as cold:
        flatten({"ok": torch.ones(2), "bad": bad}, [])
    assert "state['bad']" in str(cold.value)
    cache = FlattenCache()
    state = {"ok": torch.ones(2), "bad": torch.ones(3)}
    same(state, cache)
    state["bad"] = bad
    with pytest.raises(CheckpointError, match=match):
        cache.flatten(state, [])
    assert cache.hits == 0


def test_ties_through_grad_and_negative_views_match_the_uncached_flatten() -> None:
    """A tensor that requires grad and its view share one entry (detached, not copied); a view
    with the negative bit (``z.conj().imag``) is resolved into its own entry."""
    w = torch.randn(8, requires_grad=True)
    z = torch.tensor([1 + 2j, 3 - 4j])
    state = {"w": w, "head": w[:4], "re": z.real, "negim": z.conj().imag}
    leaves: list[Leaf] = []
    tree = flatten(state, leaves)
    items = dict(tree["items"])
    assert items["w"]["i"] == items["head"]["i"] and "view" in items["head"]
    negim = leaves[-1].value
    assert isinstance(negim, torch.Tensor) and not negim.is_neg() and "view" not in items["negim"]
    assert torch.equal(negim, -z.imag)
    cache = FlattenCache()
    same(state, cache)
    with torch.no_grad():
        w.add_(1.0)
    same(state, cache)
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_plain_state_hits_and_a_tie_made_or_broken_in_it_is_seen() -> None:
    """A state of untied, untracked leaves (reused in C loops) is the uncached flatten on a hit,
    also after a tie into it is made (views, the general path) and broken again."""
    state, cache = _mixed(), FlattenCache()
    same(state, cache)
    state["f32"].add_(1.0)
    state["arr"] += 1
    same(state, cache)
    state["tie"] = state["f32"][1]
    same(state, cache)
    same(state, cache)
    del state["tie"]
    same(state, cache)
    state["bf16"].mul_(2)
    same(state, cache)
    assert (cache.hits, cache.misses) == (3, 3)


class _Probe:
    """A state object that records whether the cyclic collector runs while it is saved."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(gc.isenabled())
        return {"w": torch.ones(3)}


def test_a_save_pauses_the_cyclic_collector_and_restores_it(tmp_path: Path) -> None:
    """The blocking part of a save runs with ``gc`` off and puts it back as it was: on after a
    save (also one that failed), still off where the caller had turned it off."""
    probe = _Probe()
    assert gc.isenabled()
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(0, {"p": probe}).result(30)
        assert probe.seen == [False] and gc.isenabled()
        with pytest.raises(CheckpointError):
            m.save(1, {"p": probe, "bad": torch.empty(2, device="meta")})
        assert probe.seen == [False, False] and gc.isenabled()
        gc.disable()
        try:
            m.save(2, {"p": probe}).result(30)
            assert not gc.isenabled()
        finally:
            gc.enable()
        assert m.restore(2)["p"]["w"].sum() == 3
