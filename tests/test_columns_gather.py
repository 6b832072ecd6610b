"""``feedpipe.datasets.columns.gather``: every path copies exactly the ranges asked for."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.datasets.columns import gather


def _reference(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, dest: np.ndarray
) -> None:
    for s, ln, d in zip(starts.tolist(), lengths.tolist(), dest.tolist(), strict=True):
        out[d : d + ln] = buf[s : s + ln]


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("avg", [3, 40, 700, 3000])
@pytest.mark.parametrize("back_to_back", [True, False])
def test_gather_matches_slice_copies(unit: int, avg: int, back_to_back: bool) -> None:
    """Records of every size class (index runs, several runs per batch, slices), every copy unit,
    back to back or scattered into the output, in any order and with repeats."""
    rng = np.random.default_rng(unit * 1000 + avg)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    n = 300
    lengths = rng.integers(0, 2 * avg // unit + 1, n) * unit
    starts = rng.integers(0, (buf.nbytes - lengths.max()) // unit, n) * unit
    starts[5] = starts[9]  # a record read twice
    if back_to_back:
        dest = np.cumsum(lengths) - lengths + 8 * unit
        size = int(lengths.sum()) + 16 * unit
    else:  # every other slot of the output, in reverse order
        slots = np.cumsum(2 * lengths[::-1])[::-1] - 2 * lengths
        dest, size = slots, int(2 * lengths.sum())
    out = np.full(size, 7, np.uint8)
    want = out.copy()
    gather(buf, starts, lengths, out, dest)
    _reference(buf, starts, lengths, want, dest)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("avg", [16, 600])
def test_gather_range_past_the_buffer_is_an_index_error(avg: int) -> None:
    """A range ending past the buffer is refused (never clipped to its last bytes)."""
    buf = np.arange(4096, dtype=np.uint8)
    lengths = np.full(4, avg, np.int64)
    starts = np.array([0, 64, 128, 4096 - avg + 8], np.int64)
    dest = np.cumsum(lengths) - lengths
    out = np.zeros(int(lengths.sum()), np.uint8)
    with pytest.raises(IndexError):
        gather(buf, starts, lengths, out, dest)
