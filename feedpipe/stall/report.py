"""Text for stall counters: the one-line summary, the report and the plain-language hint."""

from __future__ import annotations

from feedpipe.stall.figures import StallFigures as StallStats

__all__ = ["CPU_BOUND", "INPUT_BOUND", "MIN_BATCHES", "format_report", "format_summary", "hint"]

#: Stall fraction from which a run is called input-bound.
INPUT_BOUND = 0.05

#: Fewer batches than this are too little data for a verdict: the first waits include the
#: workers' start-up and the first reads, so one batch always "waited 100%".
MIN_BATCHES = 5

#: CPU seconds of the worker threads per second of worker stages from which a thread-worker
#: fetch is called CPU-bound (an I/O-bound read mostly sleeps in the kernel).
CPU_BOUND = 0.5

_ADVICE = {
    "fetch": "try more workers, thread workers for GIL-free reads, or stage remote data locally",
    "decode": "try more workers or GPU decode (DALI)",
    "collate": "try batched reads (__getitems__, or read_batch(indices, out=None) on the "
    "dataset) or thread workers",
    "pin": "try a pinned ring buffer (allocated once) or fewer, larger batches",
    "h2d": "try non_blocking copies on a side stream (the GPU feed) or smaller dtypes",
}

#: The same advice when thread workers are already in use (no point suggesting them).
_ADVICE_THREADS = {
    "fetch": "try more workers or stage remote data locally",
    "collate": "try batched reads (__getitems__, or read_batch(indices, out=None) on the dataset)",
}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def _rate(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def hint(s: StallStats) -> str:
    """A plain-language verdict: input-bound (and which stage to fix) or compute-bound.

    Cases, in order: no data; too few batches (:data:`MIN_BATCHES`) for a verdict;
    device-bound when the host waited but the GPU's stream did not (device idle for input below
    :data:`INPUT_BOUND`); input-bound with the slowest stage to fix, unless workers overlap the
    step and every stage delivers faster than the step (then no stage is blamed); compute-bound.
    Under thread workers whose fetch is CPU-bound (:data:`CPU_BOUND`) a note says the GIL
    inflates the step.
    """
    if s.batches == 0 or s.wall_s <= 0:
        return "no batches measured yet"
    if s.batches < MIN_BATCHES:
        return (
            f"too little data to judge: {s.batches} batch{'es' if s.batches > 1 else ''} "
            f"measured, and the first waits include worker start-up; "
            f"measure at least {MIN_BATCHES} batches"
        )
    return _verdict(s) + _gil_note(s)


def _verdict(s: StallStats) -> str:
    pct = 100 * s.stall_fraction
    idle = s.device_idle_fraction
    if idle is not None and s.device_batches and s.stall_fraction >= INPUT_BOUND > idle:
        return (
            f"device-bound: the loop waited {pct:.0f}% of the time in next(), but the GPU idled "
            f"only {100 * idle:.1f}% for input: the host waits overlap queued GPU work "
            "(asynchronous execution), so the input keeps the GPU fed"
        )
    if s.stall_fraction >= INPUT_BOUND:
        head = f"input-bound: the loop waited {pct:.0f}% of the time"
        if s.slowest_stage is None:
            return f"{head}; no stage times reported: try more workers or a deeper prefetch"
        name, st = s.slowest_stage, s.stages[s.slowest_stage]
        timing = f"{_ms(st.effective_s)} per batch vs {_ms(s.step_mean_s)} step"
        if s.workers > 0 and st.effective_s < s.step_mean_s:
            return (
                f"{head}, yet every stage delivers a batch faster than the step "
                f"(slowest {name}: {timing}), so no stage is to blame: the waits come from "
                "worker start-up, uneven batch times or a shallow prefetch; try "
                "persistent_workers=True or a larger prefetch_factor"
            )
        table = _ADVICE_THREADS if s.worker_type == "thread" else _ADVICE
        advice = table.get(name) or _ADVICE.get(name, "try more workers or a deeper prefetch")
        return f"{head}; {name} is the slowest stage ({timing}): {advice}"
    if s.input_busy is not None:
        idle = 100 * (1 - s.input_busy)
        return f"compute-bound: input is idle {idle:.0f}% of the time (loop waited {pct:.1f}%)"
    return f"compute-bound: the loop waited only {pct:.1f}% of the time"


def _gil_note(s: StallStats) -> str:
    """Under thread workers with a CPU-bound fetch: the step time includes GIL contention.

    Only for per-sample reads (a "collate" stage ran): a batched ``read_batch`` without
    collation is the GIL-releasing path thread workers are meant for (memmap, Zarr gathers).
    """
    if s.worker_type != "thread" or s.input_cpu_s is None or "collate" not in s.stages:
        return ""
    worker_s = sum(st.seconds for n, st in s.stages.items() if n in ("fetch", "decode", "collate"))
    if worker_s <= 0 or s.input_cpu_s < CPU_BOUND * worker_s:
        return ""
    return (
        f"; note: the {s.workers} thread workers used {s.input_cpu_s:.3g} CPU-s in "
        f"{worker_s:.3g} s of fetch, so fetch is CPU-bound: if it runs Python code it holds "
        "the GIL, which also slows the loop and inflates the step time; "
        'try worker_type="process"'
    )


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
