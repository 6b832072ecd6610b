"""A distributed stall summary: every rank's key counters, gathered with torch.distributed.

``gather_stats`` is a collective over a process group (default: the world); every rank of the
group must call it at the same point. Each rank packs a fixed-size record (:data:`RECORD_BYTES`
bytes: the numbers of :class:`RankStats` and the name of its slowest stage) and the group runs
**one** ``all_gather`` of that record: no pickling, no size exchange, and a cost that does not
depend on how many stages or regions a rank reports. At 10,000 ranks each rank receives
10,000 x :data:`RECORD_BYTES` bytes (about 1.5 MB) per call.

:class:`DistributedSink` calls it every ``every_steps`` batches, so it is step-based only (a
time-based collective could make ranks disagree on when to gather and hang). The slowest rank is
the one with the largest stall fraction: under synchronous data parallelism it is the rank whose
input holds everyone back; the summary names it and its slowest stage.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from feedpipe.stall.sinks import Sink

if TYPE_CHECKING:  # pragma: no cover
    from feedpipe.stall.stats import StallStats

__all__ = ["RECORD_BYTES", "DistributedSink", "DistributedSummary", "RankStats", "gather_stats"]

_NUMBERS = (
    "stall_s",
    "step_s",
    "wall_s",
    "outside_s",
    "stall_fraction",
    "batches",
    "samples",
    "bytes",
    "samples_per_s",
    "wait_p50_s",
    "wait_p99_s",
    "wait_max_s",
    "device_idle_s",
    "device_idle_fraction",
    "slowest_stage_s",
)
_NAME_BYTES = 32  # the slowest stage's name, UTF-8, cut to this length
_RECORD = struct.Struct(f"<{len(_NUMBERS)}d{_NAME_BYTES}s")

#: Bytes each rank contributes to one gather (fixed: it never depends on the stats' content).
RECORD_BYTES = _RECORD.size


@dataclasses.dataclass(frozen=True)
class RankStats:
    """One rank's counters as gathered (a subset of :class:`~feedpipe.stall.StallStats`).

    ``slowest_stage_s`` is that stage's effective seconds per batch; ``device_idle_s`` and
    ``device_idle_fraction`` are ``None`` when the rank does not feed a CUDA device.
    ``batches``, ``samples`` and ``bytes`` are exact below 2**53.
    """

    rank: int
    stall_s: float
    step_s: float
    wall_s: float
    outside_s: float
    stall_fraction: float
    batches: int
    samples: int
    bytes: int
    samples_per_s: float
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    device_idle_s: float | None
    device_idle_fraction: float | None
    slowest_stage: str | None
    slowest_stage_s: float


def _pack(s: StallStats) -> bytes:
    stage = s.slowest_stage
    values = [
        s.stall_s,
        s.step_s,
        s.wall_s,
        s.outside_s,
        s.stall_fraction,
        s.batches,
        s.samples,
        s.bytes,
        s.samples_per_s,
        s.wait_p50_s,
        s.wait_p99_s,
        s.wait_max_s,
        math.nan if s.device_idle_s is None else s.device_idle_s,
        math.nan if s.device_idle_fraction is None else s.device_idle_fraction,
        s.stages[stage].effective_s if stage is not None else 0.0,
    ]
    name = (stage or "").encode("utf-8")[:_NAME_BYTES]
    return _RECORD.pack(*map(float, values), name)


def _unpack(rank: int, raw: bytes) -> RankStats:
    *values, name = _RECORD.unpack(raw)
    d = dict(zip(_NUMBERS, values, strict=True))
    for key in ("batches", "samples", "bytes"):
        d[key] = int(d[key])
    for key in ("device_idle_s", "device_idle_fraction"):
        if math.isnan(d[key]):
            d[key] = None
    stage = name.rstrip(b"\0").decode("utf-8", "replace") or None
    return RankStats(rank=rank, slowest_stage=stage, **d)


@dataclasses.dataclass(frozen=True)
class DistributedSummary:
    """Per-rank stats (``stats[i]`` belongs to global rank ``ranks[i]``) and the slowest rank."""

    ranks: list[int]
    stats: list[RankStats]
    slowest_rank: int
    slowest_stall_fraction: float
    median_stall_fraction: float
    gap: float  # slowest minus median stall fraction
    gap_s: float  # slowest minus median stalled seconds
    slowest_stage: str | None = None  # the slowest rank's slowest stage
    slowest_stage_s: float = 0.0  # its effective seconds per batch

    def line(self) -> str:
        """One line naming the slowest rank, its slowest stage and its distance from the median."""
        rates = [s.samples_per_s for s in self.stats]
        outside = [s.outside_s for s in self.stats]
        stage = (
            f", its slowest stage {self.slowest_stage} "
            f"({self.slowest_stage_s * 1e3:.3g} ms per batch)"
            if self.slowest_stage is not None
            else ", no stage times reported"
        )
        idle = [s.device_idle_fraction for s in self.stats if s.device_idle_fraction is not None]
        device = (
            f"; device idle for input {100 * min(idle):.1f}..{100 * max(idle):.1f}%" if idle else ""
        )
        return (
            f"{len(self.ranks)} ranks: slowest is rank {self.slowest_rank}, stalled "
            f"{100 * self.slowest_stall_fraction:.1f}% vs median "
            f"{100 * self.median_stall_fraction:.1f}% ({100 * self.gap:+.1f} points, "
            f"{self.gap_s:+.3g} s){stage}; samples/s per rank {min(rates):.4g}..{max(rates):.4g}; "
            f"outside iteration {min(outside):.3g}..{max(outside):.3g} s{device}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gather_stats(stats: StallStats, group: Any = None) -> DistributedSummary:
    """Collective: one fixed-size ``all_gather`` of every rank's record over ``group``."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "gather_stats needs an initialised torch.distributed process group "
            "(call torch.distributed.init_process_group first)"
        )
    world = dist.get_world_size(group)
    # NCCL moves only CUDA tensors (as all_gather_object does, use the current device)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    mine = torch.frombuffer(bytearray(_pack(stats)), dtype=torch.uint8).to(device)
    out = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    chunks = list(out.split(RECORD_BYTES))  # type: ignore[no-untyped-call]  # untyped in torch
    dist.all_gather(chunks, mine, group=group)
    raw = out.cpu().numpy().tobytes()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    all_stats = [
        _unpack(r, raw[i * RECORD_BYTES : (i + 1) * RECORD_BYTES]) for i, r in enumerate(ranks)
    ]
    fractions = [s.stall_fraction for s in all_stats]
    worst = max(range(world), key=lambda i: (fractions[i], -i))
    median = statistics.median(fractions)
    median_s = statistics.median(s.stall_s for s in all_stats)
    slow = all_stats[worst]
    return DistributedSummary(
        ranks=list(ranks),
        stats=all_stats,
        slowest_rank=ranks[worst],
        slowest_stall_fraction=fractions[worst],
        median_stall_fraction=median,
        gap=fractions[worst] - median,
        gap_s=slow.stall_s - median_s,
        slowest_stage=slow.slowest_stage,
        slowest_stage_s=slow.slowest_stage_s,
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
