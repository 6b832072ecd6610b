"""The folded waits of a stall meter: stall seconds, batches, samples, bytes, the longest wait
and the log-bucket histogram behind the wait quantiles."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from feedpipe.stall.records import NBUCKETS, Block, bucket_value

__all__ = ["WaitTotals"]


class WaitTotals:
    """Totals of every folded batch record (the meter folds under its lock)."""

    def __init__(self) -> None:
        import numpy as np

        self.stall_s = 0.0
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.wait_max_s = 0.0
        self.hist: Any = np.zeros(NBUCKETS, dtype=np.int64)  # numpy int64 counts

    def add(self, block: Block) -> None:
        """Add a folded block of records."""
        self.hist += block.hist
        self.stall_s += block.stall_s
        self.batches += block.batches
        self.wait_max_s = max(self.wait_max_s, block.wait_max_s)
        self.samples += block.samples
        self.bytes += block.bytes

    def quantile(self, q: float) -> float:
        """Wait time (seconds) at quantile ``q`` in [0, 1], from the histogram."""
        import numpy as np

        cum = np.cumsum(self.hist)
        total = int(cum[-1])
        if total == 0:
            return 0.0
        rank = max(1, math.ceil(q * total))
        i = int(np.searchsorted(cum, rank))
        if i == NBUCKETS - 1:  # the top bucket also holds clamped, longer waits
            return self.wait_max_s
        return min(bucket_value(i), self.wait_max_s) if i else 0.0

    def top_sum(self, k: int) -> float:
        """Seconds of the ``k`` longest waits, from the histogram (bucket midpoints, the longest
        exact); 0.0 for ``k <= 0``."""
        import numpy as np

        if k <= 0 or self.batches <= 0:
            return 0.0
        nonzero = np.flatnonzero(self.hist)[::-1]
        total, left = self.wait_max_s, k - 1  # the longest is known exactly
        taken = 1
        for i in nonzero:
            n = min(left, int(self.hist[i]) - taken)
            total += n * min(bucket_value(int(i)), self.wait_max_s)
            left -= n
            taken = 0
            if not left:
                break
        return total

    def state(self) -> dict[str, Any]:
        """The histogram and longest wait of a meter's state dict (the meter adds the rest)."""
        return {
            "wait_max_s": self.wait_max_s,
            "hist": {str(i): int(n) for i, n in enumerate(self.hist) if n},
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore the totals of a meter's state dict (onto zeroed totals)."""
        self.stall_s = float(state["stall_s"])
        self.batches = int(state["batches"])
        self.wait_max_s = float(state["wait_max_s"])
        self.samples = int(state["samples"])
        self.bytes = int(state["bytes"])
        for i, n in state["hist"].items():
            self.hist[int(i)] = int(n)
