"""Overlapped saves: the device-to-host copies run while training goes on (issue 27 item 1).

With ``CheckpointManager(..., overlap=True)`` a save does not wait for its copies. What waits
for what (docs/overlap.md):

- the copies run on one side stream per device that first waits for the caller's current
  stream (``ckpt.saving.plan``), so they read every value the training loop queued before
  ``save``; an event recorded after them says when they are done;
- small CUDA tensors (at most ``CLONE_BYTES`` each, ``CLONE_TOTAL`` together: BatchNorm
  statistics, counters, biases, the optimizer's step counts) are first cloned on the caller's
  stream, device to device, and the copies read the clones: whatever the next forward changes
  in them comes after the clone in stream order, with no wait at all;
- every optimizer in the state gets a one-shot step pre-hook (``register_step_pre_hook``) that
  makes the current stream wait for the events (on the GPU; the host never blocks) and then
  removes itself; so does every module in the state that holds a larger buffer (a forward
  pre-hook), which covers buffers changed by a forward. An optimizer not in the state (a state
  of ``model.state_dict()``) is covered by a step pre-hook of every optimizer
  (``register_optimizer_step_pre_hook``) that waits the same way and removes itself once a
  step finds every copy done;
- a ``GradScaler``'s ``state_dict`` reads its scale with ``.item()`` (a host sync, torch's own):
  its values are host numbers when ``save`` returns, so its ``update`` needs no wait, and its
  ``step`` runs the optimizer's step, which waits;
- ``wait_for_snapshot()`` makes the current stream wait (``host=True``: the host) for every
  copy in flight; ``editing()`` is that as a context manager, for code that changes tensors in
  place outside an optimizer step or a forward;
- the persist thread waits for the events before it writes the buffer, and the job keeps the
  sources alive until then (the caching allocator cannot hand their memory to anything else).

A CPU state has no device copies: there are no events and nothing is hooked; the snapshot is
taken before ``save`` returns, as without overlap.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ckpt.saving.flatten import Leaf

__all__ = ["CLONE_BYTES", "CLONE_TOTAL", "Overlap", "SnapshotEvent", "owners"]

CLONE_BYTES = 64 << 10
"""CUDA leaves up to this size are cloned on the caller's stream before the copies."""
CLONE_TOTAL = 64 << 20
"""The most device memory the clones of one save take together (the rest is hooked)."""


class SnapshotEvent(Protocol):
    """A point after a save's copies on one device: ``wait`` makes the caller's current stream
    wait for it (on the GPU), ``synchronize`` makes the host wait, ``query`` says if it passed."""

    def wait(self) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class CudaEvent:
    """A ``torch.cuda.Event`` recorded on a side stream of ``device`` (a ``SnapshotEvent``)."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self) -> None:
        """Make the current stream of the event's device wait for it (the host goes on)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the copies before the event are done."""
        self.event.synchronize()

    def query(self) -> bool:
        """Whether the copies before the event are done."""
        return bool(self.event.query())


def _inert(*args: Any) -> None:
    """What an armed hook becomes in a pickled or deep-copied object: nothing."""
    return None


class _OneShot:
    """A hook that runs ``fire`` once and removes itself (via ``remove``); pickled or copied
    (with the object it hooks), it becomes ``_inert``."""

    def __init__(self, fire: Callable[[], None], remove: Callable[[], None]) -> None:
        self.fire, self.remove = fire, remove

    def __call__(self, *args: Any) -> None:
        self.remove()
        self.fire()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert_hook, ()


def _inert_hook() -> Callable[..., None]:
    return _inert


def owners(state: Any, depth: int = 0) -> Iterator[Any]:
    """The optimizers and modules in ``state`` (a dict/list/tuple of them, nested), each once
    in order; tensors and other values are skipped without a look inside."""
    if isinstance(state, (torch.optim.Optimizer, torch.nn.Module)):
        yield state
    elif isinstance(state, dict) and depth < 8:
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                yield from owners(value, depth + 1)
    elif isinstance(state, (list, tuple)) and depth < 8:
        for value in state:
            if not isinstance(value, torch.Tensor):
                yield from owners(value, depth + 1)


def _hooked_modules(module: torch.nn.Module, devices: frozenset[str]) -> list[torch.nn.Module]:
    """The modules under ``module`` holding a buffer on ``devices`` larger than ``CLONE_BYTES``
    (not cloned: a forward that changes it must wait for the copies)."""
    found = []
    for sub in module.modules():
        for buf in sub.buffers(recurse=False):
            if buf.device.type in devices and buf.numel() * buf.element_size() > CLONE_BYTES:
                found.append(sub)
                break
    return found


class Overlap:
    """The events of the saves in flight and the one-shot hooks that wait for them (module
    docstring). ``armed`` is the number of hooks registered now. ``devices``: the device types
    whose tensors the copies read asynchronously (``cuda``; tests name ``cpu``). ``enabled``:
    whether saves overlap (``CheckpointManager(overlap=)``); the waits work either way."""

    def __init__(self, devices: frozenset[str] = frozenset({"cuda"}), enabled: bool = True) -> None:
        self.devices, self.enabled = devices, enabled
        self._events: dict[Any, SnapshotEvent] = {}  # per device: the newest save's event
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._global: Any = None  # the step pre-hook of every optimizer, while copies run
        self._mutex = threading.Lock()

    @property
    def armed(self) -> int:
        """How many hooks are registered now."""
        with self._mutex:
            return len(self._hooks) + (self._global is not None)

    def prepare(self, leaves: Sequence[Leaf]) -> list[Any]:
        """Clone the small CUDA leaves on the caller's stream (their values become the
        clones); returns the sources the copies read, to keep alive until they are done."""
        left, devices = CLONE_TOTAL, self.devices
        with torch.no_grad():
            for leaf in leaves:
                value, n = leaf.value, leaf.nbytes
                small = 0 < n <= min(CLONE_BYTES, left)
                if small and isinstance(value, torch.Tensor) and value.device.type in devices:
                    leaf.value = value.clone(memory_format=torch.preserve_format)
                    left -= n
        return [leaf.value for leaf in leaves]

    def arm(self, state: Any, events: Mapping[Any, SnapshotEvent]) -> None:
        """Remember the newest ``events`` (device -> event) and hook every optimizer and every
        module with a large buffer in ``state`` that is not hooked yet."""
        if not events:
            return
        with self._mutex:
            self._events.update(events)
            if self._global is None:
                self._global = register_optimizer_step_pre_hook(self._any_step)
        for owner in owners(state):
            if isinstance(owner, torch.optim.Optimizer):
                self._hook(owner, owner.register_step_pre_hook)
            else:
                for module in _hooked_modules(owner, self.devices):
                    self._hook(module, module.register_forward_pre_hook)

    def _any_step(self, *args: Any) -> None:
        """Before any optimizer's step (one not in the state too): wait for the copies; once
        they have all passed, this hook removes itself."""
        self.wait_for_snapshot()
        with self._mutex:
            handle = self._global if not self._events else None
            if handle is not None:
                self._global = None
        if handle is not None:
            handle.remove()

    def _hook(self, target: Any, register: Callable[[Any], Any]) -> None:
        ref = weakref.ref(target)
        with self._mutex:
            if target in self._hooks:
                return  # hooked once: it waits for the newest events when it fires
            hook = _OneShot(self.wait_for_snapshot, lambda: self._unhook(ref))
            self._hooks[target] = register(hook)

    def _unhook(self, ref: weakref.ref[Any]) -> None:
        target = ref()
        with self._mutex:
            handle = self._hooks.pop(target, None) if target is not None else None
        if handle is not None:
            handle.remove()

    def wait_for_snapshot(self, host: bool = False) -> None:
        """Make the current stream (``host=True``: the host) wait for every save's copies in
        flight; events that have passed are dropped."""
        with self._mutex:
            events = list(self._events.items())
        for key, event in events:
            if host:
                event.synchronize()
            elif not event.query():
                event.wait()
                continue
            with self._mutex:
                if self._events.get(key) is event:
                    del self._events[key]

    @contextmanager
    def editing(self) -> Iterator[None]:
        """``with overlap.editing():`` in-place changes inside come after the copies."""
        self.wait_for_snapshot()
        yield

    def close(self) -> None:
        """Wait (host) for the copies in flight and remove every hook."""
        self.wait_for_snapshot(host=True)
        with self._mutex:
            targets, handle, self._global = list(self._hooks), self._global, None
        for target in targets:
            self._unhook(weakref.ref(target))
        if handle is not None:
            handle.remove()
