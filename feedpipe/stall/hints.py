"""The plain-language hint of a stall report: a verdict, and only advice the counters support.

Rules (each case has a test in ``tests/test_stall_hints.py``, the no-time one in
``tests/test_stall_robust.py``):

- Figures that are no time (NaN, infinite or negative seconds: a restored state, a stage timed
  by a bad clock) get no verdict, and say which.
- The verdict uses the *typical* stall share (:mod:`feedpipe.stall.robust`): a few outlier
  waits (worker start-up, one GC pause) do not decide it.
- No setting already in force is suggested: ``persistent_workers=True`` only when it is off
  and more than one pass was measured (time outside iteration: workers restart per pass);
  a larger ``prefetch_factor`` only when it is below :data:`DEEP_PREFETCH` (or unknown).
- A GIL-bound stage (:func:`gil_bound`: thread workers over per-sample Python reads whose
  threads took turns on about one core) gets the process-worker note
  (``worker_type="process"``) instead of "try more workers", with 1 worker or more.
"""

from __future__ import annotations

import math

from feedpipe.stall.figures import StallFigures

__all__ = [
    "CPU_BOUND",
    "DEEP_PREFETCH",
    "GIL_CORES",
    "INPUT_BOUND",
    "MIN_BATCHES",
    "gil_bound",
    "hint",
    "thread_cpu",
]

#: Typical stall fraction from which a run is called input-bound.
INPUT_BOUND = 0.05

#: Fewer batches than this are too little data for a verdict: the first waits include the
#: workers' start-up and the first reads, so one batch always "waited 100%".
MIN_BATCHES = 5

#: Share of a thread worker's stage time on a CPU (times the worker count, see :func:`gil_bound`)
#: from which its fetch is called CPU-bound (an I/O-bound read mostly sleeps in the kernel).
CPU_BOUND = 0.5

#: At most this many cores between them: the threads ran one at a time (the GIL); more of
#: them cannot help. Threads that release the GIL use one core each.
GIL_CORES = 1.25

#: A ``prefetch_factor`` from which a deeper prefetch is not suggested.
DEEP_PREFETCH = 4

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


def _worker_s(s: StallFigures) -> float:
    return sum(st.seconds for n, st in s.stages.items() if n in ("fetch", "decode", "collate"))


def thread_cpu(s: StallFigures) -> tuple[float, float] | None:
    """``(on_cpu, cores)`` of thread workers: the share of each thread's stage time spent on a
    CPU (CPU seconds over the stages' seconds; 1/W when W threads take turns) and the cores
    they used between them while busy (CPU seconds over the shorter of the iteration's wall
    time and the stages' seconds). ``None`` without thread-worker CPU figures or stage times."""
    worker_s = _worker_s(s)
    if s.worker_type != "thread" or s.input_cpu_s is None or worker_s <= 0:
        return None
    busy = min(worker_s, s.wall_s) if s.wall_s > 0 else worker_s
    return s.input_cpu_s / worker_s, s.input_cpu_s / busy


def gil_bound(s: StallFigures) -> bool:
    """Thread workers over per-sample reads (a "collate" stage ran) that are CPU-bound Python.

    With W threads: their stage time is CPU time (``on_cpu * W`` at least :data:`CPU_BOUND`),
    on at most :data:`GIL_CORES` cores between them, and, for W > 1, they waited for each
    other (``on_cpu`` below 3/4): the threads ran one at a time, so more of them cannot help.
    A batched ``read_batch`` without collation is the GIL-releasing path thread workers are
    meant for (memmap, Zarr) and is never called GIL-bound.
    """
    cpu = thread_cpu(s)
    if cpu is None or "collate" not in s.stages:
        return False
    on_cpu, cores = cpu
    w = max(1, s.workers)
    return on_cpu * w >= CPU_BOUND and cores <= GIL_CORES and (w == 1 or on_cpu < 0.75)


def _stall(s: StallFigures) -> float:
    typical = s.typical_stall_fraction
    return s.stall_fraction if typical is None else typical


def hint(s: StallFigures) -> str:
    """A plain-language verdict: input-bound (and which stage to fix) or compute-bound.

    Cases, in order: no data; too few batches (:data:`MIN_BATCHES`) for a verdict;
    device-bound when the host waited but the GPU's stream did not (device idle for input below
    :data:`INPUT_BOUND`); input-bound with the slowest stage to fix, unless workers overlap the
    step and every stage delivers faster than the step (then no stage is blamed); compute-bound.
    A GIL-bound fetch (:func:`gil_bound`) gets the process-worker note.
    """
    bad = _bad_times(s)
    if bad:
        return (
            f"no verdict: the counters hold {bad} (a restored state or a stage timed by a bad "
            "clock); reset the meter and measure again"
        )
    if s.batches == 0 or s.wall_s <= 0:
        return "no batches measured yet"
    if s.batches < MIN_BATCHES:
        return (
            f"too little data to judge: {s.batches} batch{'es' if s.batches > 1 else ''} "
            f"measured, and the first waits include worker start-up; "
            f"measure at least {MIN_BATCHES} batches"
        )
    gil = gil_bound(s)
    verdict = _verdict(s, gil)
    if gil and "worker_type=" not in verdict:
        verdict += "; note: " + _gil_note(s)
    return verdict


def _bad_times(s: StallFigures) -> str:
    """What in the figures is no time (NaN, infinite or negative seconds); "" when all are."""
    times = {"wall": s.wall_s, "stall": s.stall_s, "step": s.step_s}
    times.update({f"stage {n!r}": st.seconds for n, st in s.stages.items()})
    bad = [k for k, v in times.items() if not (math.isfinite(v) and v >= 0)]
    if not bad:
        return ""
    return f"a time that is not a finite, non-negative number of seconds ({', '.join(bad)})"


def _outliers(s: StallFigures) -> str:
    """Said only when leaving the outliers out moved the stall share by 5 points or more."""
    if not s.outlier_waits or s.stall_fraction - _stall(s) < INPUT_BOUND:
        return ""
    return (
        f" (typical batches: the {s.outlier_waits} longest waits, {_ms(s.outlier_s)} in all, "
        f"left out as outliers; {100 * s.stall_fraction:.0f}% with them)"
    )


def _verdict(s: StallFigures, gil: bool) -> str:
    stall = _stall(s)
    pct = 100 * stall
    idle = s.device_idle_fraction
    if idle is not None and s.device_batches and stall >= INPUT_BOUND > idle:
        return (
            f"device-bound: the loop waited {pct:.0f}% of the time in next(), but the GPU idled "
            f"only {100 * idle:.1f}% for input: the host waits overlap queued GPU work "
            "(asynchronous execution), so the input keeps the GPU fed"
        )
    if stall >= INPUT_BOUND:
        return _input_bound(s, f"input-bound: the loop waited {pct:.0f}% of the time", gil)
    if s.input_busy is not None:
        idle_pct = 100 * (1 - s.input_busy)
        return (
            f"compute-bound: input is idle {idle_pct:.0f}% of the time (loop waited {pct:.1f}%)"
            + _outliers(s)
        )
    return f"compute-bound: the loop waited only {pct:.1f}% of the time" + _outliers(s)


def _input_bound(s: StallFigures, head: str, gil: bool) -> str:
    head += _outliers(s)
    if s.slowest_stage is None:
        return f"{head}; no stage times reported: try more workers or a deeper prefetch"
    name, st = s.slowest_stage, s.stages[s.slowest_stage]
    timing = f"{_ms(st.effective_s)} per batch vs {_ms(s.step_mean_s)} step"
    if s.workers > 0 and st.effective_s < s.step_mean_s:
        head += (
            f", yet every stage delivers a batch faster than the step (slowest {name}: "
            f"{timing}), so no stage is to blame"
        )
        if gil:  # the step itself is inflated by the workers' turns on the GIL
            return f"{head}: {_gil_note(s)}"
        return (
            f"{head}: the waits come from worker start-up, uneven batch times or a shallow "
            f"prefetch{_settings_advice(s)}"
        )
    if gil and name in ("fetch", "collate"):
        return f"{head}; {name} is the slowest stage ({timing}): {_gil_note(s)}"
    table = _ADVICE_THREADS if s.worker_type == "thread" else _ADVICE
    advice = table.get(name) or _ADVICE.get(name, "try more workers or a deeper prefetch")
    return f"{head}; {name} is the slowest stage ({timing}): {advice}"


def _settings_advice(s: StallFigures) -> str:
    """What to try when every stage keeps up on average: only settings not yet in force."""
    tries = []
    if s.persistent_workers is not True and s.outside_s > 0:
        tries.append("persistent_workers=True (workers restart every pass)")
    if s.prefetch_factor is None or s.prefetch_factor < DEEP_PREFETCH:
        now = "" if s.prefetch_factor is None else f", now {s.prefetch_factor}"
        tries.append(f"a larger prefetch_factor (it absorbs uneven batch times{now})")
    if not tries:
        return (
            "; the loader's settings already cover these (persistent workers or one pass, "
            f"prefetch_factor {s.prefetch_factor}): look for occasional slow samples"
        )
    return "; try " + " or ".join(tries)


def _gil_note(s: StallFigures) -> str:
    """Thread workers holding the GIL: more of them will not help; processes will."""
    cores = (thread_cpu(s) or (0.0, 0.0))[1]
    return (
        f"the {s.workers} thread worker{'s' if s.workers != 1 else ''} used "
        f"{s.input_cpu_s or 0.0:.3g} CPU-s in {_worker_s(s):.3g} s of fetch ({cores:.2f} cores "
        "between them), so fetch is CPU-bound Python that holds the GIL: more threads run one at "
        "a time, and this also slows the loop and inflates the step time; "
        'try worker_type="process"'
    )
