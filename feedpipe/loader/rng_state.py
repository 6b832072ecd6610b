"""The RNGs that decide a loader's index order, and how a resume replays them.

Which RNGs. The loader's ``generator=`` (or, without one, torch's global RNG: torch draws the
workers' base seed from it, and its ``RandomSampler`` draws its seed from it), and every
``torch.Generator`` found as ``.generator`` along the sampler chain: the index sampler, its
``.sampler``, that one's ``.sampler`` and so on (``batch_sampler=BatchSampler(RandomSampler(ds,
generator=g))`` is found as ``batch_sampler.sampler``), and any other ``torch.Generator``
attribute of those samplers (``self.rng``, found as ``sampler.rng``). A stateful sampler
(``state_dict`` / ``load_state_dict``) ends the walk: its own state covers it. When the loader
has its own generator but a sampler may draw from the global RNG, the global RNG is recorded too.

Replay without touching the user's RNG. An explicit generator belongs to the loader: its saved
state is set back and the epoch's draws advance it exactly as in the uninterrupted run. The
global RNG belongs to the user (``ckpt``'s ``rng=True`` restores it): the draws the epoch made from
it before the save were already made, so a resumed pass must make none. The sampler's first
draw (where torch's samplers draw from the global RNG) runs with the saved state *lent* to the
global RNG, and the user's state is put back right after it (:func:`replay`); the workers' base
seed comes from a private generator. Samplers run in the thread that calls ``iter``/``next`` on
the loader (torch's and feedpipe's workers alike), so nothing else draws during the loan.

What cannot be replayed is detected, not guessed: a sampler of a class the loader does not know
is watched over its first batches; if numpy's or Python's global RNG moves while it draws, or
torch's global RNG moves after its first batch, its order cannot be reproduced and
``state_dict()`` warns, naming it. So does a sampler holding a numpy or Python RNG object.
"""

from __future__ import annotations

import base64
import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from feedpipe.io.rng_reader import one_reader
from feedpipe.loader import _torch_compat

__all__ = [
    "RngChain",
    "RngStates",
    "Watch",
    "decode",
    "encode",
    "global_state",
    "order",
    "private",
    "replay",
]

_WATCHED_BATCHES = 2  # batches of a pass during which an unknown sampler is watched
_MAX_DEPTH = 16
# samplers whose draws the loader knows: no RNG, a seeded order, or `.generator` (None: the
# global RNG, drawn at the first next() only)
_KNOWN_ITERS = {
    cls.__iter__
    for cls in (
        tud.SequentialSampler,
        tud.RandomSampler,
        tud.SubsetRandomSampler,
        tud.WeightedRandomSampler,
        tud.BatchSampler,
        tud.DistributedSampler,
        _torch_compat.infinite_constant_sampler(),  # an IterableDataset's placeholder
        list,
        tuple,
        range,
    )
}
#: attribute types that are never an RNG: skipped without torch.Generator's isinstance (a
#: Python-level metaclass check, ~1 us, made per attribute of every sampler at every pass)
_PLAIN = frozenset({int, float, bool, str, bytes, type(None), list, tuple, dict, range})
_RANDOM_ITERS = {
    cls.__iter__ for cls in (tud.RandomSampler, tud.SubsetRandomSampler, tud.WeightedRandomSampler)
}


def encode(gen: torch.Generator | None) -> str:
    """A generator's state (the global RNG's for ``None``) as base64 text."""
    return _text(one_reader(torch.get_rng_state) if gen is None else gen.get_state())


def _text(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


class RngStates:
    """The states of a chain's RNGs at an epoch's start (``name: state``), captured raw, one
    ``get_state()`` copy each, and encoded as :func:`encode` text only when a state is first
    written (:meth:`text`, for ``state_dict()``): a pass that saves no state pays no encoding."""

    __slots__ = ("_raw", "_text")

    def __init__(self, raw: dict[str, torch.Tensor | str]) -> None:
        self._raw = raw
        self._text: dict[str, str] | None = None

    @classmethod
    def capture(cls, chain: RngChain) -> RngStates:
        """The states of every RNG along ``chain`` now (the global RNG's for ``None``)."""
        return cls(
            {
                n: one_reader(torch.get_rng_state) if g is None else g.get_state()
                for n, g in chain.generators.items()
            }
        )

    def put(self, name: str, text: str) -> None:
        """Record ``name``'s state as the saved ``text`` instead (a state lent to the sampler)."""
        self._raw[name] = text
        self._text = None

    def text(self) -> dict[str, str]:
        """The states as ``encode`` text, by name (encoded once, then the same dict)."""
        if self._text is None:
            self._text = {n: v if isinstance(v, str) else _text(v) for n, v in self._raw.items()}
        return self._text


def decode(text: str) -> torch.Tensor:
    """The state tensor ``encode`` wrote."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def global_state() -> str:
    """The global torch RNG's state, encoded."""
    return encode(None)


def private(text: str, reseed: bool = False) -> torch.Generator:
    """A fresh CPU generator in the saved state ``text`` (``reseed``: seeded from its next draw
    instead, so that its draws differ from those of the saved state)."""
    gen = torch.Generator()
    gen.set_state(decode(text))
    if reseed:
        gen.manual_seed(int(torch.empty((), dtype=torch.int64).random_(generator=gen).item()) ^ 1)
    return gen


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _known(obj: Any) -> bool:
    if type(obj).__iter__ in _KNOWN_ITERS:
        return True
    from feedpipe.sampler import DistributedSampler

    return isinstance(obj, DistributedSampler)


@dataclass
class RngChain:
    """What a loader's index order draws from (see the module docstring)."""

    generators: dict[str, torch.Generator | None] = field(default_factory=dict)
    global_name: str | None = None  # the name under which the global RNG is recorded, if it is
    custom: list[str] = field(default_factory=list)  # samplers of unknown classes, to watch
    problems: list[str] = field(default_factory=list)  # what the state cannot hold

    @classmethod
    def of(cls, loader: Any) -> RngChain:
        chain = cls(generators={"loader": loader.generator})
        if loader.generator is None:
            chain.global_name = "loader"
        seen = {id(loader.generator)}
        draws_global = False
        for name, obj in _walk(loader):
            gen = getattr(obj, "generator", None)
            label = f"{name} ({type(obj).__name__})"
            if isinstance(gen, torch.Generator):
                if id(gen) not in seen:
                    seen.add(id(gen))
                    chain.generators[name] = gen
            elif type(obj).__iter__ in _RANDOM_ITERS:
                draws_global = True
            elif not _known(obj):
                draws_global = True  # it may draw from the global RNG at its first next()
                chain.custom.append(label)
            for attr, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
                if type(value) in _PLAIN:
                    continue
                if isinstance(value, torch.Generator) and id(value) not in seen:
                    seen.add(id(value))  # a generator under another name (``self.rng``)
                    chain.generators[f"{name}.{attr}"] = value
                if isinstance(value, (np.random.Generator, np.random.RandomState, random.Random)):
                    chain.problems.append(
                        f"{label} holds a {type(value).__name__} in .{attr}, which the state "
                        "does not hold"
                    )
        if draws_global and chain.global_name is None:
            chain.generators["global"] = None
            chain.global_name = "global"
        return chain


def _walk(loader: Any) -> Iterator[tuple[str, Any]]:
    """The index sampler and the samplers it wraps (``.sampler``), named as the loader sees them."""
    obj, seen = _torch_compat.index_sampler(loader), set[int]()
    name = "batch_sampler" if obj is loader.batch_sampler else "sampler"
    while obj is not None and id(obj) not in seen and len(seen) < _MAX_DEPTH:
        seen.add(id(obj))
        yield name, obj
        if _stateful(obj):
            return  # its own state holds its position and randomness
        obj = getattr(obj, "sampler", None)
        name = "sampler" if obj is loader.sampler else f"{name}.sampler"


def order(loader: Any) -> dict[str, Any]:
    """What else fixes which samples a saved batch count covers: the sampler chain's classes
    (with a torch ``DistributedSampler``'s world size: it shards by it and is not elastic), the
    batch size and the dataset's length (``None`` where there is none). A state is loaded only
    into a loader whose ``order`` is the same; a stateful sampler's own state covers its part."""
    samplers = []
    for _, obj in _walk(loader):
        name = type(obj).__name__
        if isinstance(obj, tud.DistributedSampler) and not _stateful(obj):
            name += f"(num_replicas={obj.num_replicas})"
        samplers.append(name)
    try:
        length: int | None = len(loader.dataset)
    except TypeError:
        length = None
    size = getattr(_torch_compat.index_sampler(loader), "batch_size", loader.batch_size)
    return {"samplers": samplers, "batch_size": size, "dataset_length": length}


class Watch:
    """Notes when an unknown sampler draws from an RNG that the state does not hold."""

    def __init__(self, samplers: list[str], found: set[str]) -> None:
        self.samplers = ", ".join(samplers)
        self.found = found

    def snapshot(self, torch_too: bool) -> tuple[Any, ...]:
        np_state = np.random.get_state(legacy=False)
        return (
            one_reader(torch.get_rng_state) if torch_too else None,
            np_state["state"]["key"].copy(),
            np_state["state"]["pos"],
            np_state["has_gauss"],
            random.getstate(),
        )

    def check(self, before: tuple[Any, ...]) -> None:
        after = self.snapshot(before[0] is not None)
        if before[0] is not None and not torch.equal(before[0], after[0]):
            self.found.add(f"{self.samplers} drew from the global torch RNG after its first batch")
        if not np.array_equal(before[1], after[1]) or before[2:4] != after[2:4]:
            self.found.add(f"{self.samplers} drew from numpy's global RNG")
        if before[4] != after[4]:
            self.found.add(f"{self.samplers} drew from Python's global `random` RNG")


def replay(it: Iterator[Any], lend: str | None, watch: Watch | None) -> Iterator[Any]:
    """``it``, with ``lend`` (a saved state) lent to the global RNG for its first ``next()``
    and the user's state put back after it; ``watch`` watches its first batches."""
    for n in range(_WATCHED_BATCHES):
        if watch is None and lend is None:
            break
        user = None
        if lend is not None:
            user = one_reader(torch.get_rng_state)
            one_reader(functools.partial(torch.set_rng_state, decode(lend)))
        before = watch.snapshot(torch_too=n > 0) if watch is not None else None
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            if user is not None:
                one_reader(functools.partial(torch.set_rng_state, user))
                lend = None
            if watch is not None and before is not None:
                watch.check(before)
        yield item
    yield from it
