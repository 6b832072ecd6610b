"""Belady eviction in the lazy ShardCache: the loader's plan, counted downloads, resume, threads.

The "remote" is a directory behind a real fsspec filesystem (the local one under the protocol
``countfile://``) that counts every download itself, independently of the cache's own stats.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from _helpers import fail_on_5 as _fail_on_5

from feedpipe import DataLoader, DistributedSampler, MemmapDataset, MemmapWriter
from feedpipe.errors import DatasetError
from feedpipe.protocols import AccessPlanDataset
from feedpipe.remote.cache import ShardCache
from feedpipe.remote.plan import AccessPlan

SHARDS, RECORDS, RECORD = 40, 16, 4096  # 64 KiB shards, 2.5 MiB in all
BATCH = 16


class Counted:
    bytes = 0
    files: ClassVar[list[str]] = []
    lock = threading.Lock()


def _register() -> None:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class CountingFileSystem(LocalFileSystem):  # type: ignore[misc]
        protocol = ("countfile",)
        root_marker = "/"

        @classmethod
        def _strip_protocol(cls, path: Any) -> str:
            text = str(path)
            if text.startswith("countfile://"):
                text = text[len("countfile://") :]
            return str(super()._strip_protocol(text))

        def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
            super().get_file(rpath, lpath, **kwargs)
            with Counted.lock:
                Counted.bytes += Path(lpath).stat().st_size
                Counted.files.append(Path(rpath).name)

    fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A block-shuffle-sized dataset behind ``countfile://``: (url, data bytes)."""
    _register()
    root = tmp_path_factory.mktemp("belady") / "src"
    rng = np.random.default_rng(0)
    with MemmapWriter(
        root, shape=(RECORD,), dtype="uint8", fields={"label": "int64"},
        shard_bytes=RECORDS * RECORD,
    ) as w:  # fmt: skip
        n = SHARDS * RECORDS
        w.append_batch(rng.integers(0, 256, (n, RECORD), dtype=np.uint8), label=np.arange(n))
    total = sum(p.stat().st_size for p in root.iterdir() if p.name != "index.json")
    return f"countfile://{root}", total


def downloaded() -> int:
    with Counted.lock:
        return Counted.bytes


def loader(ds: Any, workers: int = 0, epoch: int = 0) -> tuple[DataLoader, DistributedSampler]:
    sampler = DistributedSampler(
        ds, num_replicas=1, rank=0, shuffle_mode="block", block_size=RECORDS, seed=3
    )
    sampler.set_epoch(epoch)
    kw: dict[str, Any] = {"worker_type": "thread"} if workers else {}
    return DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers, **kw), sampler


class Recording(MemmapDataset):
    """A MemmapDataset that records the batches it is told ahead and the ones it reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.planned: list[list[int]] = []
        self.read: list[list[int]] = []
        self.starts = 0

    def plan_start(self) -> None:
        self.starts += 1
        self.planned.clear()
        super().plan_start()

    def plan_ahead(self, indices: Any) -> None:
        self.planned.append(np.asarray(indices).tolist())
        super().plan_ahead(indices)

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        self.read.append(np.asarray(indices).tolist())
        return super().read_batch(indices, out)


class NoPlan(MemmapDataset):
    def plan_horizon(self) -> int:
        return 0


def labels(batches: list[Any]) -> list[list[int]]:
    return [b["label"].tolist() for b in batches]


def test_amplification_bounded_at_a_fifth_of_the_dataset(
    tmp_path: Path, remote: tuple[str, int]
) -> None:
    workers = 0
    url, total = remote
    limit = total // 5
    ds = MemmapDataset(url, cache_dir=tmp_path / "c", cache_limit_bytes=limit)
    assert isinstance(ds, AccessPlanDataset) and ds.plan_horizon() > 0
    before = downloaded()
    dl, _ = loader(ds, workers)
    got = labels(list(dl))
    fetched = downloaded() - before
    ds.close()
    assert sorted(x for b in got for x in b) == list(range(SHARDS * RECORDS))
    assert fetched <= 1.5 * total, f"amplification {fetched / total:.2f}x"
    # the same order without the plan (LRU) fetches more: the plan is what bounds it
    lru = NoPlan(url, cache_dir=tmp_path / "lru", cache_limit_bytes=limit)
    before = downloaded()
    assert labels(list(loader(lru, workers)[0])) == got
    lru.close()
    assert downloaded() - before > fetched


def test_no_extra_download_when_the_limit_holds_the_dataset(
    tmp_path: Path, remote: tuple[str, int]
) -> None:
    url, total = remote
    ds = MemmapDataset(url, cache_dir=tmp_path / "c", cache_limit_bytes=total + total // 10)
    before = downloaded()
    for epoch in range(2):
        list(loader(ds, 2, epoch)[0])
    ds.close()
    assert downloaded() - before <= 1.05 * total


def test_lru_without_a_plan_and_farthest_first_with_one(
    tmp_path: Path, remote: tuple[str, int]
) -> None:
    url, _ = remote
    data = [f"shard-{i:05d}.data" for i in range(4)]
    size = RECORDS * RECORD
    cache = ShardCache(url, tmp_path / "c", limit_bytes=3 * size)
    for rel in data[:3]:
        with cache.leased(rel):
            pass
    with cache.leased(data[0]):  # data[1] is now the least recently used
        pass
    assert not cache.plan
    with cache.leased(data[3]):
        pass
    present = sorted(p.name for p in Path(cache.dir).glob("*.data"))
    assert present == [data[0], data[2], data[3]]  # LRU: data[1] went
    # with a plan: data[3] is needed first, data[0] next, data[2] farthest -> data[2] goes
    plan: AccessPlan = cache.plan
    plan.add("a", [data[3]])
    plan.add("b", [data[0]])
    plan.add("c", [data[2]])
    with cache.leased(data[1]):
        pass
    present = sorted(p.name for p in Path(cache.dir).glob("*.data"))
    assert present == [data[0], data[1], data[3]]
    cache.close()


def test_plan_follows_the_real_order_after_a_resume_and_set_epoch(
    tmp_path: Path, remote: tuple[str, int]
) -> None:
    url, total = remote
    limit = total // 5
    ref = Recording(url, cache_dir=tmp_path / "ref", cache_limit_bytes=limit)
    dl, sampler = loader(ref, 0, epoch=1)
    whole = labels(list(dl))
    assert ref.planned == ref.read  # the plan is exactly the read order
    ref.close()

    first = Recording(url, cache_dir=tmp_path / "c", cache_limit_bytes=limit)
    dl, _ = loader(first, 0, epoch=1)
    it = iter(dl)
    head = labels([next(it) for _ in range(7)])
    state = dl.state_dict()
    del it
    first.close()

    again = Recording(url, cache_dir=tmp_path / "c", cache_limit_bytes=limit)
    dl, sampler = loader(again, 0, epoch=1)
    dl.load_state_dict(state)
    before = downloaded()
    tail = labels(list(dl))
    assert head + tail == whole  # exact resume
    assert again.planned == again.read == [b for b in ref.read[7:]]  # the resumed order
    assert downloaded() - before <= 1.5 * total
    # next epoch: a new plan, in the new order
    sampler.set_epoch(2)
    nxt = labels(list(dl))
    assert again.starts == 2 and again.planned == again.read[-len(nxt) :]
    assert nxt != whole
    again.close()


def test_two_thread_workers_plan_the_shared_order(tmp_path: Path, remote: tuple[str, int]) -> None:
    url, total = remote
    ds = Recording(url, cache_dir=tmp_path / "c", cache_limit_bytes=total // 5)
    dl, _ = loader(ds, 2)
    before = downloaded()
    got = labels(list(dl))
    assert downloaded() - before <= 1.5 * total
    assert sorted(x for b in got for x in b) == list(range(SHARDS * RECORDS))
    assert sorted(map(tuple, ds.read)) == sorted(map(tuple, ds.planned))
    cache = ds._shard_cache()
    assert len(cache.plan) == 0  # every planned read started; nothing left pending
    ds.close()


def test_plan_memory_is_bounded(tmp_path: Path, remote: tuple[str, int]) -> None:
    """A plan nobody reads (e.g. reads in other processes) keeps at most max_reads reads."""
    plan = AccessPlan(max_reads=8)
    for i in range(100):
        plan.add(i, [f"f{i % 5}"])
    assert len(plan) == 8
    assert plan.next_use("f0") == 95  # positions 92..99 remain; f0 is read at 95
    assert plan.start(99) and plan.next_use("f4") == -1  # in flight: "now"
    assert not plan.start(12345) and plan.next_use("f4") == 94  # 99 ended; 94 is pending
    url, total = remote
    ds = MemmapDataset(url, cache_dir=tmp_path / "c", cache_limit_bytes=total // 5)
    # the loader plans twice the samples that fill the limit, never the whole dataset
    assert 0 < ds.plan_horizon() < len(ds)
    assert MemmapDataset(url, cache_dir=tmp_path / "d").plan_horizon() == 0  # unbounded: none
    ds.close()


def test_process_workers_are_not_planned(tmp_path: Path, remote: tuple[str, int]) -> None:
    """Worker processes read their own copies: the main process's dataset is not planned."""
    url, total = remote
    ds = Recording(url, cache_dir=tmp_path / "c", cache_limit_bytes=total // 5)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=1, worker_type="process")
    it = iter(dl)
    assert isinstance(next(it)["data"], torch.Tensor)
    del it
    assert ds.planned == []
    ds.close()


def test_a_bad_index_batch_fails_in_read_batch_not_in_the_plan(
    tmp_path: Path, remote: tuple[str, int]
) -> None:
    """An out-of-range index from the sampler is the worker's IndexError, as without a plan."""
    url, total = remote
    ds = Recording(url, cache_dir=tmp_path / "c", cache_limit_bytes=total // 5)
    ds.plan_ahead([len(ds) + 5])  # ignored by the plan
    assert len(ds._shard_cache().plan) == 0
    dl = DataLoader(ds, batch_sampler=[[0, 1], [len(ds) + 5]])
    it = iter(dl)
    assert next(it)["label"].tolist() == [0, 1]
    with pytest.raises(IndexError, match="out of range"):
        next(it)
    ds.close()


def test_pin_names_are_deprecated_aliases_of_lease(tmp_path: Path, remote: tuple[str, int]) -> None:
    url, _ = remote
    with ShardCache(url, tmp_path / "c", limit_bytes=None) as cache:
        with pytest.warns(DeprecationWarning, match="leased"), cache.pinned("shard-00000.data"):
            assert cache.leased_files() == ["shard-00000.data"]
            with pytest.warns(DeprecationWarning, match="leased_files"):
                assert cache.pinned_files() == ["shard-00000.data"]
        assert cache.leased_files() == []
        assert not hasattr(cache, "hold")  # removed: acquire/release or leased()


def test_a_prefetch_evicts_only_files_needed_later_than_itself(
    tmp_path: Path, remote: tuple[str, int]
) -> None:
    url, _ = remote
    data = [f"shard-{i:05d}.data" for i in range(5)]
    cache = ShardCache(url, tmp_path / "c", limit_bytes=3 * RECORDS * RECORD)
    for rel in data[:3]:
        with cache.leased(rel):
            pass
    for key, rel in enumerate([data[0], data[3], data[1], data[2]]):
        cache.plan.add(key, [rel])
    (fut,) = cache.prefetch([data[3]])  # needed second: data[2] (needed last) goes
    fut.result(timeout=30)
    present = sorted(p.name for p in Path(cache.dir).glob("*.data"))
    assert present == [data[0], data[1], data[3]]
    (fut,) = cache.prefetch([data[4]])  # not planned: it may not push out a planned file
    with pytest.raises(Exception, match="cannot make room"):
        fut.result(timeout=30)
    assert sorted(p.name for p in Path(cache.dir).glob("*.data")) == present
    cache.close()


# ====================================================================== the Belady plan
def _remote(tmp_path: Path) -> str:
    """A 64-record dataset (16 KiB shards, record ``i`` holds ``i``) behind a real fsspec
    filesystem of a remote protocol (the local one, as ``attackfile://``)."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class AttackFileSystem(LocalFileSystem):  # type: ignore[misc]
        protocol = ("attackfile",)
        root_marker = "/"

        @classmethod
        def _strip_protocol(cls, path: Any) -> str:
            text = str(path).removeprefix("attackfile://")
            return str(super()._strip_protocol(text))

    fsspec.register_implementation("attackfile", AttackFileSystem, clobber=True)
    with MemmapWriter(tmp_path / "src", shape=(512,), dtype="int64", shard_bytes=4 * 4096) as w:
        w.append_batch(np.repeat(np.arange(64, dtype=np.int64)[:, None], 512, axis=1))
    return f"attackfile://{tmp_path / 'src'}"


@pytest.mark.parametrize("workers", [0, 2])
def test_plan_holds_the_batches_read_after_known_bad_samples_drop(
    tmp_path: Path, workers: int
) -> None:
    """on_error="skip": the plan was told each batch before the known-bad samples were dropped
    from it, so the read (of the smaller batch) never matched it and its files stayed planned
    "soon" for the rest of the pass. Now every planned read is started, and the data is right."""
    url = _remote(tmp_path)
    ds = MemmapDataset(
        url, cache_dir=tmp_path / "c", cache_limit_bytes=20_000, transform=_fail_on_5
    )
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(
        ds, batch_size=4, shuffle=True, generator=gen, num_workers=workers,
        worker_type="thread", on_error="skip",
    )  # fmt: skip
    for _epoch in range(2):
        got = sorted(int(x) for b in loader for x in b[:, 0])
        assert got == [i for i in range(64) if i != 5]
        assert len(ds._shard_cache().plan) == 0  # nothing planned is left unread
    ds.close()


def test_cache_limit_below_one_shard_is_a_clear_error(tmp_path: Path) -> None:
    """A limit smaller than a shard: a DatasetError naming the file and the limit, not a wait;
    under on_error="skip" every read fails, which is now an error too (not an empty epoch)."""
    url = _remote(tmp_path)
    ds = MemmapDataset(url, cache_dir=tmp_path / "c", cache_limit_bytes=1000)
    with pytest.raises(DatasetError, match=r"shard-00000\.data: file of 16384 bytes does not fit"):
        next(iter(DataLoader(ds, batch_size=4)))
    with pytest.raises(DatasetError, match="every sample of the epoch failed"):
        list(DataLoader(ds, batch_size=4, on_error="skip"))
    ds.close()
