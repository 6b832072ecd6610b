"""The stall meter's batch records: their packed format, the wait histogram, and the fold.

The hot path of :class:`~feedpipe.stall.meter.StallMeter` does one thing per batch: it packs
six numbers into 48 bytes (:data:`RECORD`) and appends them to an ``array("d")`` in one C call
(``log.frombytes(pack(begin, end, samples, nbytes, fetch_s, collate_s))``). The numbers are
C doubles from then on: no Python object per number stays alive, and nothing is left for the
cyclic GC. A block of records is later folded into totals by :func:`fold`, vectorised over the
block (every few thousand batches, and whenever the counters are read).

Why this is exact: one ``frombytes`` call appends a whole record while holding the GIL, so a
reader in another thread sees whole records only; a fold takes the first ``k`` whole records
(``log[:k]``, then ``del log[:k]``), and a record appended in between lands after them and
stays for the next fold. Integers (samples, bytes) are exact as doubles up to 2**53 per batch
and are summed as 64-bit integers. A negative stage time means "the stage did not run".

A loader that reads one clock between a batch's read and its collate (an in-process fetch that
shares the loop's clock) appends that reading raw, with :data:`MID` in the collate field:
``(begin, end, samples, nbytes, mid, MID)``; the fold turns it into the stage times,
fetch = mid - begin and collate = end - mid (``mid < 0``: no collate stage, fetch = end - begin),
so the hot path does no arithmetic. The fold computes them in the same IEEE doubles as Python
would, so the totals are the same to the bit.

The wait histogram has 16 linear sub-buckets per power of two, from 2**-30 s (~1 ns) to
2**12 s: the bucket of ``w = m * 2**e`` (0.5 <= m < 1) is ``(e + 30) * 16 + int(m * 32) - 16``,
so a bucket spans at most 1/16 of its octave and its midpoint is within ~3% of every value in
it. Waits past the top land in the top bucket (the quantile then reports the maximum).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

__all__ = ["FIELDS", "MID", "NBUCKETS", "RECORD", "Block", "bucket_value", "fold"]

#: One batch record: begin, end (``perf_counter``), samples, bytes, fetch_s, collate_s.
RECORD = struct.Struct("=6d")
#: Numbers per record (the log is an ``array("d")``, so its length counts numbers).
FIELDS = 6
#: In the collate field: the fetch field holds the raw clock reading between read and collate.
MID = -2.0

_SUB = 16
_EMIN = -30
_EMAX = 12
#: Buckets of the wait histogram.
NBUCKETS = (_EMAX - _EMIN + 1) * _SUB
_OFFSET = -_EMIN * _SUB - _SUB


def bucket_value(i: int) -> float:
    """Midpoint (seconds) of histogram bucket ``i``."""
    e, sub = divmod(i - _OFFSET, _SUB)  # w = m * 2**(e - 1), m = 0.5 + sub/32 + ...
    return (0.5 + (sub + 0.5) / (2 * _SUB)) * 2.0 ** (e - 1)


@dataclasses.dataclass(frozen=True)
class Block:
    """Totals of a block of records (the pass clock reads the records' begins itself:
    ``Counters.fold_clock``)."""

    batches: int
    stall_s: float
    wait_max_s: float
    hist: Any  # numpy int64 array of NBUCKETS counts
    samples: int
    bytes: int
    stages: dict[str, tuple[float, int, int]]  # "fetch"/"collate": (seconds, calls, bytes)


def _stage_times(rec: Any, begin: Any, end: Any) -> tuple[Any, Any]:
    """The fetch and collate columns of records, with :data:`MID` records' clock turned into
    stage times (a negative time: the stage did not run)."""
    import numpy as np

    fetch, collate = rec[:, 4], rec[:, 5]
    mid = collate == MID
    if not mid.any():
        return fetch, collate
    split = mid & (fetch >= 0.0)  # read, then collate: the clock between them
    whole = mid & ~split  # read_batch: no collate stage
    fetch = np.where(split, fetch - begin, np.where(whole, end - begin, fetch))
    collate = np.where(split, end - rec[:, 4], np.where(whole, -1.0, collate))
    return fetch, collate


def fold(values: Any) -> Block:
    """Fold whole records (a buffer of ``FIELDS * n`` doubles, n >= 1) into a :class:`Block`."""
    import numpy as np

    rec = np.frombuffer(values, dtype=np.float64).reshape(-1, FIELDS)
    begin, end = rec[:, 0], rec[:, 1]
    w = end - begin
    m, e = np.frexp(w)
    idx = (e.astype(np.int64) << 4) + (m * 32.0).astype(np.int64) + _OFFSET
    idx = np.where(w > 0.0, np.clip(idx, 0, NBUCKETS - 1), 0)
    nbytes = rec[:, 3].astype(np.int64)
    total_bytes = int(nbytes.sum())
    stages = {}
    for name, t in zip(("fetch", "collate"), _stage_times(rec, begin, end), strict=True):
        ran = t >= 0.0
        calls = int(np.count_nonzero(ran))
        if calls == len(t):  # the stage ran for every batch (the usual case)
            stages[name] = (float(t.sum()), calls, total_bytes)
        elif calls:
            stages[name] = (float(t[ran].sum()), calls, int(nbytes[ran].sum()))
    return Block(
        batches=len(rec),
        stall_s=float(w.sum()),
        wait_max_s=float(w.max()),
        hist=np.bincount(idx, minlength=NBUCKETS),
        samples=int(rec[:, 2].astype(np.int64).sum()),
        bytes=total_bytes,
        stages=stages,
    )
