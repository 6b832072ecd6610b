"""``Resume``: a loader's resume bookkeeping, between ``load_state_dict()`` and the pass it
applies to, and the state ``state_dict()`` writes.

It owns the pending state (loaded, applied at the next ``iter()``), the RNG replay that
pending state arms (states to set at the sampler's first draw, a state to lend the global RNG
then, a private generator for the workers' base seed: ``feedpipe.loader.rng_state``), the RNG
draws a state cannot hold (``state_dict()`` warns about them) and the
:class:`~feedpipe.loader.skip.SkipLedger` of ``on_error="skip"``. It holds no reference to
the loader: the loader passes what a call needs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from feedpipe.loader.loader_pass import Epoch
from feedpipe.loader.rng_state import (
    RngChain,
    RngStates,
    Watch,
    encode,
    global_state,
    private,
    replay,
)
from feedpipe.loader.skip import SkipLedger

__all__ = ["Resume", "rng_now", "sampler_state", "set_rng", "stateful_sampler", "warn_uncaptured"]

Wrap = Callable[[Iterator[Any]], Iterator[Any]]


def rng_now(chain: RngChain) -> dict[str, str]:
    """The states of every RNG along ``chain``, encoded."""
    return {name: encode(g) for name, g in chain.generators.items()}


def set_rng(chain: RngChain, states: dict[str, str]) -> None:
    """Set the loader's own generators; the global RNG is the user's and is never set."""
    for name, gen in chain.generators.items():
        if gen is not None and name in states:
            gen.set_state(private(states[name]).get_state())


def stateful_sampler(loader: Any) -> Any:
    """The first sampler along the loader's chain with ``state_dict``/``load_state_dict``."""
    for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None), loader.batch_sampler):
        if callable(getattr(s, "state_dict", None)) and callable(
            getattr(s, "load_state_dict", None)
        ):
            return s
    return None


def sampler_state(sampler: Any, epoch: Epoch) -> dict[str, Any]:
    """A stateful sampler's part of the loader state, counted by the loader's epoch."""
    sub = dict(sampler.state_dict())
    if epoch.active:
        sub["consumed"] = epoch.samples
    elif "consumed_base" in sub:  # feedpipe's DistributedSampler at an epoch boundary: the
        # next iter() starts a fresh pass (of the same epoch unless set_epoch() changes it), as
        # torch's sampler does, whatever the last pass consumed
        sub.update(consumed=0, consumed_base=0, segment_start=0)
        sub["num_replicas"] = getattr(sampler, "num_replicas", sub["num_replicas"])
    return sub


def warn_uncaptured(problems: list[str]) -> None:
    """``state_dict()``'s warning: RNGs that decide the order but that the state cannot hold."""
    if not problems:
        return
    warnings.warn(
        "DataLoader.state_dict() cannot hold every RNG that decides the order: "
        f"{'; '.join(problems)}. A resume from this state will not reproduce the order "
        "(with thread workers, a dataset drawing from a global RNG while the sampler "
        "draws is reported here too). "
        "Give the sampler a torch.Generator as `.generator` (and draw only from it), or "
        "state_dict()/load_state_dict() methods.",
        RuntimeWarning,
        stacklevel=3,
    )


class Resume:
    """A loader's resume bookkeeping (module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None  # loaded, applied at the next iter()
        self.ledger = SkipLedger()
        self.uncaptured: set[str] = set()  # RNG draws the state cannot hold (state_dict warns)
        self._restore_rng: dict[str, str] | None = None  # set at the sampler's first draw
        self._lend: str | torch.Generator | None = None  # lent to the global RNG then
        self._seed_gen: torch.Generator | None = None  # the private base-seed generator
        # what begin() decided for the pass it starts
        self.skip = 0  # index batches to skip without reading them
        self.drop: frozenset[int] = frozenset()  # known-bad samples the stream drops
        self.lent: str | None = None  # the global RNG state lent at iter(), if any

    def begin(
        self, last: Epoch, chain: Callable[[], RngChain], at_sampler_ok: bool, own_gen: bool
    ) -> Epoch:
        """Apply the pending state (if any) at ``iter()``: a fresh epoch, its counts, and the
        RNG replay armed. Returns the epoch; :attr:`skip`, :attr:`drop` and :attr:`lent` say
        what else the pass starts with.

        A saved RNG state applies at one of two points (``rng_at``): just before the sampler's
        first draw (mid-epoch, or between epochs when persistent workers draw no new base seed;
        ``at_sampler_ok``: the loader has an index stream to hook), or at ``iter()``, before
        torch draws the workers' base seed. Either way the resumed epoch's index order, and the
        state of the loader's own generators after it, are those of the uninterrupted run. The
        global RNG's saved state is only lent to the sampler's first draw (mid-epoch always; at
        an epoch boundary when the user's global RNG is not in that state already, else the
        epoch draws from it as the uninterrupted run did). ``own_gen``: the loader has its own
        ``generator=``, which draws the base seed. ``chain`` makes the loader's ``RngChain``
        (a walk of the sampler chain), called only with a pending state.
        """
        pending, self.pending = self.pending, None
        self.drop = self.ledger.begin_epoch(last.skipped, pending)
        epoch = Epoch(resumed=pending)
        self._restore_rng, self._lend, self._seed_gen = None, None, None
        self.lent, self.skip = None, 0
        if pending is not None:
            self.lent = self._arm(pending, chain(), at_sampler_ok)
            if own_gen:
                self._seed_gen = None
            self.skip = epoch.resume_from(pending)
        return epoch

    def _arm(self, pending: dict[str, Any], chain: RngChain, at_sampler_ok: bool) -> str | None:
        """Arm the RNG replay of ``pending``; the global RNG state lent at ``iter()``, if any."""
        rng: dict[str, str] = pending["rng"]
        at_sampler = pending.get("rng_at") == "sampler" and at_sampler_ok
        if at_sampler:
            self._restore_rng = rng
        else:
            set_rng(chain, rng)
        saved = rng.get(chain.global_name) if chain.global_name else None
        # lend mid-epoch (the draws were made before the save), or at a boundary when the
        # user's RNG is not where the saved one was (else draw from it, as saved)
        lend = saved is not None and (pending["in_epoch"] or global_state() != saved)
        if saved is None:
            return None
        if at_sampler:  # the base seed (if any now) was not drawn there: draw it privately
            self._lend = lent = saved if lend else None
            self._seed_gen = private(saved, reseed=True)
            return lent
        if lend:  # the base seed and the sampler's draws follow from the saved state
            self._lend = self._seed_gen = private(saved)
            return saved
        return None

    def seed_generator(self, default: torch.Generator | None) -> torch.Generator | None:
        """The generator this pass draws the workers' base seed from (torch: ``generator=``)."""
        gen, self._seed_gen = self._seed_gen, None
        return gen if gen is not None else default

    def at_sampler_start(self, chain: RngChain, epoch: Epoch) -> Wrap | None:
        """Runs before the sampler's first draw of a pass: restore, then record, the RNG.

        Returns how to wrap the pass's index iterator: lend the global RNG the saved state for
        the first draw, watch samplers of unknown classes (``feedpipe.loader.rng_state.replay``)."""
        if self._restore_rng is not None:
            set_rng(chain, self._restore_rng)
            self._restore_rng = None
        lend, self._lend = self._lend, None
        lent = encode(lend) if isinstance(lend, torch.Generator) else lend
        epoch.rng = RngStates.capture(chain)
        if lent is not None and chain.global_name:
            epoch.rng.put(chain.global_name, lent)
        watch = Watch(chain.custom, self.uncaptured) if chain.custom else None
        if lent is None and watch is None:
            return None
        return lambda it: replay(it, lent, watch)
