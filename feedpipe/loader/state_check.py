"""Validation of a ``DataLoader.state_dict()`` before ``load_state_dict`` applies any of it.

A state is small JSON that may have been stored, moved and hand-edited: every field a loader
writes is checked for its type and range, and against the loader it is loaded into (the same
RNGs, the same order-deciding arguments, no more batches than an epoch has), so that a resume
either continues exactly or fails naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from feedpipe.loader.rng_state import private
from feedpipe.loader.skip import SKIP_LIMIT

__all__ = ["STATE_VERSION", "check_state"]

STATE_VERSION = 1
"""The version ``DataLoader.state_dict()`` writes and ``load_state_dict()`` accepts."""


def check_state(
    state: Mapping[str, Any],
    *,
    generators: list[str],
    has_sampler_state: bool,
    iterable: bool,
    epoch_batches: Callable[[], int | None],
    current_order: Mapping[str, Any],
) -> None:
    """Raise ``ValueError`` naming what is wrong if ``state`` cannot be loaded into a loader
    whose order draws from ``generators`` (sorted names), whose sampler holds its own state
    (``has_sampler_state``), whose dataset is iterable, whose epoch has ``epoch_batches()``
    batches (None: unknown) and whose order-deciding arguments are ``current_order``."""
    if not isinstance(state, Mapping):
        raise TypeError(
            "a DataLoader state must be the dict that DataLoader.state_dict() returned, got "
            f"{type(state).__name__}"
        )
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unsupported DataLoader state version {state.get('version')!r}")
    missing = [k for k in ("in_epoch", "batches", "samples", "rng") if k not in state]
    if missing:
        raise ValueError(f"DataLoader state is missing keys {missing}")
    if "sampler" in state and not has_sampler_state:
        raise ValueError("the state holds a sampler state but this loader's sampler has none")
    if iterable and "dataset" not in state:
        raise ValueError("the state holds no dataset position for this IterableDataset")
    _check_rng(state["rng"], generators)
    _check_counts(state, epoch_batches)
    _check_order(state, current_order)
    _check_skipped(state)


def _check_rng(rng: Any, generators: list[str]) -> None:
    if not isinstance(rng, dict):
        raise ValueError(f"DataLoader state: 'rng' must be a dict, got {type(rng).__name__}")
    saved = sorted(rng)
    if saved != generators:
        raise ValueError(
            f"the state holds RNG states for {saved}, but this loader's order draws from "
            f"{generators}: it was saved by a loader with other samplers or generators"
        )
    for name, text in rng.items():
        try:
            private(text)
        except (TypeError, ValueError, RuntimeError) as exc:  # binascii.Error is a ValueError
            raise ValueError(
                f"the state's RNG state for {name!r} is not a torch generator state: {exc}"
            ) from None


def _check_counts(state: Mapping[str, Any], epoch_batches: Callable[[], int | None]) -> None:
    """Refuse counts that no loader writes (a corrupt or hand-edited state)."""
    for key in ("batches", "samples"):
        if type(state[key]) is not int or state[key] < 0:
            raise ValueError(f"DataLoader state: {key!r} must be an int >= 0, got {state[key]!r}")
    if type(state["in_epoch"]) is not bool:
        raise ValueError(f"DataLoader state: 'in_epoch' must be a bool, got {state['in_epoch']!r}")
    if state.get("rng_at", "iter") not in ("iter", "sampler"):
        raise ValueError(f"DataLoader state: unknown 'rng_at' {state['rng_at']!r}")
    if "sampler" in state or not state["in_epoch"]:
        return  # a stateful sampler holds the position itself
    total = epoch_batches()
    if total is not None and state["batches"] > total:
        raise ValueError(
            f"the state says {state['batches']} batches of the epoch were delivered, but an "
            f"epoch of this loader has {total}"
        )


def _check_order(state: Mapping[str, Any], ours: Mapping[str, Any]) -> None:
    """Refuse a state whose batch count would skip other samples in this loader."""
    saved = state.get("order")
    if saved is None:  # a state written before the order was recorded
        return
    if not isinstance(saved, dict):
        raise ValueError(f"DataLoader state: 'order' must be a dict, got {type(saved).__name__}")
    for key, value in ours.items():
        if key == "batch_size" and "sampler" in state:
            continue  # the stateful sampler counts samples, not batches
        if saved.get(key) != value:
            raise ValueError(
                f"the state was saved by a loader with {key} {saved.get(key)!r}, but this "
                f"loader has {value!r}: resuming would skip or repeat other samples"
            )


def _check_skipped(state: Mapping[str, Any]) -> None:
    """Refuse an ``on_error="skip"`` state part that no loader writes."""
    part = state.get("skipped")
    if part is None:
        return
    ok = isinstance(part, dict) and all(
        isinstance(part.get(k), list) and all(type(i) is int and i >= 0 for i in part[k])
        for k in ("known", "epoch")
    )
    if not ok:
        raise ValueError(
            "DataLoader state: 'skipped' must be {'known': [int, ...], 'epoch': [int, ...]}"
        )
    if len(part["known"]) + len(part["epoch"]) > 2 * SKIP_LIMIT:
        raise ValueError(f"DataLoader state: 'skipped' holds more than {SKIP_LIMIT} indices")
