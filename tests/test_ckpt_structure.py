"""The flatten cache's fast path (``ckpt.saving.structure``, ``FlattenCache.capture``): from
the second hit on, a state of the last hit's structure skips the walk. Every test warms a
cache to a fast hit, changes the state, and compares the cached flatten (tree, every leaf's
record and bytes) with a fresh uncached ``flatten`` of the same state: every change that would
make the shared tree or the entries stale must leave the fast path."""

from __future__ import annotations

import gc
import json
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _flatten_snapshot import same

from ckpt.errors import CheckpointError
from ckpt.format.manifest import read_manifest
from ckpt.manager import CheckpointManager
from ckpt.saving.flatten import Leaf, flatten
from ckpt.saving.flatten_cache import FlattenCache
from ckpt.saving.structure import Structure, scan


def _warm(state: Any, cache: FlattenCache) -> None:
    """Miss, slow hit (the structure remembered), fast hit: each the uncached flatten."""
    for _ in range(3):
        same(state, cache)
    assert cache.fast_hits == 1, "the third flatten of an unchanged state is a fast hit"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net.lin(net.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    return {
        "model": net,
        "optim": opt,
        "plain": {"a": torch.arange(8.0), "b": torch.ones(2, 3), "n": torch.tensor(3)},
        "z": torch.tensor([1 + 2j, 3 - 4j]),
        "list": [torch.zeros(2), 1, "x", None, 0.5, True],
        "step": 7,
        "lr": 0.0,
        "od": OrderedDict(k=torch.ones(1)),
    }


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s.__setitem__(key, value)


def _plain(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["plain"].__setitem__(key, value)


def _with_param_flag(s: dict[str, Any]) -> None:
    t = torch.arange(8.0)
    t._is_param = True  # read by ``isinstance(t, nn.Parameter)``: the tree's "param"
    s["plain"]["a"] = t


def _new_storage_same_address(s: dict[str, Any]) -> None:
    a = s["plain"]["a"]
    s["plain"]["a"] = torch.empty(0).set_(a.untyped_storage(), 0, (8,), (1,))  # same key


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "new key": _plain("c", torch.ones(2)),
    "key removed": lambda s: s["plain"].pop("b"),
    "key renamed": lambda s: s.__setitem__("plain", {"a": s["plain"]["a"], "B": s["plain"]["b"],
                                                     "n": s["plain"]["n"]}),
    "dict reordered": lambda s: s.__setitem__("plain", dict(reversed(s["plain"].items()))),
    "int key": lambda s: s.__setitem__("od", OrderedDict({1: torch.ones(1)})),
    "dtype": _plain("b", torch.ones(2, 3, dtype=torch.float64)),
    "shape": _plain("b", torch.ones(3, 2)),
    "strides": _plain("b", torch.ones(3, 2).t()),
    "replaced, same shape": _plain("a", torch.arange(8.0) * 2),
    "resize_ in place": lambda s: s["plain"]["a"].resize_(2, 4),
    "resize_ grown in place": lambda s: s["plain"]["a"].resize_(64),
    "set_ in place": lambda s: s["plain"]["b"].set_(torch.zeros(2, 3)),
    "t_ in place": lambda s: s["plain"]["b"].t_(),
    "requires_grad_": lambda s: s["plain"]["a"].requires_grad_(True),
    "data of another dtype": lambda s: setattr(s["model"].lin, "bias",
                                               torch.nn.Parameter(torch.zeros(4).half())),
    "param .data swapped": lambda s: setattr(s["model"].lin.weight, "data",
                                             torch.zeros(4, 4, dtype=torch.float64)),
    "tie made": _plain("tie", torch.arange(8.0)[2:4]),
    "view of a tensor": lambda s: s["plain"].__setitem__("tie", s["plain"]["a"][2:4]),
    "parameter for tensor": lambda s: s["plain"].__setitem__("a", torch.nn.Parameter(
        s["plain"]["a"], requires_grad=False)),
    "param flag": _with_param_flag,
    "conj": lambda s: s.__setitem__("z", s["z"].conj()),
    "neg bit": lambda s: s.__setitem__("z", s["z"].conj().imag),
    "int scalar": _set("step", 8),
    "int to bool": _set("step", True),
    "int to float": _set("step", 7.0),
    "float sign": _set("lr", -0.0),
    "float": _set("lr", 1e-300),
    "str": lambda s: s["list"].__setitem__(2, "y"),
    "None to 0": lambda s: s["list"].__setitem__(3, 0),
    "list longer": lambda s: s["list"].append(2),
    "list to tuple": lambda s: s.__setitem__("list", tuple(s["list"])),
    "optimizer param group": lambda s: s["optim"].param_groups[0].__setitem__("lr", 0.2),
    "optimizer state": lambda s: s["optim"].state.clear(),
    "module buffer": lambda s: s["model"].bn.register_buffer("extra", torch.ones(1)),
    "module in eval": lambda s: s["model"].bn.num_batches_tracked.add_(1),  # data only
    "values only": lambda s: s["plain"]["a"].add_(1.0),
    "same storage, new tensor": _new_storage_same_address,
}  # fmt: skip
STILL_FAST = {"module in eval", "values only", "same storage, new tensor"}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_change_after_a_fast_hit_leaves_the_fast_path(name: str) -> None:
    state, cache = _state(), FlattenCache()
    _warm(state, cache)
    CHANGES[name](state)
    same(state, cache)
    assert cache.fast_hits == (2 if name in STILL_FAST else 1)
    before = cache.fast_hits
    same(state, cache)  # the changed state: remembered again (a miss needs two flattens)
    same(state, cache)
    assert cache.fast_hits > before


def test_the_fast_path_gives_the_values_of_this_save() -> None:
    """A fast hit's leaves are this state's tensors (their new bytes), its tree the last
    hit's with the new scalars only when they did not change (else not a fast hit)."""
    state, cache = _state(), FlattenCache()
    _warm(state, cache)
    for k in range(3):
        state["plain"]["a"].mul_(3.0)
        state["model"].lin.weight.data.add_(k)
        same(state, cache)
    assert cache.fast_hits == 4


def test_a_value_the_scan_does_not_handle_keeps_the_general_path() -> None:
    """Arrays (and other values the scan does not know) are flattened by the walk each save,
    with the key cache of the general path."""
    state = {"arr": np.arange(4), "t": torch.ones(2)}
    cache = FlattenCache()
    for _ in range(4):
        same(state, cache)
    assert scan(state) is None
    assert (cache.fast_hits, cache.hits) == (0, 3)


def test_a_cycle_raises_the_walks_error_not_a_recursion_error() -> None:
    loop: list[Any] = [torch.ones(1)]
    state = {"loop": [torch.ones(1)], "t": torch.ones(2)}
    cache = FlattenCache()
    _warm(state, cache)
    loop.append(loop)
    state["loop"] = loop
    with pytest.raises(CheckpointError, match="nested deeper"):
        cache.flatten(state, [])


def test_a_bool_key_raises_on_a_warm_cache() -> None:
    """``{1: t}`` and ``{True: t}`` compare equal; a bool key is refused by the walk."""
    state = {"d": {1: torch.ones(1)}}
    cache = FlattenCache()
    _warm(state, cache)
    state["d"] = {True: torch.ones(1)}
    with pytest.raises(CheckpointError, match="must be str or int"):
        cache.flatten(state, [])


def test_an_unsupported_tensor_on_a_fast_cache_raises_naming_its_path() -> None:
    state = {"ok": torch.ones(2), "bad": torch.ones(3)}
    cache = FlattenCache()
    _warm(state, cache)
    state["bad"] = torch.empty(3, device="meta")
    with pytest.raises(CheckpointError, match=r"state\['bad'\]: cannot save a meta tensor"):
        cache.flatten(state, [])


def test_neither_the_cache_nor_a_structure_holds_the_states_tensors() -> None:
    cache = FlattenCache()
    t = torch.ones(1000)
    ref = weakref.ref(t)
    state = {"t": t, "u": t[:10]}
    _warm(state, cache)
    structure = Structure.of(state)
    assert structure is not None and structure.read_columns() is not None
    structure.forget()
    del t, state
    gc.collect()
    assert ref() is None


def test_manager_saves_on_the_fast_path_restore_and_equal_a_fresh_managers(
    tmp_path: Path,
) -> None:
    """Saves 3 and on hit the fast path; a change between saves 4 and 5 (a tensor resized in
    place) is saved as is: the files equal a fresh manager's, byte for byte."""
    state = _state()
    with CheckpointManager(tmp_path / "warm", keep_last=None) as warm:
        for step in range(4):
            state["plain"]["a"].add_(1.0)
            warm.save(step, state).result(30)
        assert warm._saves.flattener.fast_hits == 2
        state["plain"]["a"].resize_(2, 4)
        state["lr"] = 0.25
        warm.save(4, state).result(30)
        got = warm.restore(4)
    with CheckpointManager(tmp_path / "cold", keep_last=None) as cold:
        cold.save(4, state).result(30)
    w, c = (tmp_path / d / "step-4" for d in ("warm", "cold"))
    assert (w / "data.bin").read_bytes() == (c / "data.bin").read_bytes()
    keep = ("tree", "entries", "nbytes")
    wj, cj = (read_manifest(p) for p in (w, c))
    assert {k: wj[k] for k in keep} == {k: cj[k] for k in keep}
    assert got["plain"]["a"].shape == (2, 4) and got["lr"] == 0.25
    assert torch.equal(got["plain"]["a"], state["plain"]["a"])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: torch.randn(3).to_sparse(), "dense strided"),
        (lambda: torch.randn(3, 3).to_sparse_csr(), "dense strided"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "nested",
        ),
    ],
    ids=["sparse", "csr", "nested", "jagged"],
)
def test_a_tensor_of_another_layout_on_a_fast_cache_raises(make: Any, match: str) -> None:
    """The columns hold no layout: every other layout (and a nested tensor) cannot be read
    there, so the walk sees it and raises."""
    state = {"ok": torch.ones(2), "bad": torch.ones(3)}
    cache = FlattenCache()
    _warm(state, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        state["bad"] = make()
    with pytest.raises(CheckpointError, match=match):
        cache.flatten(state, [])
    assert cache.fast_hits == 1


def test_views_of_one_storage_in_other_dtypes_share_one_entry() -> None:
    """The storage of a tensor is found by its data pointer less its offset in bytes: views
    at odd byte offsets and in other dtypes are one entry; a copy is its own."""
    a = torch.arange(16.0)
    state = {"a": a, "bytes": a.view(torch.uint8)[3:9], "tail": a[10:], "copy": a.clone()}
    leaves: list[Leaf] = []
    items = dict(flatten(state, leaves)["items"])
    assert items["a"]["i"] == items["bytes"]["i"] == items["tail"]["i"] != items["copy"]["i"]
    assert items["bytes"]["view"]["offset"] == 3 and items["tail"]["view"]["offset"] == 40
    assert len(leaves) == 2


def test_a_meta_tensor_of_an_unsupported_dtype_names_the_device_first() -> None:
    """The checks of a leaf in their order (layout, device, dtype), also once its device and
    dtype are known good from other leaves."""
    ok = {"a": torch.ones(2), "b": torch.ones(2, dtype=torch.float16)}
    flatten(ok, [])
    bad = torch.empty(2, dtype=torch.uint8, device="meta").view(torch.bits8)
    with pytest.raises(CheckpointError, match=r"state\['m'\]: cannot save a meta tensor"):
        flatten({**ok, "m": bad}, [])
    with pytest.raises(CheckpointError, match=r"state\['u'\]: dtype torch.bits8 is not"):
        flatten({**ok, "u": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)}, [])


class _HookedLock:
    """The cache's lock, running ``hook`` just before its ``at``-th acquisition: another
    thread's work at a fixed point of a save, without a race or a sleep."""

    def __init__(self, lock: Any, at: int, hook: Callable[[], object]) -> None:
        self.lock, self.at, self.hook, self.count = lock, at, hook, 0

    def __enter__(self) -> None:
        self.count += 1
        if self.count == self.at:
            self.hook()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_another_save_between_a_walk_and_its_remembering_is_not_paired_with_it() -> None:
    """A save of another state (another thread) after this save's walk, before the cache
    remembers its structure: the entries are the other state's, so this structure must not
    be remembered with them (else the next fast hit writes the other state's records)."""
    cache = FlattenCache()
    x = {"a": torch.ones(4)}
    y = {"b": torch.zeros(2, dtype=torch.float64), "c": torch.ones(3)}
    cache.flatten(x, [])  # a miss: the keys are x's
    lock = cache._lock
    cache._lock = _HookedLock(lock, 3, lambda: cache.flatten(y, []))  # type: ignore[assignment]
    same(x, cache)  # a slow hit on x; y's save before x's structure is remembered
    same(x, cache)
    same(x, cache)
    same(y, cache)


def test_a_scalar_changed_while_the_state_is_walked_is_not_paired_with_the_old_tree() -> None:
    """The training thread moves ``step`` on between the scan and the walk of a save: the
    walk's tree (step 3) must not be remembered under the scanned structure (step 2)."""
    state: dict[str, Any] = {"t": torch.ones(4), "step": 1}
    cache = FlattenCache()
    _warm(state, cache)
    state["step"] = 2
    hook = _HookedLock(cache._lock, 1, lambda: state.__setitem__("step", 3))
    cache._lock = hook  # type: ignore[assignment]
    items = dict(cache.flatten(state, [])["items"])
    assert hook.count == 3 and items["step"]["v"] == 3  # the walk's
    state["step"] = 2
    same(state, cache)
    same(state, cache)


def test_a_tensor_resized_while_the_state_is_walked_is_not_paired_with_the_old_tree() -> None:
    """A tensor resized in place after the walk, before the save remembers the structure:
    the next save (of the resized tensor) must not reuse the walk's entries."""
    state = {"t": torch.arange(4.0), "u": torch.ones(2)}
    cache = FlattenCache()
    cache.flatten(state, [])
    hook = _HookedLock(cache._lock, 2, lambda: state["t"].resize_(2, 2))
    cache._lock = hook  # type: ignore[assignment]
    cache.flatten(state, [])  # the walk saw [4]; the tensor is [2, 2] after it
    assert hook.count == 3
    same(state, cache)
    same(state, cache)


class _Toggle(torch.nn.Module):
    """Extra state that differs from one ``state_dict()`` call to the next."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.returned: list[int] = []

    def get_extra_state(self) -> Any:
        self.returned.append(len(self.returned) % 2)
        return {"phase": self.returned[-1]}

    def set_extra_state(self, state: Any) -> None:
        del state


def test_a_fast_hit_saves_what_this_saves_state_dict_call_returned() -> None:
    """A miss calls ``state_dict()`` twice (the scan's, the walk's): a structure is
    remembered only with a tree it describes, so a ``state_dict()`` that alternates never
    pairs one call's scalars with the other's structure."""
    module = _Toggle()
    cache = FlattenCache()
    for _ in range(4):
        tree = json.dumps(cache.flatten({"m": module}, []))
        assert f'"phase", {{"t": "v", "v": {module.returned[-1]}}}' in tree


def test_every_scalar_and_container_kind_reaches_the_fast_path() -> None:
    """The check that a walk's tree is the scanned structure's accepts every value the scan
    handles (non-finite floats, int keys, tuples, nested lists, ``None``, bools, parameters
    flagged by type or by ``_is_param``, ``requires_grad``): such states still hit the fast
    path."""
    flagged = torch.ones(2)
    flagged._is_param = True
    state = {
        "f": [float("nan"), float("inf"), float("-inf"), -0.0, 1.5],
        "d": {1: torch.ones(1), 2: (None, True, False, "s", [[]], ())},
        "od": OrderedDict(a=[torch.zeros(2), torch.ones(3)]),
        "p": torch.nn.Parameter(torch.ones(2)),
        "flagged": flagged,
        "rg": torch.ones(2, requires_grad=True),
        "opt": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
    }
    cache = FlattenCache()
    _warm(state, cache)
    same(state, cache)
    assert cache.fast_hits == 2


@pytest.mark.parametrize(
    "other",
    [
        {"a": torch.ones(2), "n": 2, "f": [0.5, None]},  # a scalar
        {"a": torch.ones(2), "n": 1, "f": [-0.5, None]},  # a float's sign
        {"b": torch.ones(2), "n": 1, "f": [0.5, None]},  # a key
        {"a": torch.ones(2), "n": 1, "f": (0.5, None)},  # a container's type
        {"a": torch.ones(2), "n": 1, "f": [0.5, False]},  # None to False
        {"a": torch.nn.Parameter(torch.ones(2)), "n": 1, "f": [0.5, None]},  # param flag
        {"a": torch.ones(2, requires_grad=True), "n": 1, "f": [0.5, None]},  # requires_grad
        {"a": torch.ones(2), "n": 1, "f": [0.5, None, 1]},  # a length
    ],
    ids=["scalar", "float sign", "key", "container", "None", "param", "rg", "length"],
)
def test_a_structure_does_not_describe_another_states_tree(other: dict[str, Any]) -> None:
    state = {"a": torch.ones(2), "n": 1, "f": [0.5, None]}
    structure = Structure.of(state)
    assert structure is not None and structure.read_columns() is not None
    assert structure.describes(flatten(state, []))
    assert not structure.describes(flatten(other, []))
