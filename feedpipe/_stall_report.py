"""Text for stall counters: the one-line summary, the report and the plain-language hint."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from feedpipe.stall import StallStats

__all__ = ["INPUT_BOUND", "format_report", "format_summary", "hint"]

#: Stall fraction from which a run is called input-bound.
INPUT_BOUND = 0.05

_ADVICE = {
    "fetch": "try more workers, thread workers for GIL-free reads, or stage remote data locally",
    "decode": "try more workers or GPU decode (DALI)",
    "collate": "try batched reads (__getitems__/read_into) or thread workers",
    "pin": "try a pinned ring buffer (allocated once) or fewer, larger batches",
    "h2d": "try non_blocking copies on a side stream (the GPU feed) or smaller dtypes",
}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def _rate(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def hint(s: StallStats) -> str:
    """A plain-language verdict: input-bound (and which stage to fix) or compute-bound."""
    if s.batches == 0 or s.wall_s <= 0:
        return "no batches measured yet"
    pct = 100 * s.stall_fraction
    if s.stall_fraction >= INPUT_BOUND:
        head = f"input-bound: the loop waited {pct:.0f}% of the time"
        if s.slowest_stage is None:
            return f"{head}; no stage times reported: try more workers or a deeper prefetch"
        st = s.stages[s.slowest_stage]
        advice = _ADVICE.get(s.slowest_stage, "try more workers or a deeper prefetch")
        return (
            f"{head}; {s.slowest_stage} is the slowest stage "
            f"({_ms(st.effective_s)} per batch vs {_ms(s.step_mean_s)} step): {advice}"
        )
    if s.input_busy is not None:
        idle = 100 * (1 - s.input_busy)
        return f"compute-bound: input is idle {idle:.0f}% of the time (loop waited {pct:.1f}%)"
    return f"compute-bound: the loop waited only {pct:.1f}% of the time"


def format_summary(s: StallStats) -> str:
    """One line: stall %, p50/p99 wait, throughput and the slowest stage."""
    parts = [
        f"stall {100 * s.stall_fraction:.1f}%",
        f"wait p50 {_ms(s.wait_p50_s)} p99 {_ms(s.wait_p99_s)}",
        f"{_rate(s.samples_per_s)} samples/s",
        f"{_rate(s.bytes_per_s)}B/s",
        f"{s.batches} batches",
    ]
    if s.slowest_stage is not None:
        parts.append(f"slowest {s.slowest_stage} {_ms(s.stages[s.slowest_stage].effective_s)}")
    return " | ".join(parts)


def format_report(s: StallStats) -> str:
    """Multi-line report: totals, waits, throughput, per-stage table, regions, queues, hint."""
    lines = [
        f"feedpipe stall report: {s.batches} batches, {s.samples} samples in {s.wall_s:.3g} s",
        f"  stalled {s.stall_s:.3g} s ({100 * s.stall_fraction:.1f}%), step {s.step_s:.3g} s; "
        f"wait p50 {_ms(s.wait_p50_s)}, p99 {_ms(s.wait_p99_s)}, max {_ms(s.wait_max_s)}",
        f"  throughput {_rate(s.samples_per_s)} samples/s, {_rate(s.batches_per_s)} batches/s, "
        f"{_rate(s.bytes_per_s)}B/s",
    ]
    if s.stages:
        lines.append(
            f"  {'stage':<10}{'total s':>10}{'ms/batch':>11}{'effective':>11}{'MB':>10}"
            f"   (effective = ms/batch / {max(1, s.workers)} workers for worker stages)"
        )
        for name, st in s.stages.items():
            mark = "  <- slowest" if name == s.slowest_stage else ""
            lines.append(
                f"  {name:<10}{st.seconds:>10.3f}{st.per_batch_s * 1e3:>11.3f}"
                f"{st.effective_s * 1e3:>11.3f}{st.bytes / 1e6:>10.1f}{mark}"
            )
    if s.regions:
        regions = ", ".join(f"{k} {v:.3g} s" for k, v in s.regions.items())
        lines.append(f"  regions: {regions}")
    if s.depths:
        lines.append("  queues: " + ", ".join(f"{k}={v}" for k, v in s.depths.items()))
    lines.append(f"  hint: {hint(s)}")
    return "\n".join(lines)
