"""columns.gather promises "a range outside buf is an IndexError": on every path (records of
1 KiB or more copied slice by slice; smaller ones back to back or indexed), a range that starts
before the buffer (numpy would count it from the end) or ends past it is refused, never read."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.datasets.columns import gather

BUF = np.arange(4096 * 4, dtype=np.int64).astype(np.uint8)


@pytest.mark.parametrize(
    ("starts", "lengths"),
    [
        ([-16], [8]),  # indexed, one record from the end
        ([-4], [2]),
        ([0, -4], [2, 2]),  # back to back but one negative: the indexed path
        ([8, 100, -40], [4, 4, 4]),  # not back to back
        ([-8192], [4096]),  # large records: a slice from the end
        ([len(BUF) - 4000], [4096]),  # large, past the end: a slice would clip
        ([len(BUF) - 2], [4]),
    ],
)
def test_ranges_outside_the_buffer_are_refused(starts: list[int], lengths: list[int]) -> None:
    out = np.zeros(sum(lengths), np.uint8)
    dest = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    with pytest.raises(IndexError):
        gather(BUF, np.array(starts, np.int64), np.array(lengths, np.int64), out, dest)
    assert not out.any() or starts[0] >= 0  # nothing read from the buffer's end


@pytest.mark.parametrize(
    ("starts", "lengths"),
    [([0], [0]), ([len(BUF)], [0]), ([3, 9, 1], [1, 3, 4095]), ([5, 0], [4097, 1])],
)
def test_ranges_inside_are_copied(starts: list[int], lengths: list[int]) -> None:
    out = np.zeros(sum(lengths), np.uint8)
    dest = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    gather(BUF, np.array(starts, np.int64), np.array(lengths, np.int64), out, dest)
    want = [BUF[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    assert np.array_equal(out, np.concatenate(want))
