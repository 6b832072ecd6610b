"""feedpipe.DataLoader against torch's DataLoader, side by side: same batches, order, errors."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, SequentialSampler
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data._utils.collate import default_collate

import feedpipe
from feedpipe import DataLoader
from feedpipe.errors import WorkerError
from feedpipe.stall import StallMeter

WORKER_TYPES = ["process", "thread"]


class Records(Dataset):
    """Nested samples (dict, tuple, numpy, int, str) so collation structure is compared too."""

    def __init__(self, n: int = 37) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range")
        return {
            "x": torch.arange(4, dtype=torch.float32) + i,
            "pair": (np.int64(i), np.full(2, i, dtype=np.uint8)),
            "name": f"r{i}",
        }


class WithGetitems(Records):
    def __init__(self, n: int = 37) -> None:
        super().__init__(n)
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[Any]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class WithReadBatch(Dataset):
    """A dataset offering ``read_batch``: returns exactly ``default_collate`` of the samples."""

    def __init__(self, n: int = 40) -> None:
        self.data = np.arange(n * 6, dtype=np.float32).reshape(n, 6)
        self.batch_calls = 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return torch.from_numpy(self.data[i].copy()), int(i)

    def read_batch(self, indices: list[int], out: Any = None) -> Any:
        self.batch_calls += 1
        idx = np.asarray(indices)
        return [torch.from_numpy(self.data[idx]), torch.as_tensor(idx, dtype=torch.int64)]


class Stream(IterableDataset):
    """Sharded by worker with ``feedpipe.get_worker_info()`` (torch's, inside process workers)."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        info = feedpipe.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n, nw):
            yield {"i": i, "v": torch.tensor([i, -i])}


def collect(cls: type, dataset: Any, seed: int = 7, **kw: Any) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return list(cls(dataset, generator=g, **kw))


def assert_same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        _same(x, y)


def _same(x: Any, y: Any) -> None:
    assert type(x) is type(y), (type(x), type(y))
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)
    elif isinstance(x, dict):
        assert list(x) == list(y)
        for k in x:
            _same(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for u, v in zip(x, y, strict=True):
            _same(u, v)
    else:
        assert x == y


def my_collate(samples: list[Any]) -> Any:
    return default_collate(samples)


def odd_first_batches(n: int) -> list[list[int]]:
    order = [*range(1, n, 2), *range(0, n, 2)]
    return [order[i : i + 3] for i in range(0, n, 3)]


def stack_collate(samples: list[Any]) -> Any:
    return torch.stack([s["x"] for s in samples]).sum(0), [s["name"] for s in samples]


CASES = [
    {"batch_size": 4},
    {"batch_size": 4, "shuffle": True},
    {"batch_size": 5, "shuffle": True, "drop_last": True},
    {"batch_size": None, "shuffle": True},
    {"batch_size": 1},
    {"sampler": list(range(36, -1, -1)), "batch_size": 6},
    {"batch_sampler": odd_first_batches(37)},
    {"batch_size": 3, "shuffle": True, "collate_fn": stack_collate},
]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_same_batches_as_torch_process(case: int, num_workers: int) -> None:
    kw = CASES[case]
    want = collect(TorchLoader, Records(), num_workers=num_workers, **kw)
    got = collect(DataLoader, Records(), num_workers=num_workers, **kw)
    assert_same(want, got)
    assert len(DataLoader(Records(), **kw)) == len(TorchLoader(Records(), **kw))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_same_batches_as_torch_thread(case: int) -> None:
    kw = CASES[case]
    want = collect(TorchLoader, Records(), num_workers=2, **kw)
    got = collect(DataLoader, Records(), num_workers=2, worker_type="thread", **kw)
    assert_same(want, got)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_generator_advances_like_torch_across_epochs(worker_type: str) -> None:
    gt, gf = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    t = TorchLoader(Records(), batch_size=8, shuffle=True, num_workers=2, generator=gt)
    f = DataLoader(
        Records(), batch_size=8, shuffle=True, num_workers=2, generator=gf, worker_type=worker_type
    )
    for _ in range(2):
        assert_same(list(t), list(f))
    assert torch.equal(gt.get_state(), gf.get_state())


def test_global_rng_when_no_generator() -> None:
    torch.manual_seed(11)
    want = list(TorchLoader(Records(), batch_size=5, shuffle=True))
    torch.manual_seed(11)
    got = list(DataLoader(Records(), batch_size=5, shuffle=True))
    assert_same(want, got)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
@pytest.mark.parametrize("batch_size", [4, None])
def test_iterable_sharded_by_worker(
    num_workers: int, worker_type: str, batch_size: int | None
) -> None:
    kw = {"num_workers": num_workers, "batch_size": batch_size}
    want = list(TorchLoader(Stream(), **kw))
    got = list(DataLoader(Stream(), worker_type=worker_type, **kw))
    assert_same(want, got)
    if batch_size:
        assert len(DataLoader(Stream(), batch_size=batch_size)) == math.ceil(23 / batch_size)


def test_iterable_drop_last_with_workers() -> None:
    kw = {"num_workers": 2, "batch_size": 5, "drop_last": True}
    want = list(TorchLoader(Stream(), **kw))
    for wt in WORKER_TYPES:
        assert_same(want, list(DataLoader(Stream(), worker_type=wt, **kw)))


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_getitems_called_once_per_batch(worker_type: str) -> None:
    ds = WithGetitems()
    want = collect(TorchLoader, WithGetitems(), batch_size=5, shuffle=True)
    got = collect(
        DataLoader,
        ds,
        batch_size=5,
        shuffle=True,
        num_workers=2 if worker_type == "thread" else 0,
        worker_type=worker_type,
    )
    assert_same(want, got)
    assert len(ds.calls) == 8 and sorted(i for c in ds.calls for i in c) == list(range(37))


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_read_batch_replaces_collation(worker_type: str, num_workers: int) -> None:
    ds = WithReadBatch()
    want = collect(
        TorchLoader, WithReadBatch(), batch_size=6, shuffle=True, num_workers=num_workers
    )
    got = collect(
        DataLoader, ds, batch_size=6, shuffle=True, num_workers=num_workers, worker_type=worker_type
    )
    assert_same(want, got)
    if num_workers == 0 or worker_type == "thread":
        assert ds.batch_calls == 7  # one call per batch, in this process
    # a custom collate_fn keeps torch's per-sample path
    ds2 = WithReadBatch()
    got2 = collect(DataLoader, ds2, batch_size=6, collate_fn=my_collate)
    assert ds2.batch_calls == 0 and len(got2) == 7


class Probe(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = feedpipe.get_worker_info()
        assert info is None or isinstance(info.dataset, Probe)  # the user's dataset, not a wrapper
        return (-1, -1) if info is None else (info.id, info.num_workers)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_get_worker_info_inside_workers(worker_type: str) -> None:
    seen: list[int] = []

    def init(wid: int) -> None:
        info = feedpipe.get_worker_info()
        assert info is not None and info.id == wid and isinstance(info.dataset, Probe)

    loader = DataLoader(
        Probe(), batch_size=2, num_workers=2, worker_type=worker_type, worker_init_fn=init
    )
    for ids, nws in loader:
        seen += ids.tolist()
        assert nws.tolist() == [2, 2]
    assert seen == [0, 0, 1, 1, 0, 0, 1, 1]  # torch's round-robin assignment
    assert feedpipe.get_worker_info() is None
    assert [b[0].tolist() for b in DataLoader(Probe(), batch_size=4)] == [[-1] * 4] * 2


MISUSE = [
    ({"batch_sampler": [[0, 1]], "batch_size": 2}, ValueError),
    ({"batch_sampler": [[0, 1]], "shuffle": True}, ValueError),
    ({"sampler": [0, 1], "shuffle": True}, ValueError),
    ({"batch_size": None, "drop_last": True}, ValueError),
    ({"num_workers": -1}, ValueError),
    ({"timeout": -1}, ValueError),
    ({"prefetch_factor": 2}, ValueError),
    ({"persistent_workers": True}, ValueError),
    ({"multiprocessing_context": "fork"}, ValueError),
    ({"num_workers": 1, "multiprocessing_context": "nope"}, ValueError),
]


@pytest.mark.parametrize("case", range(len(MISUSE)))
def test_same_errors_for_misuse(case: int) -> None:
    kw, exc = MISUSE[case]
    with pytest.raises(exc) as want:
        TorchLoader(Records(), **kw)
    with pytest.raises(exc) as got:
        DataLoader(Records(), **kw)
    assert str(got.value) == str(want.value)


def test_iterable_misuse_errors_match() -> None:
    for kw in ({"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}):
        with pytest.raises(ValueError) as want:
            TorchLoader(Stream(), **kw)
        with pytest.raises(ValueError) as got:
            DataLoader(Stream(), **kw)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="worker_type"):
        DataLoader(Records(), worker_type="fiber")


def test_signature_matches_torch() -> None:
    import inspect

    ours = inspect.signature(DataLoader.__init__).parameters
    theirs = inspect.signature(TorchLoader.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, p in theirs.items():
        assert ours[name].default == p.default and ours[name].kind == p.kind, name
    assert ours["worker_type"].kind is inspect.Parameter.KEYWORD_ONLY
    assert isinstance(DataLoader(Records()), TorchLoader)


@pytest.mark.parametrize(
    ("worker_type", "num_workers"), [("process", 0), *[(w, 2) for w in WORKER_TYPES]]
)
def test_meter_counts_batches_and_stages(worker_type: str, num_workers: int) -> None:
    meter = StallMeter()
    loader = DataLoader(
        Records(), batch_size=4, num_workers=num_workers, worker_type=worker_type, meter=meter
    )
    assert loader.meter is meter
    n = sum(1 for _ in loader)
    stats = loader.stats
    assert stats.batches == n == 10 and stats.samples == 37
    assert stats.bytes == 37 * (16 + 8 + 2)  # float32 x4, int64, uint8 x2 per sample
    assert stats.workers == num_workers
    for stage in ("fetch", "collate"):
        assert stats.stages[stage].calls == 10 and stats.stages[stage].seconds > 0
        assert stats.stages[stage].bytes == stats.bytes
    assert DataLoader(Records()).meter is not DataLoader(Records()).meter  # one per loader


def test_persistent_workers_same_as_torch() -> None:
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    gt, gf = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    t, f = TorchLoader(Records(), generator=gt, **kw), DataLoader(Records(), generator=gf, **kw)
    th = DataLoader(
        Records(), generator=torch.Generator().manual_seed(1), worker_type="thread", **kw
    )
    for _ in range(2):
        want = list(t)
        assert_same(want, list(f))
        assert_same(want, list(th))


def test_in_order_false_delivers_every_batch() -> None:
    for wt in WORKER_TYPES:
        got = list(
            DataLoader(Records(), batch_size=4, num_workers=2, in_order=False, worker_type=wt)
        )
        names = sorted(n for b in got for n in b["name"])
        assert names == sorted(f"r{i}" for i in range(37))


def test_batch_sampler_object_and_len() -> None:
    bs = BatchSampler(SequentialSampler(range(37)), 8, drop_last=False)
    assert len(DataLoader(Records(), batch_sampler=bs)) == 5
    assert_same(
        list(TorchLoader(Records(), batch_sampler=bs)),
        list(DataLoader(Records(), batch_sampler=bs)),
    )


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_iterable_len_warning_like_torch(worker_type: str) -> None:
    class Liar(Stream):
        def __len__(self) -> int:
            return 2  # batch_size=None: torch warns from the third batch on

    for cls, kw in ((TorchLoader, {}), (DataLoader, {"worker_type": worker_type})):
        loader = cls(Liar(), batch_size=None, **kw)
        assert len(loader) == 2
        with pytest.warns(UserWarning, match="Length of IterableDataset"):
            list(loader)


def test_pin_memory_without_accelerator_warns_like_torch() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: pinning happens")
    for cls, kw in ((TorchLoader, {}), (DataLoader, {}), (DataLoader, {"worker_type": "thread"})):
        with pytest.warns(UserWarning, match="no accelerator is found"):
            got = list(cls(Records(), batch_size=8, pin_memory=True, num_workers=2, **kw))
        assert len(got) == 5


def test_timeout_without_workers_fails_like_torch() -> None:
    for cls in (TorchLoader, DataLoader):
        with pytest.raises(AssertionError, match="timeout == 0"):
            iter(cls(Records(), timeout=1))


@pytest.mark.slow
def test_spawn_context_same_as_torch() -> None:
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2, "multiprocessing_context": "spawn"}
    assert_same(collect(TorchLoader, Records(), **kw), collect(DataLoader, Records(), **kw))
    kw = {"batch_size": 3, "num_workers": 2, "multiprocessing_context": "spawn"}
    assert_same(list(TorchLoader(Stream(), **kw)), list(DataLoader(Stream(), **kw)))


class IntoOut(WithReadBatch):
    def read_batch(self, indices: list[int], out: Any = None) -> Any:
        batch = super().read_batch(indices)
        if out is None:
            return batch
        out[0][: len(indices)].copy_(batch[0])
        out[1][: len(indices)].copy_(batch[1])
        return [out[0][: len(indices)], out[1][: len(indices)]]


def test_thread_workers_gather_into_caller_buffers() -> None:
    """The plug point for a device feed: ``out_for(batch, rows)`` gives the destination."""
    from feedpipe.loader.fetch import Mode
    from feedpipe.loader.threads import ThreadWorkers

    ds = IntoOut()
    slots = {n: [torch.empty(6, 6), torch.empty(6, dtype=torch.int64)] for n in range(7)}
    workers = ThreadWorkers(
        ds,
        iter(BatchSampler(SequentialSampler(ds), 6, drop_last=False)),
        default_collate,
        Mode.READ_BATCH,
        num_workers=2,
        prefetch_factor=2,
        base_seed=0,
        timeout=10,
        worker_init_fn=None,
        pin=False,
        in_order=True,
        drop_last=False,
        out_for=lambda n, rows: slots[n],
    )
    got = list(workers)
    want = list(TorchLoader(WithReadBatch(), batch_size=6))
    assert_same([s[0] for s in got], want)
    for n, shipped in enumerate(got):
        assert shipped[0][0].data_ptr() == slots[n][0].data_ptr()


_ALIVE_AT_EXIT = """
import time, numpy as np, feedpipe
class DS:
    def __len__(self): return 1000
    def __getitem__(self, i): return np.full(4, i)
it = iter(feedpipe.DataLoader(DS(), batch_size=2, num_workers=2, worker_type="thread"))
next(it)
print(time.monotonic(), flush=True)
"""


@pytest.mark.serial
def test_a_thread_iterator_alive_at_exit_does_not_delay_the_interpreter() -> None:
    """Idle worker threads of an iterator still alive at exit are told to stop (the exit hook
    waited 10 s for threads blocked on an empty inbox)."""
    import subprocess
    import sys
    import time

    proc = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        [sys.executable, "-c", _ALIVE_AT_EXIT], capture_output=True, text=True, timeout=60
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    took = ended - float(proc.stdout.split()[-1])  # CLOCK_MONOTONIC: one clock per machine
    assert took < 5.0, f"the interpreter took {took:.1f} s to exit after the last batch"


class _StuckAt2(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i == 2:
            time.sleep(1.5)
        return i


@pytest.mark.timeout(60)
@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_thread_timeout_is_not_doubled_by_the_first_round() -> None:
    loader = DataLoader(_StuckAt2(), batch_size=2, num_workers=2, worker_type="thread", timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"timed out after 0\.3 s"):
        list(loader)
    assert time.monotonic() - t0 < 0.5


@pytest.mark.timeout(60)
def test_explicit_default_convert_with_a_batch_size_gives_torchs_list() -> None:
    """Found by the dataset contract suite: collate_fn=default_convert with batch_size set was
    taken as the default collation, so a read_batch dataset returned a stacked batch where torch
    returns a list of converted samples."""
    import tempfile

    from torch.utils.data import DataLoader as TorchLoader
    from torch.utils.data._utils.collate import default_convert

    from feedpipe import MemmapDataset, MemmapWriter

    with tempfile.TemporaryDirectory() as tmp:
        with MemmapWriter(tmp, shape=(3,), dtype="float32") as w:
            w.append_batch(np.arange(24, dtype=np.float32).reshape(8, 3))
        ds = MemmapDataset(tmp)
        ours = list(DataLoader(ds, batch_size=4, collate_fn=default_convert))
        theirs = list(TorchLoader(ds, batch_size=4, collate_fn=default_convert))
        assert [type(b) for b in ours] == [type(b) for b in theirs] == [list, list]
        for a, b in zip(ours, theirs, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
