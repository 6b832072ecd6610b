"""The rule behind a robust verdict: how many of the longest waits are outliers.

A mean is decided by its largest terms: one garbage-collection pause of 150 ms among 200 waits
of 0.1 ms makes the stall share of a 1 ms step jump from 9% to about 45%. The verdict of
:mod:`feedpipe.stall.hints` therefore uses the *typical* stall share: the stall with the
:func:`outliers` longest waits left out, over the wall time with them left out:

    typical = (stall_s - top) / (wall_s - top),  top = the sum of the k longest waits,
    k = 0 under 10 batches, else min(max(2, batches // 200), batches // 10)

Two waits cover a run's one-off events (the first wait's worker start-up, one GC pause); from
400 batches on, the longest 0.5% are left out, so a stall that recurs in more than 0.5% of the
batches (a slow shard every 100 batches, 30% of batches waiting) still counts in full minus
those few. The raw ``stall_fraction`` stays in the snapshot and the summary.
"""

from __future__ import annotations

import math

__all__ = ["MIN_TRIM_BATCHES", "TRIM_SHARE", "outliers", "typical_fraction"]

#: Runs shorter than this leave no wait out.
MIN_TRIM_BATCHES = 10
#: Share of the waits left out in long runs (at least two).
TRIM_SHARE = 1 / 200


def outliers(batches: int) -> int:
    """How many of the longest waits a run of ``batches`` leaves out of its verdict."""
    if batches < MIN_TRIM_BATCHES:
        return 0
    return min(max(2, int(batches * TRIM_SHARE)), batches // 10)


def typical_fraction(stall_s: float, wall_s: float, top_s: float) -> float:
    """The stall share with ``top_s`` seconds of outlier waits left out of stall and wall; 0 where
    the raw share is (no positive, finite wall time), the raw share where ``top_s`` is not a
    finite, non-negative time (a restored state with a bad wait): never a NaN turned into 100%."""
    if not (math.isfinite(stall_s) and math.isfinite(wall_s)) or wall_s <= 0:
        return 0.0
    if not math.isfinite(top_s) or top_s < 0:
        top_s = 0.0
    wall = wall_s - top_s
    if wall <= 0:
        return 0.0
    return max(0.0, min(1.0, (stall_s - top_s) / wall))
