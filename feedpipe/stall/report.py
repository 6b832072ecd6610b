"""Text for stall counters: the one-line summary, the report and the plain-language hint."""

from __future__ import annotations

from feedpipe.stall.figures import StallFigures as StallStats
from feedpipe.stall.hints import CPU_BOUND, INPUT_BOUND, MIN_BATCHES, hint

__all__ = ["CPU_BOUND", "INPUT_BOUND", "MIN_BATCHES", "format_report", "format_summary", "hint"]


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def _rate(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_summary(s: StallStats) -> str:
    """One line: stall %, p50/p99 wait, throughput and the slowest stage."""
    parts = [f"stall {100 * s.stall_fraction:.1f}%"]
    if s.device_idle_fraction is not None:
        parts.append(f"device idle for input {100 * s.device_idle_fraction:.1f}%")
    parts += [
        f"wait p50 {_ms(s.wait_p50_s)} p99 {_ms(s.wait_p99_s)}",
        f"{_rate(s.samples_per_s)} samples/s",
        f"{_rate(s.bytes_per_s)}B/s",
        f"{s.batches} batches",
    ]
    if s.outside_s > 0:
        parts.append(f"outside {s.outside_s:.3g} s")
    if s.skipped:
        parts.append(f"skipped {s.skipped} samples")
    if s.slowest_stage is not None:
        parts.append(f"slowest {s.slowest_stage} {_ms(s.stages[s.slowest_stage].effective_s)}")
    return " | ".join(parts)


def format_report(s: StallStats) -> str:
    """Multi-line report: totals, waits, throughput, per-stage table, regions, queues, hint."""
    lines = [
        f"feedpipe stall report: {s.batches} batches, {s.samples} samples in {s.wall_s:.3g} s "
        f"of iteration (+ {s.outside_s:.3g} s outside it, between passes)",
        f"  stalled {s.stall_s:.3g} s ({100 * s.stall_fraction:.1f}%), step {s.step_s:.3g} s; "
        f"wait p50 {_ms(s.wait_p50_s)}, p99 {_ms(s.wait_p99_s)}, max {_ms(s.wait_max_s)}",
        f"  throughput {_rate(s.samples_per_s)} samples/s, {_rate(s.batches_per_s)} batches/s, "
        f"{_rate(s.bytes_per_s)}B/s",
    ]
    if s.device_idle_s is not None:
        frac = 100 * (s.device_idle_fraction or 0.0)
        lines.insert(
            2,
            f"  device idle for input {s.device_idle_s:.3g} s ({frac:.1f}%; GPU stream time from "
            f"CUDA events at hand-off, {s.device_batches} batches) beside host-side stall "
            f"{100 * s.stall_fraction:.1f}%",
        )
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
