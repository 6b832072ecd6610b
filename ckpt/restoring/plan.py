"""``RestorePlan``: what ``restore(into=)`` will write, decided before the first byte is written.

A plan is built once from a step's manifest and the ``into`` target. The walk matches the saved
tree with ``into`` and decides, for every saved value, one action:

- **direct**: a tensor of ``into`` that the reader fills straight from the data file (same dtype
  and shape, contiguous, plain CPU or CUDA tensor, sharing memory with no other target);
- **copy**: a tensor or array of ``into`` that gets the saved value by ``copy_`` (a cast
  allowed by ``torch.can_cast``, or by ``numpy.can_cast(..., "same_kind")`` for arrays: no
  float into an int, no value into a bool; a lossy cast such as float64 -> uint8 is refused);
  copies run in the order torch's ``load_state_dict`` would run them, so of two keys that share
  memory (tied weights) the later one wins, as in torch;
- **load**: an object with ``load_state_dict`` (an optimizer, a ``DataLoader``, a sampler) gets
  its saved state; an ``nn.Module`` is matched by its ``state_dict`` names and then gets
  ``load_state_dict`` (hooks and extra state run as in torch);
- **set**: a dict or list item that is not a tensor, array or container is replaced;
- the RNG states saved under ``"__rng__"`` (``save(rng=True)``) are set last.

Keys follow ``torch.nn.Module.load_state_dict``: with ``strict=True`` (the default) a key of
``into`` that was not saved (missing) or a saved key that ``into`` lacks (unexpected) is a
``CheckpointError`` listing them all; with ``strict=False`` they are skipped (an unexpected key is
not added to ``into``) and reported as ``IncompatibleKeys`` in ``RestoreStats.incompatible_keys``.

Order of a restore (``ckpt.restoring.reader.read_checkpoint`` runs it), each step only after the one
before succeeded:

1. ``RestorePlan.build``: keys, shapes, dtypes, writability (no read-only array, no inference
   tensor, no target whose elements overlap, such as an ``expand``-ed or stride-0 view) and
   aliasing; raises before anything is read.
2. The reader reads (and checks) every data file, keeping the values of non-direct entries.
3. ``check``: each loaded object with a ``check_state_dict(state)`` method validates its state,
   and the saved RNG states are checked on throwaway generators.
4. ``load``: ``load_state_dict`` of the loaded objects, in tree order; if one refuses, those
   loaded before it get back the ``state_dict()`` they had (taken just before), and nothing else
   has been written.
5. The reader fills the direct targets; then ``finish``: the copies, the modules'
   ``load_state_dict``, the replaced items and the RNG states.

So a refusal by a loader (its batch size changed), a bad shape or dtype, a read-only or
expanded target, or a missing key leaves every target and the global RNG as they were.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch

from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.saving.flatten import RNG_KEY, set_rng_state, torch_dtype, unflatten

__all__ = ["IncompatibleKeys", "RestorePlan"]


class IncompatibleKeys(NamedTuple):
    """Keys skipped by a ``strict=False`` restore, named like torch's ``_IncompatibleKeys``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _Copy:
    node: dict[str, Any]  # the saved tensor/ndarray node
    target: Any  # the tensor or array of ``into``
    where: str


@dataclass
class RestorePlan:
    """Every write of one ``restore(into=)``, decided before any (see the module docstring)."""

    path: str
    direct: dict[int, torch.Tensor] = field(default_factory=dict)  # entry -> tensor of into
    copies: list[_Copy] = field(default_factory=list)
    loads: list[tuple[Any, dict[str, Any], str]] = field(default_factory=list)
    modules: list[tuple[torch.nn.Module, dict[str, Any], str]] = field(default_factory=list)
    sets: list[tuple[Any, Any, dict[str, Any]]] = field(default_factory=list)
    rng: dict[str, Any] | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    _undo: list[tuple[Any, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, body: dict[str, Any], into: Any, path: str, strict: bool = True) -> RestorePlan:
        """Match the manifest ``body`` with ``into`` and check every write; raises
        ``CheckpointError`` naming the place (nothing is read or written)."""
        plan = cls(path)
        _Walk(plan, body).node(body["tree"], into, "", "state")
        if strict and (plan.missing or plan.unexpected):
            plan.fail(
                "state",
                f"keys differ: missing {plan.missing}, unexpected {plan.unexpected} "
                "(restore(strict=False) skips them)",
            )
        plan.direct = _direct(body, plan.copies)
        return plan

    def direct_ranges(self, body: dict[str, Any]) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """Per data file, the byte ranges of the direct targets: where the reader's last pass
        writes each of them (as a flat uint8 view of the target)."""
        ranges: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for i, t in self.direct.items():
            e = body["entries"][i]
            # as_strided: a contiguous tensor's size-1 dims may keep any stride (reshape keeps it)
            raw = torch.as_strided(t.detach(), (t.numel(),), (1,)).view(torch.uint8)
            ranges.setdefault(e["file"], []).append((e["offset"], raw))
        return ranges

    @property
    def incompatible_keys(self) -> IncompatibleKeys:
        return IncompatibleKeys(list(self.missing), list(self.unexpected))

    def fail(self, where: str, why: str) -> NoReturn:
        raise CheckpointError(f"{self.path}: {where}: {why}; nothing was loaded")

    # ---- after the read: check, load, finish ------------------------------------------------
    def check(self, arrays: list[Any]) -> None:
        """Step 3: the loaded objects' own checks and the RNG states, on the values read."""
        for obj, node, where in self.loads:
            check = getattr(obj, "check_state_dict", None)
            if callable(check):
                self._call(check, unflatten(node, arrays, where), where)
        if self.rng is not None:
            _check_rng(unflatten(self.rng, arrays), self)

    def load(self, arrays: list[Any]) -> None:
        """Step 4: ``load_state_dict`` of each loaded object; a refusal undoes those before it."""
        for obj, node, where in self.loads:
            try:
                before = obj.state_dict()
            except Exception:  # no snapshot: it cannot be undone, but it may still load
                before = None
            self._call(obj.load_state_dict, unflatten(node, arrays, where), where)
            self._undo.append((obj, before))

    @contextmanager
    def loading(self, arrays: list[Any]) -> Iterator[None]:
        """Step 4 (``load``) and what runs inside: if anything fails there, the objects loaded
        get their earlier state back (``undo``)."""
        try:
            self.load(arrays)
            yield
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        """Give the objects loaded by ``load`` their earlier state back (best effort)."""
        while self._undo:
            obj, before = self._undo.pop()
            if before is not None:
                try:
                    obj.load_state_dict(before)
                except Exception:  # the original error is the one raised
                    pass

    def finish(self, arrays: list[Any]) -> None:
        """Step 5 (after the direct targets were filled): copies, modules, items, RNG."""
        with torch.no_grad():
            for c in self.copies:
                value = unflatten(c.node, arrays, c.where)
                if isinstance(c.target, np.ndarray):
                    np.copyto(c.target, value, casting="same_kind")
                elif value is not c.target:
                    c.target.copy_(value)
        for module, node, where in self.modules:
            try:  # a module's own set_extra_state or load hooks may still refuse
                module.load_state_dict(unflatten(node, arrays), strict=False)
            except Exception as exc:
                raise CheckpointError(
                    f"{self.path}: {where}: the {type(module).__name__} refused its saved state "
                    f"({type(exc).__name__}: {exc}); the restore is incomplete: tensors and "
                    "modules before it were already written"
                ) from exc
        for container, key, node in self.sets:
            container[key] = unflatten(node, arrays)
        if self.rng is not None:
            set_rng_state(unflatten(self.rng, arrays))
        self._undo.clear()

    def _call(self, fn: Callable[[Any], Any], state: Any, where: str) -> None:
        try:
            fn(state)
        except CheckpointError:
            raise
        except Exception as exc:
            owner = type(getattr(fn, "__self__", fn)).__name__
            raise CheckpointError(
                f"{self.path}: {where}: the {owner} refused its saved state ({exc}); "
                "nothing was loaded"
            ) from exc


class _Walk:
    """One walk of the saved tree beside ``into``, filling a plan."""

    def __init__(self, plan: RestorePlan, body: dict[str, Any]) -> None:
        self.plan, self.body = plan, body
        self._maps: list[tuple[int, int, bool]] | None = None  # /proc/self/maps, read once
        self._starts: list[int] = []

    def node(self, node: dict[str, Any], target: Any, key: str, where: str) -> None:
        while node["t"] == "state":
            node = node["v"]
        kind = node["t"]
        if isinstance(target, torch.nn.Module):
            self.module(node, target, key, where)
        elif callable(getattr(target, "load_state_dict", None)):
            self.plan.loads.append((target, node, where))
        elif kind in ("dict", "odict") and isinstance(target, dict):
            self.mapping(node, target, key, where)
        elif kind in ("list", "tuple", "namedtuple", "size") and isinstance(target, list):
            items = node["items"] if kind != "size" else [{"t": "v", "v": d} for d in node["items"]]
            if len(target) != len(items):
                self.plan.fail(where, f"a list of {len(target)} vs {len(items)} saved items")
            for i, (v, t) in enumerate(zip(items, target, strict=True)):
                self.item((target, i), v, t, _join(key, i), f"{where}[{i}]")
        elif kind in ("tensor", "ndarray") and _array_kind(target) == kind:
            self.copy(node, target, where)
        else:
            self.plan.fail(where, f"cannot load a saved {kind} into a {type(target).__name__}")

    def mapping(self, node: dict[str, Any], target: dict[Any, Any], key: str, where: str) -> None:
        saved = set()
        for k, v in node["items"]:
            saved.add(k)
            if k == RNG_KEY and k not in target:
                self.plan.rng = v
            elif k not in target:
                self.plan.unexpected.append(_join(key, k))
            else:
                self.item((target, k), v, target[k], _join(key, k), f"{where}[{k!r}]")
        self.plan.missing.extend(_join(key, k) for k in target if k not in saved)

    def item(self, slot: tuple[Any, Any], v: dict[str, Any], t: Any, key: str, where: str) -> None:
        """A saved value ``v`` for the item ``t`` of ``into``: loaded into it, or replacing it."""
        saved = v
        while saved["t"] == "state":
            saved = saved["v"]
        loads_into = (
            isinstance(t, (dict, list, torch.nn.Module))
            or callable(getattr(t, "load_state_dict", None))
            or (_array_kind(t) is not None and _array_kind(t) == saved["t"])
        )
        if loads_into:
            self.node(v, t, key, where)
        else:
            self.plan.sets.append((*slot, v))

    def module(self, node: dict[str, Any], target: torch.nn.Module, key: str, where: str) -> None:
        if node["t"] not in ("dict", "odict"):
            self.plan.fail(where, f"cannot load a saved {node['t']} into a module")
        saved = {k: v for k, v in node["items"]}
        wanted = target.state_dict()
        self.plan.missing.extend(_join(key, k) for k in wanted if k not in saved)
        self.plan.unexpected.extend(_join(key, k) for k in saved if k not in wanted)
        named: dict[str, torch.Tensor] = dict(target.named_parameters(remove_duplicate=False))
        named.update(target.named_buffers(remove_duplicate=False))
        for k in wanted:  # torch's load order: the module's own
            t = named.get(k)
            if k in saved and t is not None:
                v = saved[k]
                if v["t"] != "tensor":
                    self.plan.fail(f"{where}[{k!r}]", f"cannot load a saved {v['t']} into a tensor")
                self.check(v, t, f"{where}[{k!r}]")
        self.plan.modules.append((target, node, where))

    def copy(self, node: dict[str, Any], target: Any, where: str) -> None:
        self.check(node, target, where)
        self.plan.copies.append(_Copy(node, target, where))

    def check(self, node: dict[str, Any], target: Any, where: str) -> None:
        """Shape, a safe cast, and a target that can be written."""
        saved = node.get("view") or self.body["entries"][node["i"]]
        if list(target.shape) != saved["shape"]:
            self.plan.fail(
                where,
                f"saved with shape {saved['shape']}, cannot load into shape {list(target.shape)}",
            )
        if isinstance(target, np.ndarray):
            src = fmt.numpy_dtype(saved["dtype"])
            if not np.can_cast(src, target.dtype, "same_kind"):
                self.plan.fail(where, f"a saved {src} cannot be cast safely to {target.dtype}")
            if not target.flags.writeable:
                self.plan.fail(where, "the array is read-only")
            size = target.itemsize
        else:
            src_t = torch_dtype(saved["dtype"])
            if not torch.can_cast(src_t, target.dtype):
                self.plan.fail(where, f"a saved {src_t} cannot be cast safely to {target.dtype}")
            if target.is_inference() or target.device.type == "meta":
                self.plan.fail(where, "the tensor cannot be written (an inference or meta tensor)")
            span = _memory(target) if target.device.type == "cpu" else None
            if span is not None and not self.writable(span[1], span[2]):
                self.plan.fail(
                    where,
                    "its memory is read-only (a tensor over a read-only mmap or a non-writable "
                    "NumPy array: writing it would crash the process); give a writable tensor",
                )
            size = 1
        strides = [s // size for s in target.strides] if size > 1 else list(target.stride())
        if _overlapping(list(target.shape), strides):
            self.plan.fail(
                where,
                "its elements overlap in memory (an expand()-ed or stride-0 view); "
                "give a tensor or array of its own",
            )

    def writable(self, lo: int, hi: int) -> bool:
        """Whether the host bytes ``[lo, hi)`` lie in writable mappings (``/proc/self/maps``;
        ``True`` where there is no such file)."""
        if self._maps is None:
            self._maps = _host_maps()
            self._starts = [m[0] for m in self._maps]
        if not self._maps:
            return True
        first = max(0, bisect.bisect_right(self._starts, lo) - 1)
        for start, end, can_write in self._maps[first:]:  # sorted by start
            if end <= lo:
                continue
            if start > lo or not can_write:
                return False
            lo = end
            if lo >= hi:
                return True
        return False


def _host_maps() -> list[tuple[int, int, bool]]:
    """This process's mappings (start, end, writable), from ``/proc/self/maps`` ([] without)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        span, perms = line.split(b" ", 2)[:2]
        start, end = span.split(b"-")
        out.append((int(start, 16), int(end, 16), perms[1:2] == b"w"))
    return sorted(out)


def _array_kind(obj: Any) -> str | None:
    if isinstance(obj, torch.Tensor):
        return "tensor"
    return "ndarray" if isinstance(obj, np.ndarray) else None


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _overlapping(shape: list[int], strides: list[int]) -> bool:
    """Whether two indices of this strided layout may name one element (strides in elements)."""
    dims = sorted((abs(s), d) for d, s in zip(shape, strides, strict=True) if d > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * size
    return False


def _memory(target: Any) -> tuple[Any, int, int] | None:
    """The bytes ``target`` covers: (device or ``None`` for host memory, start, end)."""
    if isinstance(target, np.ndarray):
        lo, hi = np.lib.array_utils.byte_bounds(target)
        return ("cpu", lo, hi) if hi > lo else None
    if target.numel() == 0:
        return None
    size = target.element_size()
    lo = hi = target.data_ptr()
    for d, s in zip(target.shape, target.stride(), strict=True):
        (lo, hi) = (lo + (d - 1) * s * size, hi) if s < 0 else (lo, hi + (d - 1) * s * size)
    device = "cpu" if target.device.type == "cpu" else str(target.device)
    return device, lo, hi + size


def _direct(body: dict[str, Any], copies: list[_Copy]) -> dict[int, torch.Tensor]:
    """The copies the reader may fill straight from the file: a plain tensor of the entry's
    dtype and shape (its own entry, not a view of a shared one), contiguous, on CPU or CUDA,
    sharing no memory with another target (those go through ``finish`` in torch's order)."""
    shared = _sharing(copies)
    direct: dict[int, torch.Tensor] = {}
    for n, c in enumerate(copies):
        node = c.node
        if n in shared or node["t"] != "tensor" or "view" in node or node["i"] in direct:
            continue
        if _fills_directly(c.target, node, body["entries"][node["i"]]):
            direct[node["i"]] = c.target
    return direct


def _sharing(copies: list[_Copy]) -> set[int]:
    """The copies whose targets share memory with another copy's target."""
    spans = [(m, n) for n, c in enumerate(copies) if (m := _memory(c.target)) is not None]
    spans.sort(key=lambda s: (str(s[0][0]), s[0][1]))
    shared: set[int] = set()
    reach: tuple[Any, int, int] | None = None  # the span reaching furthest so far, and whose
    for (device, lo, hi), n in spans:
        if reach is not None and reach[0] == device and lo < reach[1]:
            shared.update((reach[2], n))
        if reach is None or reach[0] != device or hi > reach[1]:
            reach = (device, hi, n)
    return shared


def _fills_directly(t: Any, node: dict[str, Any], entry: dict[str, Any]) -> bool:
    """Whether the file's bytes of ``entry`` are the bytes of target ``t`` as it is."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and not node.get("param")
        and node.get("rg", False) == t.requires_grad
        and str(t.dtype).removeprefix("torch.") == entry["dtype"]
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())  # their bytes are not the values
        and t.device.type in ("cpu", "cuda")
    )


def _check_rng(state: Any, plan: RestorePlan) -> None:
    """Refuse RNG states that ``set_rng_state`` would fail on, trying them on new generators."""
    if not isinstance(state, Mapping):
        plan.fail(f"state[{RNG_KEY!r}]", "the saved RNG states are not a dict")
    try:
        if "python" in state:
            version, internal, gauss = state["python"]
            random.Random().setstate((version, tuple(internal), gauss))
        if "numpy" in state:
            np.random.RandomState().set_state(tuple(state["numpy"]))
        if "torch" in state:
            torch.Generator().set_state(torch.as_tensor(state["torch"]).cpu().clone())
        if "cuda" in state and torch.cuda.is_available():
            cuda = state["cuda"]
            if not isinstance(cuda, (list, tuple)):
                raise TypeError(f"the CUDA states are a {type(cuda).__name__}, not a list")
            # tried on new generators only where CUDA is up already (set_rng_state's are lazy)
            devices = torch.cuda.device_count() if torch.cuda.is_initialized() else 0  # type: ignore[no-untyped-call]
            for i, s in enumerate(cuda[:devices]):
                gen = torch.Generator(device=f"cuda:{i}")
                gen.set_state(torch.as_tensor(s).cpu().clone())
    except (TypeError, ValueError, RuntimeError) as exc:
        plan.fail(f"state[{RNG_KEY!r}]", f"the saved RNG states cannot be set: {exc}")
