"""A distributed stall summary: every rank's counters, gathered with torch.distributed.

``gather_stats`` is a collective (``all_gather_object``) over a process group (default: the
world); every rank of the group must call it at the same point. :class:`DistributedSink` calls it
every ``every_steps`` batches, so it is step-based only (a time-based collective could make ranks
disagree on when to gather and hang). The slowest rank is the one with the largest stall
fraction: under synchronous data parallelism it is the rank whose input holds everyone back.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from feedpipe.stall.sinks import Sink

if TYPE_CHECKING:  # pragma: no cover
    from feedpipe.stall.stats import StallStats

__all__ = ["DistributedSink", "DistributedSummary", "gather_stats"]


@dataclasses.dataclass(frozen=True)
class DistributedSummary:
    """Per-rank stats (``stats[i]`` belongs to global rank ``ranks[i]``) and the slowest rank."""

    ranks: list[int]
    stats: list[StallStats]
    slowest_rank: int
    slowest_stall_fraction: float
    median_stall_fraction: float
    gap: float  # slowest minus median stall fraction
    gap_s: float  # slowest minus median stalled seconds

    def line(self) -> str:
        """One line naming the slowest rank and its distance from the median."""
        rates = [s.samples_per_s for s in self.stats]
        outside = [s.outside_s for s in self.stats]
        return (
            f"{len(self.ranks)} ranks: slowest is rank {self.slowest_rank}, stalled "
            f"{100 * self.slowest_stall_fraction:.1f}% vs median "
            f"{100 * self.median_stall_fraction:.1f}% ({100 * self.gap:+.1f} points, "
            f"{self.gap_s:+.3g} s); samples/s per rank {min(rates):.4g}..{max(rates):.4g}; "
            f"outside iteration {min(outside):.3g}..{max(outside):.3g} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gather_stats(stats: StallStats, group: Any = None) -> DistributedSummary:
    """Collective: all-gather ``stats`` from every rank of ``group`` and summarise them."""
    import torch.distributed as dist

    from feedpipe.stall.stats import StallStats

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "gather_stats needs an initialised torch.distributed process group "
            "(call torch.distributed.init_process_group first)"
        )
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, stats.to_dict(), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    all_stats = [StallStats.from_dict(d) for d in gathered]
    fractions = [s.stall_fraction for s in all_stats]
    worst = max(range(world), key=lambda i: (fractions[i], -i))
    median = statistics.median(fractions)
    median_s = statistics.median(s.stall_s for s in all_stats)
    return DistributedSummary(
        ranks=list(ranks),
        stats=all_stats,
        slowest_rank=ranks[worst],
        slowest_stall_fraction=fractions[worst],
        median_stall_fraction=median,
        gap=fractions[worst] - median,
        gap_s=all_stats[worst].stall_s - median_s,
    )


class DistributedSink(Sink):
    """Gather a :class:`DistributedSummary` every ``every_steps`` batches (collective).

    Every rank must attach one with the same ``every_steps`` and see the same number of batches.
    The summary is logged on global rank ``log_rank`` (``None``: every rank), passed to
    ``callback`` on every rank, and kept as :attr:`last`. No gather happens on ``close``.
    """

    def __init__(
        self,
        every_steps: int,
        *,
        group: Any = None,
        logger: logging.Logger | None = None,
        level: int = logging.INFO,
        log_rank: int | None = 0,
        callback: Callable[[DistributedSummary], None] | None = None,
    ) -> None:
        super().__init__(None, every_steps)
        self.group = group
        self.logger = logger or logging.getLogger("feedpipe.stall")
        self.level = level
        self.log_rank = log_rank
        self.callback = callback
        self.last: DistributedSummary | None = None

    def write(self, stats: StallStats) -> None:
        import torch.distributed as dist

        summary = gather_stats(stats, self.group)
        self.last = summary
        if self.log_rank is None or dist.get_rank() == self.log_rank:
            self.logger.log(self.level, "feedpipe: %s", summary.line())
        if self.callback is not None:
            self.callback(summary)

    def close(self, stats: StallStats | None = None) -> None:
        """No final gather: ranks may close at different times."""
