"""Headspace: the share of step time the input costs, measured by removing the input.

:func:`headspace` runs the user's training step twice, for the same number of steps:

1. **cached**: the first ``cache`` batches of one pass over the loader are copied (onto
   ``device`` when given, else where the loader delivered them) and the step cycles over them.
   No read, no collation, no copy to the device: the step time with instant input. Each step
   gets containers of its own around the cached tensors; a step that changes a cached tensor in
   place is a :class:`HeadspaceError` after the run (it was fed changed batches);
2. **live**: a fresh pass over the loader, as training would run it, with the loader's stall
   counters (``loader.meter``) reset after the warm-up so that they describe the measured steps.

The input's share of step time is ``1 - cached / live`` (0 when the live steps were not slower:
a difference within noise is no input cost). The answer names the slowest input stage from the
live run's counters (:attr:`feedpipe.stall.StallStats.slowest_stage`).

Measurement rules: the first ``warmup`` steps of each run are excluded (worker start-up, the
allocator, autotuners, the first page-cache reads); the clock is read at the run's boundaries
only, after ``torch.cuda.synchronize()`` when CUDA is initialised, so queued GPU work counts
where it was queued. A live run longer than an epoch goes on into the next epoch (a new pass).

What it does to the loader: it runs its own passes (``iter(loader)`` twice or more) and drops
them. Where the loader can save its position (``feedpipe.DataLoader.state_dict()``), the position
is saved before and loaded back after, so a later ``for batch in loader`` gives the batches it
would have given without the measurement; the loader's meter gets its counters back too. The
step itself is the user's: a step that updates a model trains it on the measured batches.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from feedpipe.io.values import integer
from feedpipe.stall.stats import StallStats

__all__ = ["STAGE_NAMES", "HeadspaceError", "HeadspaceResult", "headspace"]

_perf = time.perf_counter

#: How the answer names each stage of the stall counters.
STAGE_NAMES: dict[str, str] = {
    "fetch": "the dataset's read (fetch)",
    "decode": "decoding (decode)",
    "collate": "collation (collate)",
    "pin": "pinning host memory (pin)",
    "h2d": "the copy to the device (h2d)",
}


class HeadspaceError(RuntimeError):
    """The step raised, the loader gave no batch, or the arguments cannot be measured."""


@dataclasses.dataclass(frozen=True)
class HeadspaceResult:
    """One measurement: mean seconds per step on cached batches and on the live loader.

    ``input_share`` is ``max(0, 1 - cached_step_s / live_step_s)``; ``slowest_stage`` and
    ``stats`` come from the live run's stall counters (``None`` for a loader without a meter).
    """

    cached_step_s: float
    live_step_s: float
    input_share: float
    slowest_stage: str | None
    stats: StallStats | None
    steps: int
    cached_batches: int

    def answer(self) -> str:
        """The one-line answer: what the input costs and which stage is the slowest."""
        head = (
            f"input costs {100 * self.input_share:.0f}% of step time "
            f"({_ms(self.live_step_s)} per step live, {_ms(self.cached_step_s)} on cached batches)"
        )
        if self.stats is None:
            return f"{head}; no stall counters (the loader has no feedpipe meter)"
        if self.slowest_stage is None:
            return f"{head}; no stage times were reported"
        name = STAGE_NAMES.get(self.slowest_stage, self.slowest_stage)
        return f"{head}; {name} is the slowest stage"

    def table(self) -> str:
        """A short table: both runs, the share and the live run's stall counters beside it."""
        rows = [
            ("cached batches", f"{_ms(self.cached_step_s)} per step"),
            ("live loader", f"{_ms(self.live_step_s)} per step"),
            ("input share", f"{100 * self.input_share:.1f}% of step time"),
            ("steps", f"{self.steps} per run after warm-up, {self.cached_batches} cached"),
        ]
        s = self.stats
        if s is not None:
            rows.append(("stall (meter)", f"{100 * s.stall_fraction:.1f}% of the live run"))
            if s.device_idle_fraction is not None:
                rows.append(("device idle", f"{100 * s.device_idle_fraction:.1f}% for input"))
            for stage, st in s.stages.items():
                mark = "  <- slowest" if stage == s.slowest_stage else ""
                rows.append((f"  {stage}", f"{_ms(st.effective_s)} per batch (effective){mark}"))
        return "\n".join(f"  {k:<16}{v}" for k, v in rows)

    def __str__(self) -> str:
        return f"{self.answer()}\n{self.table()}"


def headspace(
    step_fn: Callable[[Any], Any],
    loader: Iterable[Any],
    *,
    steps: int = 50,
    warmup: int = 5,
    cache: int = 10,
    device: Any = None,
) -> HeadspaceResult:
    """Measure the share of step time ``loader`` costs ``step_fn``; see the module docstring.

    Args:
      step_fn: one training step, called with one batch; its return value is ignored.
      loader: a ``feedpipe.DataLoader`` (any iterable of batches works; without a meter the
        result has no stall counters).
      steps: measured steps of each run (the same in both).
      warmup: steps run first in each run and not measured.
      cache: batches copied for the cached run (fewer if an epoch is shorter).
      device: where the cached batches are kept (``"cuda"``: the step's device), default where
        the loader delivers them.
    """
    counts = {"steps": steps, "warmup": warmup, "cache": cache}
    if any(not integer(v) for v in counts.values()) or steps < 1 or warmup < 0 or cache < 1:
        raise HeadspaceError(
            "need integers steps >= 1, warmup >= 0 and cache >= 1; got "
            + ", ".join(f"{k}={v!r}" for k, v in counts.items())
        )
    _check_device(device)
    meter = getattr(loader, "meter", None)
    with _loader_kept(loader, meter):
        batches = _first_batches(loader, cache, device)
        n_cached = len(batches)
        pristine = [_copy(b, "cpu") for b in batches]  # to tell a step that changes its batch
        cached = _run(step_fn, _cycle_list(batches), steps=steps, warmup=warmup, phase="cached")
        _check_unchanged(step_fn, batches, pristine)
        del batches, pristine
        epochs = _epochs(loader)
        try:
            live = _run(step_fn, epochs, steps=steps, warmup=warmup, phase="live", meter=meter)
            stats = meter.stats() if meter is not None else None
        finally:
            epochs.close()
    share = max(0.0, 1.0 - cached / live) if live > 0 else 0.0
    slowest = stats.slowest_stage if stats is not None else None
    return HeadspaceResult(cached / steps, live / steps, share, slowest, stats, steps, n_cached)


def _check_device(device: Any) -> None:
    """Refuse, before any pass, a ``device`` that is none or cannot be had here."""
    if device is None:
        return
    import torch

    try:
        where = torch.device(device)
        torch.empty(0, device=where)  # CUDA missing or a bad ordinal: raises here
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        raise HeadspaceError(
            f"device={device!r} cannot hold the cached batches here: {type(exc).__name__}: {exc}"
        ) from exc


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _step_name(step_fn: Callable[[Any], Any]) -> str:
    return str(getattr(step_fn, "__qualname__", None) or repr(step_fn))


def _run(
    step_fn: Callable[[Any], Any],
    batches: Iterator[Any],
    *,
    steps: int,
    warmup: int,
    phase: str,
    meter: Any = None,
) -> float:
    """Seconds for ``steps`` steps after ``warmup``, the clock read after a device sync."""
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if meter is not None:
                meter.reset()
            _sync()
            start = _perf()
        batch = next(batches)
        try:
            step_fn(batch)
        except Exception as exc:
            when = "warm-up step" if i < warmup else "step"
            raise HeadspaceError(
                f"step_fn {_step_name(step_fn)} raised on {when} {i + 1} of the "
                f"{phase} run ({type(exc).__name__}: {exc})"
            ) from exc
    _sync()
    return _perf() - start


def _sync() -> None:
    """Wait for queued CUDA work, where CUDA is in use (never initialises it)."""
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def _first_batches(loader: Iterable[Any], k: int, device: Any) -> list[Any]:
    """Copies of the first ``k`` batches of one pass (the pass is dropped after)."""
    out: list[Any] = []
    it = iter(loader)
    for batch in it:
        out.append(_copy(batch, device))
        if len(out) == k:
            break
    del it
    if not out:
        raise HeadspaceError(f"the loader ({type(loader).__name__}) gave no batch")
    return out


def _copy(batch: Any, device: Any) -> Any:
    """A copy of ``batch`` that holds none of the loader's buffers, on ``device`` if given."""
    import torch

    if isinstance(batch, torch.Tensor):
        if device is not None:
            return batch.to(device, copy=True)
        if batch.device.type == "cpu" and batch.is_pinned():
            return torch.empty_like(batch, pin_memory=True).copy_(batch)
        return batch.clone()
    if isinstance(batch, Mapping):
        return {k: _copy(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_copy(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_copy(v, device) for v in batch)
    return batch


def _cycle_list(batches: list[Any]) -> Iterator[Any]:
    """The cached batches over and over, each step given containers of its own (a step that
    pops a key or replaces an entry, ``batch["x"] = batch["x"].cuda()``, changes only its own)."""
    while True:
        for batch in batches:
            yield _containers(batch)


def _containers(batch: Any) -> Any:
    """``batch`` with new dicts, lists and tuples around the same tensors (no copy of data)."""
    if isinstance(batch, Mapping):
        return {k: _containers(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_containers(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_containers(v) for v in batch)
    return batch


def _check_unchanged(
    step_fn: Callable[[Any], Any], batches: list[Any], pristine: list[Any]
) -> None:
    """Raise if the cached run's step changed a cached batch's tensors in place: the run then
    fed it changed batches (values growing each cycle), so its time is not the step's."""
    import torch

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            a = a.detach().to("cpu")
            return a.shape == b.shape and torch.equal(_bits(a), _bits(b))
        if isinstance(a, Mapping):
            return all(same(v, b[k]) for k, v in a.items())
        if isinstance(a, (list, tuple)):
            return all(same(x, y) for x, y in zip(a, b, strict=True))
        return True

    for k, (batch, kept) in enumerate(zip(batches, pristine, strict=True)):
        if not same(batch, kept):
            raise HeadspaceError(
                f"step_fn {_step_name(step_fn)} changed cached batch {k + 1} in place (a "
                "tensor's values): the cached run fed it changed batches, so its time is not "
                "the step's; let the step leave its batch's tensors as they were (clone what it "
                "changes in place) and measure again"
            )


def _bits(t: Any) -> Any:
    """The tensor's bytes (NaN equals NaN), as one flat uint8 tensor."""
    import torch

    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def _epochs(loader: Iterable[Any]) -> Generator[Any, None, None]:
    """Batches of fresh passes over ``loader``, one epoch after another (the cache's pass came
    first: a loader that gives nothing on a later pass is one-shot, and the error says so)."""
    passes = 1
    while True:
        passes += 1
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise HeadspaceError(
                f"the loader ({type(loader).__name__}) gave no batch on pass {passes} (the "
                "first pass gave the cached batches): headspace iterates it again for the live "
                "run, which a one-shot iterable (a generator, an iterator, an IterableDataset "
                "over one) cannot give; pass a loader that can be iterated again"
            )


@contextmanager
def _loader_kept(loader: Any, meter: Any) -> Iterator[None]:
    """Give the loader its position and its meter its counters back after the measurement."""
    position = _position(loader)
    counters = meter.state_dict() if callable(getattr(meter, "state_dict", None)) else None
    try:
        yield
    finally:
        if position is not None:
            loader.load_state_dict(position)
        if counters is not None:
            meter.load_state_dict(counters)


def _position(loader: Any) -> dict[str, Any] | None:
    """The loader's resume state, or None where it has none (a torch loader, an iterable
    dataset without ``state_dict``, out-of-order delivery)."""
    if not callable(getattr(loader, "state_dict", None)):
        return None
    if not callable(getattr(loader, "load_state_dict", None)):
        return None
    with warnings.catch_warnings():  # an uncaptured RNG: the position is still the best kept
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            state: dict[str, Any] = loader.state_dict()
        except ValueError:
            return None
    return state
