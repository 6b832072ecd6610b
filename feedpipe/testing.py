"""A reusable pytest suite for the dataset contract of :mod:`feedpipe.protocols`.

Subclass :class:`DatasetContractTests` in a test module (its name must start with ``Test``)
and say how to build the dataset; pytest then runs every ``test_*`` method against it::

    from feedpipe.testing import DatasetContractTests

    class TestMyDataset(DatasetContractTests):
        def make_dataset(self, tmp_path):
            return MyDataset(...)

This module imports pytest; ``import feedpipe`` never imports this module.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from feedpipe.protocols import BatchDataset, DMADataset, IndexArrayDataset

__all__ = ["DatasetContractTests", "assert_batches_equal"]


def assert_batches_equal(got: Any, want: Any, where: str = "batch") -> None:
    """Assert that two (nested) batches are equal bit for bit: the same container types and
    keys, tensors of the same dtype and shape holding the same bytes (NaNs included; devices
    may differ), and equal non-tensor leaves."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, want {want.dtype}"
        assert got.shape == want.shape, (
            f"{where}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        )
        assert torch.equal(_bytes(got), _bytes(want)), f"{where}: values differ"
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape differ"
        assert got.tobytes() == want.tobytes(), f"{where}: values differ"
    elif isinstance(want, Mapping):
        assert list(got) == list(want), f"{where}: keys {list(got)}, want {list(want)}"
        for key in want:
            assert_batches_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)}, want {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_batches_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r}, want {want!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _leaves(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested batch, depth first, in dict order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)


def _map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)`` (dicts, lists, tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, v) for v in obj)
    return obj


def _filled_like(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    """A contiguous tensor shaped like ``t``, filled with a byte pattern no read leaves behind."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device if device is not None else t.device)
    _bytes_view(out).fill_(0xA5)
    return out


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class DatasetContractTests:
    """The contract of :mod:`feedpipe.protocols`, as pytest tests; subclass it and override
    :meth:`make_dataset` (or the ``dataset`` fixture, to use other fixtures).

    Checked: ``read_batch`` equals ``default_collate`` of ``__getitem__`` bit for bit (side
    fields and dicts included) for unsorted, repeated, single and empty index batches; numpy
    index arrays give what lists give and are not written to; ``out=`` is filled and views of it
    are returned (also when reused, and a misfit ``out`` is a ``ValueError``); an index out of
    range is an ``IndexError``; ``__getitems__`` matches ``__getitem__``; concurrent reads from
    threads; pickling; ``feedpipe.DataLoader`` batches; and, with CUDA, the device output of a
    :class:`~feedpipe.protocols.DMADataset` and the GPU feed (skipped without CUDA).
    """

    #: how many samples the index batches hold (the dataset needs at least 2 samples)
    batch_size = 6
    #: seed of the index batches
    seed = 0

    # ------------------------------------------------------------------ hooks
    def make_dataset(self, tmp_path: Path) -> Any:
        """Build the dataset under test (``tmp_path``: pytest's per-test directory)."""
        raise NotImplementedError(f"{type(self).__name__} must override make_dataset()")

    @pytest.fixture
    def dataset(self, tmp_path: Path) -> Iterator[Any]:
        """The dataset under test; closed afterwards when it has ``close()``."""
        ds = self.make_dataset(tmp_path)
        yield ds
        close = getattr(ds, "close", None)
        if callable(close):
            close()

    def expected_batch(self, samples: list[Any]) -> Any:
        """What ``read_batch`` must return for these samples: ``default_collate(samples)``.
        Override for a field whose records vary in size (e.g. return a list for it)."""
        return default_collate(samples)

    def make_out(self, dataset: Any, indices: list[int], batch: Any) -> Any | None:
        """An ``out`` for ``read_batch(indices)``, given the batch it returns without one.

        Default: what the GPU feed's ring passes (step 4a of :mod:`feedpipe.protocols`): the
        batch's structure with fresh contiguous tensors of exactly ``len(indices)`` rows;
        ``None`` (the test is skipped) when the batch is not batch-major, as the ring does.
        """
        n = len(indices)
        leaves = list(_leaves(batch))
        if not leaves or any(t.ndim == 0 or t.shape[0] != n for t in leaves):
            return None
        return _map(_filled_like, batch)

    # ------------------------------------------------------------------ helpers
    def index_batches(self, n: int) -> dict[str, list[int]]:
        """Named index batches over a dataset of ``n`` samples."""
        rng = np.random.default_rng(self.seed)
        k = min(self.batch_size, n)
        shuffled = rng.permutation(n)[:k].tolist()
        return {
            "sorted": list(range(k)),
            "unsorted": shuffled,
            "duplicates": [n - 1, 0, n - 1, shuffled[0], 0],
            "single": [n // 2],
            "last": [n - 1],
        }

    def want(self, dataset: Any, indices: list[int]) -> Any:
        """The expected batch: :meth:`expected_batch` of ``[dataset[i] for i in indices]``."""
        return self.expected_batch([dataset[i] for i in indices])

    # ------------------------------------------------------------------ the protocol
    def test_satisfies_batch_dataset(self, dataset: Any) -> None:
        assert isinstance(dataset, BatchDataset), "needs __len__, __getitem__ and read_batch"
        assert isinstance(len(dataset), int) and len(dataset) >= 2, "needs 2 samples or more"
        if isinstance(dataset, IndexArrayDataset):
            assert isinstance(dataset.takes_index_arrays, bool)

    def test_read_batch_equals_default_collate(self, dataset: Any) -> None:
        for name, indices in self.index_batches(len(dataset)).items():
            assert_batches_equal(dataset.read_batch(indices), self.want(dataset, indices), name)

    def test_index_arrays_match_lists(self, dataset: Any) -> None:
        if not (isinstance(dataset, IndexArrayDataset) and dataset.takes_index_arrays is True):
            pytest.skip("the dataset does not take index arrays (takes_index_arrays)")
        for name, indices in self.index_batches(len(dataset)).items():
            array = np.array(indices, dtype=np.int64)
            array.flags.writeable = False  # the loader's arrays are views of its permutation
            got = dataset.read_batch(array)
            assert array.tolist() == indices
            assert_batches_equal(got, self.want(dataset, indices), f"{name} (int64 array)")

    def test_empty_indices(self, dataset: Any) -> None:
        ref = dataset.read_batch([0])
        empties: list[Any] = [[]]
        if isinstance(dataset, IndexArrayDataset) and dataset.takes_index_arrays is True:
            empties.append(np.empty(0, np.int64))
        for empty in empties:
            _assert_empty_like(dataset.read_batch(empty), ref, f"read_batch({empty!r})")

    def test_out_of_range_is_index_error(self, dataset: Any) -> None:
        n = len(dataset)
        for bad in ([n], [0, n + 5], [-n - 1]):
            with pytest.raises(IndexError):
                dataset.read_batch(bad)
        with pytest.raises(IndexError):
            dataset[n]

    def test_getitems_matches_getitem(self, dataset: Any) -> None:
        if not callable(getattr(dataset, "__getitems__", None)):
            pytest.skip("the dataset has no __getitems__")
        indices = self.index_batches(len(dataset))["duplicates"]
        items = dataset.__getitems__(indices)
        assert len(items) == len(indices)
        for i, item in zip(indices, items, strict=True):
            assert_batches_equal(item, dataset[i], f"__getitems__ sample {i}")

    # ------------------------------------------------------------------ out=
    def test_out_is_filled_and_returned_as_views(self, dataset: Any) -> None:
        batches = self.index_batches(len(dataset))
        first = batches["unsorted"]
        out = self.make_out(dataset, first, dataset.read_batch(first))
        if out is None:
            pytest.skip("no out for this batch (not batch-major): the GPU feed passes none")
        storages = {t.untyped_storage().data_ptr() for t in _leaves(out)}
        # the same out, reused for another batch of the same length (as a ring slot is)
        second = [first[-1], first[-1], *first[1:-1][::-1]]
        for indices in (first, second):
            want = self.want(dataset, indices)
            got = dataset.read_batch(indices, out=out)
            assert_batches_equal(got, want, "read_batch(out=)")
            for t in _leaves(got):
                assert t.untyped_storage().data_ptr() in storages, "a tensor is not a view of out"
            mirrored = list(_leaves(out))
            if len(mirrored) == len(list(_leaves(want))):  # out has the batch's structure
                for o, g, w in zip(mirrored, _leaves(got), _leaves(want), strict=True):
                    assert g.data_ptr() == o.data_ptr(), "a tensor does not start at its out"
                    assert torch.equal(_bytes(o[: len(indices)]), _bytes(w)), "out not filled"

    def test_out_that_does_not_fit_is_value_error(self, dataset: Any) -> None:
        indices = self.index_batches(len(dataset))["unsorted"]
        out = self.make_out(dataset, indices, dataset.read_batch(indices))
        if out is None:
            pytest.skip("no out for this batch (not batch-major): the GPU feed passes none")
        count = len(list(_leaves(out)))
        for pos in range(count):  # one tensor too short, or of another dtype, at a time
            for misfit in (_shorter, _other_dtype):
                bad = _replace_leaf(out, pos, misfit)
                with pytest.raises(ValueError):
                    dataset.read_batch(indices, out=bad)

    # ------------------------------------------------------------------ how the loader calls it
    def test_concurrent_reads_from_threads(self, dataset: Any) -> None:
        n = len(dataset)
        rng = np.random.default_rng(self.seed + 1)
        plans = [[rng.integers(0, n, self.batch_size).tolist() for _ in range(6)] for _ in range(4)]
        wants = [[self.want(dataset, b) for b in plan] for plan in plans]
        errors: list[BaseException] = []
        results: list[list[Any]] = [[] for _ in plans]
        barrier = threading.Barrier(len(plans))

        def run(k: int) -> None:
            try:
                barrier.wait(30)
                results[k] = [dataset.read_batch(b) for b in plans[k]]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(plans))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "read_batch did not return within 60 s"
        assert not errors, errors[0]
        for k in range(len(plans)):
            for got, want in zip(results[k], wants[k], strict=True):
                assert_batches_equal(got, want, f"thread {k}")

    def test_pickled_copy_reads_the_same(self, dataset: Any) -> None:
        indices = self.index_batches(len(dataset))["unsorted"]
        clone = pickle.loads(pickle.dumps(dataset))
        try:
            assert len(clone) == len(dataset)
            assert_batches_equal(clone.read_batch(indices), self.want(dataset, indices))
        finally:
            close = getattr(clone, "close", None)
            if callable(close):
                close()

    @pytest.mark.parametrize("workers", [0, 2])
    def test_loader_batches_match_torch(self, dataset: Any, workers: int) -> None:
        from feedpipe.loader import DataLoader

        def torch_batches() -> list[Any]:
            gen = torch.Generator().manual_seed(self.seed)
            loader = torch.utils.data.DataLoader(
                dataset, batch_size=4, shuffle=True, generator=gen, collate_fn=self._collate
            )
            return list(loader)

        gen = torch.Generator().manual_seed(self.seed)
        ours = DataLoader(
            dataset,
            batch_size=4,
            shuffle=True,
            generator=gen,
            num_workers=workers,
            worker_type="thread",
        )
        got = list(ours)
        want = torch_batches()
        assert len(got) == len(want)
        for b, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_batches_equal(g, w, f"loader batch {b}")

    def _collate(self, samples: list[Any]) -> Any:
        return self.expected_batch(samples)

    # ------------------------------------------------------------------ device output
    def test_device_out_fills_cuda(self, dataset: Any) -> None:
        if not isinstance(dataset, DMADataset):
            pytest.skip("not a DMADataset (no dma_blocker/device_out/record_bytes)")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        reason = dataset.dma_blocker()
        if reason is not None:
            assert isinstance(reason, str) and reason
            pytest.skip(f"dma_blocker(): {reason}")
        device = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch
        for name, indices in self.index_batches(len(dataset)).items():
            want = self.want(dataset, indices)
            with torch.cuda.stream(stream):  # as the direct path calls it (step 4b)
                out = dataset.device_out(len(indices), device)
                got = dataset.read_batch(np.array(indices, np.int64), out=out)
            stream.synchronize()
            on_device = list(_leaves(out))
            assert on_device and all(t.device == device for t in on_device), name
            assert all(t.shape[0] == len(indices) for t in on_device), name
            per_row = sum(t[:1].numel() * t.element_size() for t in on_device)
            assert per_row == dataset.record_bytes, f"{name}: record_bytes"
            ptrs = {t.data_ptr() for t in _leaves(got) if t.is_cuda}
            assert ptrs == {t.data_ptr() for t in on_device}, f"{name}: not views of out"
            assert_batches_equal(got, want, f"{name} (device out)")

    def test_loader_on_cuda_matches(self, dataset: Any) -> None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        from feedpipe.loader import DataLoader

        want = [self._collate([dataset[i] for i in range(a, min(a + 4, len(dataset)))])
                for a in range(0, len(dataset), 4)]  # fmt: skip
        for workers in (0, 2):  # the ring (with out= from its slots) or the direct path
            loader = DataLoader(
                dataset, batch_size=4, num_workers=workers, worker_type="thread", device="cuda"
            )
            got = list(loader)
            assert len(got) == len(want)
            for b, (g, w) in enumerate(zip(got, want, strict=True)):
                assert all(t.is_cuda for t in _leaves(g)), f"batch {b} not on the device"
                assert_batches_equal(g, w, f"cuda loader ({workers} workers) batch {b}")


def _assert_empty_like(got: Any, ref: Any, where: str) -> None:
    """``got`` is a 0-sample batch shaped like the 1-sample batch ``ref``."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, want a tensor"
        assert got.dtype == ref.dtype, f"{where}: dtype {got.dtype}, want {ref.dtype}"
        assert tuple(got.shape) == (0, *ref.shape[1:]), f"{where}: shape {tuple(got.shape)}"
        return
    assert type(got) is type(ref), f"{where}: {type(got).__name__}, want {type(ref).__name__}"
    if isinstance(ref, Mapping):
        assert list(got) == list(ref), f"{where}: keys {list(got)}, want {list(ref)}"
        for key in ref:
            _assert_empty_like(got[key], ref[key], f"{where}[{key!r}]")
    elif isinstance(ref, (list, tuple)):
        if len(got) == 0 and len(ref) == 1:  # a per-sample list (records of varying size)
            return
        assert len(got) == len(ref), f"{where}: length {len(got)}, want {len(ref)}"
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            _assert_empty_like(a, b, f"{where}[{i}]")


_SAME_SIZE = {
    1: (torch.uint8, torch.int8),
    2: (torch.int16, torch.float16),
    4: (torch.int32, torch.float32),
    8: (torch.int64, torch.float64),
}


def _other_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape in another dtype of the same size (a silent cast would go unnoticed)."""
    other = next(d for d in _SAME_SIZE.get(t.element_size(), (torch.float64,)) if d != t.dtype)
    return _filled_like(torch.empty(t.shape, dtype=other))


def _shorter(t: torch.Tensor) -> torch.Tensor:
    """``t`` less its last row."""
    return _filled_like(t[:-1])


def _replace_leaf(batch: Any, pos: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    count = iter(range(1 << 62))

    def pick(t: torch.Tensor) -> torch.Tensor:
        return fn(t) if next(count) == pos else _filled_like(t)

    return _map(pick, batch)
