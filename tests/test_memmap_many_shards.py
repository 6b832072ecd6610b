"""Batched reads over many shards (issue 18, section 1): every shard of a fixed-record dataset is
mapped into one address range, so a batch is one gather however many shards it touches.

Correctness against per-item reads and the written records for 1 / 80 / 2,000 shards; no
per-shard system calls once the shards are mapped; open descriptors that do not grow with the
number of shards; truncated shards named in the error, with and without inotify.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from feedpipe import DatasetError, MemmapDataset
from feedpipe.format import FieldSpec, FileInfo, Index, Layout, Shard, write_index
from feedpipe.io.crc import crc32c, to_hex

SHAPE = (5,)  # 20-byte records: shards land at page- and row-aligned places with gaps between
RB = 20


def _write(tmp: Path, shards: int, per: int = 3, fields: bool = True) -> tuple[Path, np.ndarray]:
    """A dataset of ``shards`` shards of ``per`` records, written file by file (no fsync per
    file, unlike MemmapWriter: 2,000 shards in well under a second)."""
    n = shards * per
    x = np.random.default_rng(shards).integers(-(2**31), 2**31 - 1, (n, *SHAPE), dtype=np.int32)
    path = tmp / f"ds{shards}-{int(fields)}"
    path.mkdir()

    def put(name: str, data: bytes) -> FileInfo:
        (path / name).write_bytes(data)
        return FileInfo(name, len(data), to_hex(crc32c(data)))

    entries = []
    for s in range(shards):
        part = slice(s * per, (s + 1) * per)
        files = {"data": put(f"shard-{s:05d}.data", x[part].tobytes())}
        if fields:
            files["field.label"] = put(f"shard-{s:05d}.label", (np.arange(n)[part] * 7).tobytes())
        entries.append(Shard(per, files))
    spec = {"label": FieldSpec("int64")} if fields else {}
    write_index(path, Index(Layout("fixed", SHAPE, "int32"), spec, entries))
    return path, x


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, tuple[Path, np.ndarray]]:
    """Read-only datasets shared by the tests that do not modify them."""
    root = tmp_path_factory.mktemp("many")
    sets: dict[Any, tuple[Path, np.ndarray]] = {
        s: _write(root, s, per=max(3, 600 // s)) for s in (1, 80, 2000)
    }
    sets["80-nofields"] = _write(root, 80, fields=False)
    return sets


def _index_sets(n: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    rand = rng.integers(0, n, 257)
    return {
        "random": rand.tolist(),
        "sorted": np.sort(rand).tolist(),
        "duplicates": [3, 3, n - 1, 3, n - 1, 0, 0, 3],
        "out_of_order": list(range(n - 1, -1, -max(1, n // 97))),
        "negative": [-1, -n, 5, -2],
        "numpy_int32": rand.astype(np.int32),
        "numpy_uint16": (rand % 60000).astype(np.uint16) % n,
        "tensor": torch.from_numpy(rand),
        "empty": [],
    }


@pytest.mark.parametrize("shards", [1, 80, 2000])
def test_read_batch_equals_items_and_records(shared: dict[Any, Any], shards: int) -> None:
    path, x = shared[shards]
    n = len(x)
    ds = MemmapDataset(path)
    for name, idx in _index_sets(n).items():
        want = np.asarray(idx.tolist() if isinstance(idx, torch.Tensor) else idx, np.int64) % n
        got = ds.read_batch(idx)
        assert torch.equal(got["data"], torch.from_numpy(x[want].reshape(-1, *SHAPE))), name
        assert got["label"].tolist() == (want * 7).tolist(), name
        items = [ds[int(i)] for i in want]
        for j, item in enumerate(items):
            assert torch.equal(item["data"], got["data"][j]), (name, j)
            assert int(item["label"]) == int(got["label"][j]), (name, j)
        # out= buffers, larger than the batch: the result is a view of their first rows
        out = {
            "data": torch.full((300, *SHAPE), -5, dtype=torch.int32),
            "label": torch.full((300,), -5, dtype=torch.int64),
        }
        res = ds.read_batch(idx, out=out)
        if len(want):  # (an empty view's data_ptr is 0)
            assert res["data"].data_ptr() == out["data"].data_ptr(), name
        assert torch.equal(res["data"], got["data"]) and torch.equal(res["label"], got["label"])
        assert (out["data"][len(want) :] == -5).all(), name  # nothing written past the batch
        # __getitems__ (torch's per-batch hook) splits the same batch into samples
        if len(want):
            samples = ds.__getitems__(want.tolist())
            assert all(torch.equal(s["data"], items[j]["data"]) for j, s in enumerate(samples))


def test_without_fields_and_out_tensor(shared: dict[Any, Any]) -> None:
    path, x = shared["80-nofields"]
    ds = MemmapDataset(path)
    idx = np.random.default_rng(1).permutation(len(x))[:100]
    out = torch.empty((100, *SHAPE), dtype=torch.int32)
    res = ds.read_batch(idx, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, torch.from_numpy(x[idx]))
    with pytest.raises(ValueError, match="at least 100 rows"):
        ds.read_batch(idx, out=torch.empty((99, *SHAPE), dtype=torch.int32))
    with pytest.raises(IndexError, match=f"index {len(x)} is out of range"):
        ds.read_batch([0, len(x)])


def test_no_per_shard_system_calls_once_mapped(
    shared: dict[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch touching hundreds of shards costs no stat/open per shard (main: one fstat per
    shard touched, every batch)."""
    path, x = shared[2000]
    ds = MemmapDataset(path)
    ds.read_batch(np.arange(len(x)))  # maps every shard once
    ds._column("label")  # side fields are read whole once
    calls = {"n": 0}
    for name in ("stat", "fstat", "open"):
        real = getattr(os, name)

        def counted(*a: Any, _real: Any = real, **k: Any) -> Any:
            calls["n"] += 1
            return _real(*a, **k)

        monkeypatch.setattr(os, name, counted)
    idx = np.random.default_rng(2).integers(0, len(x), 512)  # touches ~450 shards
    for _ in range(5):
        got = ds.read_batch(idx)
    monkeypatch.undo()
    assert calls["n"] == 0
    assert torch.equal(got["data"], torch.from_numpy(x[idx]))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_open_descriptors_do_not_grow_with_shards(shared: dict[Any, Any]) -> None:
    path, x = shared[2000]
    gc.collect()  # datasets of earlier tests (reference cycles) close their files now, not later
    before = _fds()
    ds = MemmapDataset(path)
    ds.read_batch(np.arange(len(x)))
    for i in range(0, len(x), 7):
        ds[i]
    assert _fds() - before <= 1  # the process's inotify descriptor; main: two per shard
    ds.close()
    assert _fds() - before <= 0


def test_truncated_before_first_read_names_the_file(tmp_path: Path) -> None:
    path, x = _write(tmp_path, 500, fields=False)
    ds = MemmapDataset(path)
    os.truncate(path / "shard-00234.data", 7)
    ok = ds.read_batch([0, 1, 1400])
    assert torch.equal(ok, torch.from_numpy(x[[0, 1, 1400]]))  # other shards still read
    with pytest.raises(DatasetError, match=r"shard-00234\.data: shard 234 file is 7 bytes"):
        ds.read_batch([0, 234 * 3 + 1])
    with pytest.raises(DatasetError, match=r"shard-00234\.data"):
        ds[234 * 3]


@pytest.mark.parametrize("watch", [True, False])
def test_truncated_after_mapping_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch: bool
) -> None:
    """inotify sees the truncation; without it (watch=False), a stat per batch does."""
    path, x = _write(tmp_path, 500, fields=False)
    if not watch:
        from feedpipe.datasets._gather import ShardSpace

        real = ShardSpace.create.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(
            ShardSpace, "create", classmethod(lambda cls, *a: real(cls, *a, watch=False))
        )
    ds = MemmapDataset(path)
    ds.read_batch(np.arange(len(x)))  # every shard mapped
    os.truncate(path / "shard-00377.data", 0)
    with pytest.raises(DatasetError, match=r"shard-00377\.data: shard 377 file is now 0 bytes"):
        ds.read_batch([5, 377 * 3 + 2, 9])
    assert torch.equal(ds.read_batch([5, 9]), torch.from_numpy(x[[5, 9]]))
    with pytest.raises(DatasetError, match=r"shard-00377\.data"):  # still refused, every time
        ds.read_batch([377 * 3])
    # a same-size rewrite (what a restore from backup does) is accepted again
    (path / "shard-00377.data").write_bytes(x[377 * 3 : 377 * 3 + 3].tobytes())
    assert torch.equal(ds.read_batch([377 * 3 + 1]), torch.from_numpy(x[[377 * 3 + 1]]))


def test_missing_after_open_names_the_file(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, 80, fields=False)
    ds = MemmapDataset(path)
    (path / "shard-00042.data").unlink()
    with pytest.raises(DatasetError, match=r"shard-00042\.data: shard 42 file is missing"):
        ds.read_batch([42 * 3])


def test_over_the_map_budget_reads_per_shard(
    shared: dict[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from feedpipe.datasets import _gather

    path, x = shared[80]
    assert MemmapDataset(path)._shard_space() is not None  # within the budget: one range
    monkeypatch.setattr(_gather, "map_budget", lambda: 79)
    ds = MemmapDataset(path)
    assert ds._shard_space() is None
    idx = np.random.default_rng(3).integers(0, len(x), 200)
    assert torch.equal(ds.read_batch(idx)["data"], torch.from_numpy(x[idx]))


def test_threads_map_lazily_and_agree(shared: dict[Any, Any]) -> None:
    path, x = shared[2000]
    ds = MemmapDataset(path)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                idx = rng.integers(0, len(x), 128)
                assert torch.equal(ds.read_batch(idx)["data"], torch.from_numpy(x[idx]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def _child_sum(ds: MemmapDataset, idx: list[int], q: Any) -> None:
    q.put(int(ds.read_batch(idx).sum()))


def test_forked_child_and_pickled_copy_read_the_same(shared: dict[Any, Any]) -> None:
    path, x = shared["80-nofields"]
    ds = MemmapDataset(path)
    idx = list(range(0, len(x), 3))
    want = int(x[idx].astype(np.int64).sum())
    assert int(ds.read_batch(idx).sum()) == want  # the parent maps first
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child_sum, args=(ds, idx, q))
    child.start()
    got = q.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0 and got == want
    copy = pickle.loads(pickle.dumps(ds))
    assert int(copy.read_batch(idx).sum()) == want
    ds.close()  # closes the maps; the next read maps again
    assert int(ds.read_batch(idx).sum()) == want


def test_a_fifo_planted_for_a_shard_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A shard swapped for a named pipe after open: a clear error, never a blocked open()."""
    path, x = _write(tmp_path, 80, fields=False)
    ds = MemmapDataset(path)
    (path / "shard-00003.data").unlink()
    os.mkfifo(path / "shard-00003.data")
    with pytest.raises(DatasetError, match=r"shard-00003\.data: shard 3 file is not a regular"):
        ds.read_batch([0, 3 * 3 + 1])
    assert torch.equal(ds.read_batch([0, 5]), torch.from_numpy(x[[0, 5]]))


def _inotify_fds() -> int:
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sum("inotify" in link for link in links)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_datasets_share_one_inotify_instance(tmp_path: Path) -> None:
    """inotify instances are few (128 per user by default): one per process, not per dataset;
    and every dataset on a shared file still sees its truncation."""
    path, _x = _write(tmp_path, 80, fields=False)
    sets = [MemmapDataset(path) for _ in range(20)]
    for ds in sets:
        ds.read_batch([0, 1, 3, 100])  # shards 0, 1 and 33 mapped (and watched)
    assert _inotify_fds() <= 1
    os.truncate(path / "shard-00000.data", 4)
    for ds in sets:
        with pytest.raises(DatasetError, match=r"shard-00000\.data: shard 0 file is now 4"):
            ds.read_batch([1])
    for ds in sets[:10]:
        ds.close()  # the watch stays for the other ten
    os.truncate(path / "shard-00001.data", 4)
    with pytest.raises(DatasetError, match=r"shard-00001\.data: shard 1 file is now 4"):
        sets[15].read_batch([3 + 1])


def test_empty_shards_between_full_ones(tmp_path: Path) -> None:
    """Shards of zero records take no room in the range and never shift their neighbours."""
    counts = [3, 0, 2, 0, 0, 4, 1, 0]
    x = np.arange(sum(counts) * SHAPE[0], dtype=np.int32).reshape(-1, *SHAPE)
    path = tmp_path / "gaps"
    path.mkdir()
    entries, start = [], 0
    for s, c in enumerate(counts):
        data = x[start : start + c].tobytes()
        (path / f"shard-{s:05d}.data").write_bytes(data)
        info = FileInfo(f"shard-{s:05d}.data", len(data), to_hex(crc32c(data)))
        entries.append(Shard(c, {"data": info}))
        start += c
    write_index(path, Index(Layout("fixed", SHAPE, "int32"), {}, entries))
    ds = MemmapDataset(path, verify=True)
    idx = np.array([9, 0, 3, 4, 5, 2, 8, 1, 6, 7, 0])
    assert torch.equal(ds.read_batch(idx), torch.from_numpy(x[idx]))
    assert all(torch.equal(ds[int(i)], torch.from_numpy(x[i])) for i in idx)
