"""atk9: attacks on the ring's view cache (``Slot.view``, commit 5bc7c35) on the CPU fallback.

The CPU fallback runs the same ring as the GPU path (unpinned slots, a host copy out of the
slot), so every attack on the cache runs here, in CI: views reused across batches of many leaves,
views after a slot is reallocated, same shape with another dtype or stride, ragged batches past
the cap, in-place gathers by thread workers, and a filler that changes its view's shape in place.
"""

from __future__ import annotations

import itertools
import linecache
import sys
import threading
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import feedpipe
from feedpipe.device import ring as ring_mod
from feedpipe.device.feed import GPUFeed, GPUFeedWarning
from feedpipe.device.ring import Ring, flatten


def _feed(**kw: Any) -> GPUFeed:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        return GPUFeed("cpu", **kw)


def _ring(n: int = 2) -> Ring:
    return Ring(n, pin=False, batch_size=None, timeout=30)


def _fill_and_submit(ring: Ring, seq: int, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    slot, views, _ = ring.fill(seq, leaves)
    ring.submitted(slot, seq, None)
    return views


def _slot_ptrs(ring: Ring) -> set[int]:
    return {b.data_ptr() for s in ring.slots for b in s.buffers}


# ----------------------------------------------------------------------- views made once per shape
def test_views_are_reused_for_a_batch_of_many_leaves() -> None:
    """The commit's promise ("ring slot views are made once per shape") for a dict batch of 20
    tensors: the cap of 16 views per slot counted leaves, not shapes, so such a batch cleared the
    cache on every fill and made every view anew (each a torch call that lets the GIL go)."""
    ring = _ring(2)
    leaves = [torch.full((4, 3), float(i)) for i in range(20)]
    ring.allocate(leaves, None)
    first = _fill_and_submit(ring, 0, leaves)
    _fill_and_submit(ring, 1, leaves)
    again = _fill_and_submit(ring, 2, leaves)  # slot 0 again, same shapes
    assert all(a is b for a, b in zip(first, again, strict=True)), "views made anew"
    for i, v in enumerate(again):
        assert torch.equal(v, leaves[i])


def test_views_are_reused_for_two_alternating_shapes() -> None:
    """Full batches and a short tail alternate (resumed epochs, drop_last=False): both shapes'
    views stay cached, the slot's buffers are never reallocated."""
    ring = _ring(2)
    full = [torch.ones(8, 5), torch.zeros(8, dtype=torch.int64)]
    tail = [torch.ones(3, 5), torch.zeros(3, dtype=torch.int64)]
    ring.allocate(full, None)
    made: dict[Any, list[torch.Tensor]] = {}
    for seq in range(12):
        leaves = full if seq % 4 < 2 else tail
        views = _fill_and_submit(ring, seq, leaves)
        if seq % 2 == 0:  # slot 0
            key = len(leaves[0])
            if key in made:
                assert all(a is b for a, b in zip(made[key], views, strict=True))
            made[key] = views
    assert ring.grown == 0


# --------------------------------------------------------------------------- reallocated slots
def test_views_follow_a_reallocated_slot() -> None:
    """A bigger batch reallocates its slot; the cached views of the old buffers are dropped, so
    later batches of the old shape land in the new buffers (no copy into freed memory)."""
    ring = _ring(2)
    small = [torch.arange(12.0).reshape(4, 3)]
    ring.allocate(small, None)
    _fill_and_submit(ring, 0, small)
    _fill_and_submit(ring, 1, small)
    big = [torch.arange(30.0).reshape(10, 3)]
    views = _fill_and_submit(ring, 2, big)  # slot 0 grows
    assert ring.grown == 1 and torch.equal(views[0], big[0])
    _fill_and_submit(ring, 3, small)
    views = _fill_and_submit(ring, 4, [small[0] + 100])  # slot 0, the old shape again
    buffer = ring.slots[0].buffers[0]
    assert views[0].data_ptr() == buffer.data_ptr()  # a view of the current buffer
    assert torch.equal(views[0], small[0] + 100)
    assert all(v.data_ptr() in _slot_ptrs(ring) for v in ring.slots[0].views.values())


def test_feed_batches_right_across_growth_dtype_and_stride_changes() -> None:
    """Same shape with another dtype (a different byte size: growth), a transposed
    (non-contiguous) leaf, a zero-row batch: every batch comes back equal to its source."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    batches = [
        base,
        base.double(),  # same shape, twice the bytes: the slot grows
        (base * 10).to(torch.int64),  # same shape and bytes as the double one, other dtype
        base.t().contiguous().t(),  # same shape, transposed strides
        torch.randn(4, 6, generator=g).t(),  # non-contiguous view
        base[:0],  # zero rows
        base.half(),
        base + 1,
    ]
    feed = _feed(prefetch=1)
    for _ in range(2):  # two epochs: the cached views of the first are reused
        got = list(feed.iterate(batches))
        assert len(got) == len(batches)
        for b, want in zip(got, batches, strict=True):
            assert b.dtype == want.dtype and b.shape == want.shape
            assert torch.equal(b, want)
            assert b.data_ptr() not in _slot_ptrs(feed._ring) or b.numel() == 0


def test_ragged_batches_stay_right_and_the_cache_stays_bounded() -> None:
    """40 different row counts through one ring: past the cap the cache is cleared, never wrong."""
    feed = _feed(prefetch=1)
    sizes = [1 + (7 * i) % 40 for i in range(80)]
    batches = [
        {"x": torch.arange(r * 3, dtype=torch.float32).reshape(r, 3) + i, "i": torch.full((r,), i)}
        for i, r in enumerate(sizes)
    ]
    got = list(feed.iterate(batches))
    for i, b in enumerate(got):
        assert torch.equal(b["x"], batches[i]["x"]) and torch.equal(b["i"], batches[i]["i"])
    for slot in feed._ring.slots:
        assert len(slot.views) <= ring_mod._MAX_VIEWS * (len(slot.buffers) + 1)


# ------------------------------------------------------------------------ in-place gathers
class _Rows:
    """A ``read_batch(indices, out=None)`` dataset (like MemmapDataset): row i holds i."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.in_place = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        x = idx[:, None].to(torch.float32).expand(-1, 5)
        if out is None:
            return {"x": x.clone(), "i": idx}
        with self._lock:
            self.in_place += 1
        out["x"].copy_(x)
        out["i"].copy_(idx)
        return out


def _epoch(pre: Any, ds: _Rows, batches: list[list[int]], mutate: bool = False) -> list[Any]:
    """Thread workers gather batch ``seq`` into ``pre.out_for``; results pulled in order."""
    pending = iter(enumerate(batches))
    futures: deque[Any] = deque()
    pool = ThreadPoolExecutor(2)

    def read(seq: int, indices: list[int]) -> Any:
        out = pre.out_for(seq, len(indices))
        if out is None:
            return ds.read_batch(indices)
        got = ds.read_batch(indices, out=out)
        if mutate and seq == 0:  # a careless gather reshapes its out view in place, once
            got = {"x": got["x"].unsqueeze_(0).squeeze(0), "i": got["i"]}
        return got

    def pull() -> tuple[Any, Any, bool]:
        for seq, indices in itertools.islice(pending, 3 - len(futures)):
            futures.append(pool.submit(read, seq, indices))
        if not futures:
            raise StopIteration
        batch = futures.popleft().result(timeout=30)
        return batch, int(batch["i"][0]), True

    pre.pull = pull
    try:
        return [b for b, _ in pre]
    finally:
        pool.shutdown()


def _check(got: list[Any], batches: list[list[int]]) -> None:
    assert len(got) == len(batches)
    for b, idx in zip(got, batches, strict=True):
        want = torch.tensor(idx)
        assert torch.equal(b["i"], want)
        assert b["x"].shape == (len(idx), 5)
        assert torch.equal(b["x"], want[:, None].float().expand(-1, 5))


def test_in_place_gathers_into_cached_views_over_epochs_and_abandoned_ones() -> None:
    """Cached out-views handed to thread workers epoch after epoch, with a short tail batch and
    an epoch abandoned mid-way: every batch is right, most are gathered in place."""
    feed = _feed(prefetch=2, fillers=3, batch_size=8)
    ds = _Rows(100)
    batches = [list(range(i, min(i + 8, 100))) for i in range(0, 100, 8)]
    for epoch in range(3):
        pre = feed.prefetcher()
        if epoch == 1:  # abandoned after 3 batches (a `break` in the training loop)
            pre.pull = iter([(ds.read_batch(b), b[0], True) for b in batches[:5]]).__next__
            got = [next(pre)[0] for _ in range(3)]
            _check(got, batches[:3])
            pre.close()
            continue
        _check(_epoch(pre, ds, batches), batches)
    assert ds.in_place > 12


def test_a_gather_that_reshapes_its_out_view_in_place_does_not_poison_later_batches() -> None:
    """A worker's gather that changes the shape of its ``out`` view in place (``unsqueeze_``,
    ``resize_``, ``out=`` resizing) changed a fresh view before the cache; now the view is the
    cached one, so the next batch of that slot is handed a view of the wrong shape."""
    feed = _feed(prefetch=1, fillers=2, batch_size=8)
    ds = _Rows(64)
    batches = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    _check(_epoch(feed.prefetcher(), ds, batches), batches)  # lays the ring out
    _check(_epoch(feed.prefetcher(), ds, batches, mutate=True), batches)
    _check(_epoch(feed.prefetcher(), ds, batches), batches)


# ------------------------------------------------------------------------------- the loader
def _torch_batches(ds: Any, seed: int) -> list[Any]:
    return list(
        torch.utils.data.DataLoader(
            ds, batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_cpu_fallback_loader_matches_torch_with_a_break_between_epochs(workers: int) -> None:
    """The loader's device path on the CPU fallback (cached views, thread workers gathering in
    place, a short last batch, an epoch abandoned with ``break``) against torch's batches."""
    ds = torch.utils.data.TensorDataset(
        torch.arange(50 * 6, dtype=torch.float32).reshape(50, 6), torch.arange(50)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPUFeedWarning)
        loader = feedpipe.DataLoader(
            ds,
            batch_size=7,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
            num_workers=workers,
            worker_type="thread",
            device="cpu",
        )
    want = _torch_batches(ds, 3)
    got = [[x.clone(), y.clone()] for x, y in loader]
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    for i, _ in enumerate(loader):  # abandoned mid-way
        if i == 2:
            break
    loader.generator.manual_seed(5)
    want = _torch_batches(ds, 5)
    got = list(loader)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])


def test_out_views_are_reused_and_remade_only_when_changed() -> None:
    """The filler's views of a slot are the same objects batch after batch (the cache works and
    the shape check does not defeat it); a view reshaped in place is made anew."""
    ring = _ring(2)
    leaves, rebuild = flatten([torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)])
    ring.allocate(leaves, rebuild)
    first = ring.out_for(0, 4, 0)
    assert first is not None
    _fill_and_submit(ring, 0, first)
    _fill_and_submit(ring, 1, leaves)
    again = ring.out_for(2, 4, 0)
    assert again is not None
    assert again[0] is first[0] and again[1] is first[1]
    again[0].unsqueeze_(0)  # the filler of batch 2 reshapes its view in place
    _fill_and_submit(ring, 2, [again[0].squeeze(0), again[1]])
    _fill_and_submit(ring, 3, leaves)
    fresh = ring.out_for(4, 4, 0)
    assert fresh is not None
    assert fresh[0].shape == (4, 3) and fresh[0] is not first[0]  # made anew, right shape
    assert fresh[0].data_ptr() == ring.slots[0].buffers[0].data_ptr()


def test_a_stale_filler_paused_at_the_view_cache_is_turned_away() -> None:
    """A filler of an abandoned epoch has passed its turn but not yet taken its views (not lent,
    so the ring is reused); it resumes only after the next epoch has filled and re-cached the
    same slot. It must get ``None`` (and write nothing), and the new epoch's batches stay right."""
    feed = _feed(prefetch=0, fillers=1, batch_size=4)  # 3 slots
    out_for = feed.start()
    feed.hand_over(feed.submit(torch.zeros(4, 3)))  # lays the ring out; seq 0 in slot 0
    at_cache, go = threading.Event(), threading.Event()
    code = Ring.out_for.__code__
    got: list[Any] = ["unset"]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line" and "slot.view(key" in _source(frame):
            at_cache.set()
            go.wait(30)
        return trace

    def stale() -> None:
        sys.settrace(trace)
        try:
            got[0] = out_for(3, 4)  # slot 0 again
        finally:
            sys.settrace(None)

    t = threading.Thread(target=stale, daemon=True)
    t.start()
    assert at_cache.wait(30)
    ring = feed._ring
    batches = [torch.full((4, 3), float(i)) for i in range(6)]
    it = feed.iterate(batches)
    first = [next(it), next(it)]  # the new epoch reused the ring and filled slot 0
    assert feed._ring is ring
    go.set()
    t.join(30)
    assert not t.is_alive() and got[0] is None
    rest = list(it)
    for i, b in enumerate(first + rest):
        assert torch.equal(b, batches[i])


def _source(frame: Any) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)
