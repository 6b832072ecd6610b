"""Adversarial checks of worker slots (feedpipe.loader.slots), TarDataset and the layout move.

Each test is a finding (or a guard next to one): what a careless user or a hostile file does,
and what feedpipe promises then: the same batches (or the same error) as torch's
``default_collate``, and errors that name the shard."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _helpers import fresh_worker_slots as _fresh_worker_slots  # noqa: F401
from torch.utils.data import default_collate

from feedpipe import DataLoader, DatasetError, TarDataset
from feedpipe.loader import slots as slots_mod


# ------------------------------------------------------------------------------ worker slots
class Empty(tud.Dataset):  # type: ignore[type-arg]
    """Samples that are empty containers (e.g. "no boxes" as an empty list, no extras)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return {"boxes": [], "extra": {}}


@pytest.mark.parametrize("sample", [[], {}, (), {"a": [], "b": ()}])
def test_empty_containers_collate_like_torch(sample: Any) -> None:
    """Found: a batch whose samples hold no leaves at all crashed ``Slots.resolve`` with an
    IndexError in the training process (and sized the worker's slots at 0 bytes)."""
    samples = [sample, sample]
    ref = slots_mod.collate_into(samples, 4, 2)
    got = default_collate(samples) if ref is None else slots_mod.Slots(False).resolve(ref)[0]
    assert got == default_collate(samples)
    assert slots_mod.worker_slots() is None  # no zero-byte slots were laid out


def test_loader_with_empty_container_samples_matches_torch() -> None:
    kw: dict[str, Any] = {"batch_size": 4, "num_workers": 1}
    assert list(DataLoader(Empty(), **kw)) == list(tud.DataLoader(Empty(), **kw))


def _neg_strides() -> list[Any]:
    return [np.arange(6)[::-2], np.arange(6)[::-2]]


def _odd_strides() -> list[Any]:
    rec = np.zeros(4, dtype=[("a", np.int32), ("b", np.int8)])
    return [rec["a"], rec["a"]]


@pytest.mark.parametrize(
    "make",
    [
        _neg_strides,
        _odd_strides,
        lambda: [np.uint64(3), np.uint64(4)],
        lambda: [np.ones(2, np.longdouble)] * 2,
    ],
    ids=["negative strides", "strides not a multiple of itemsize", "np.uint64", "longdouble"],
)
def test_numpy_leaves_torch_refuses_go_torchs_way(make: Any) -> None:
    """Found: the slots stacked what ``default_collate`` refuses (negative strides, np.uint64
    scalars), so one dataset gave a batch from a slot but torch's error whenever no slot was
    free; a longdouble raised from ``collate_into`` outside the collate stage's error handling."""
    samples = make()
    with pytest.raises((TypeError, ValueError)):
        default_collate(samples)
    assert slots_mod.collate_into(samples, 4, 2) is None


class Rows(tud.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64) -> None:
        self.data = np.arange(n * 4, dtype=np.float32).reshape(n, 4)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return {"x": self.data[i], "i": i}


@pytest.mark.xfail(
    strict=True,
    reason="not fixed: share_memory_() (what a torch.multiprocessing queue does) moves a slot "
    "view's storage to a new segment and drops the slot's lease, while a .numpy() array taken "
    "before still points into the slot, which a worker then reuses",
)
def test_numpy_of_a_batch_shared_through_a_queue_is_never_overwritten() -> None:
    loader = DataLoader(Rows(), batch_size=8, num_workers=2)
    kept = []
    for batch in loader:
        arr = batch["x"].numpy()
        batch["x"].share_memory_()  # torch.multiprocessing.Queue.put does this
        kept.append((arr, arr.copy()))
        del batch
    assert all(np.array_equal(a, snap) for a, snap in kept)


def test_slices_and_in_place_ops_keep_their_slot() -> None:
    """Guard: a slice kept after its batch is dropped, and in-place writes to a batch."""
    ds = Rows()
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    kept = []
    for batch in loader:
        batch["x"].mul_(2)
        kept.append((batch["i"][2:5], batch["x"][2:5].numpy()[:, 1:]))
        del batch
    for idx, x in kept:
        assert np.array_equal(x, ds.data[idx.numpy()][:, 1:] * 2)
    assert loader.worker_slots["batches_in_slots"] > 0


# ------------------------------------------------------------------------------ TarDataset
def _reg(name: str, data: bytes, **pax: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.pax_headers = pax
    return info, data


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> str:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return str(path)


def test_negative_pax_size_names_shard_and_member(tmp_path: Path) -> None:
    """Found: a pax ``size=-5`` indexed fine, then every read was a bare OSError(EINVAL)."""
    shard = _tar(tmp_path / "neg.tar", [_reg("a.txt", b"hello", size="-5"), _reg("b.txt", b"y")])
    with pytest.raises(DatasetError, match=r"neg\.tar.*'a\.txt'.*negative size"):
        TarDataset(shard)


def test_huge_pax_size_names_the_shard(tmp_path: Path) -> None:
    """Found: a pax size beyond a file offset raised a bare ValueError from tarfile's seek."""
    shard = _tar(tmp_path / "huge.tar", [_reg("a.txt", b"hello", size=str(10**30))])
    with pytest.raises(DatasetError, match=r"huge\.tar"):
        TarDataset(shard)


def test_sparse_members_are_refused_naming_shard_and_member(tmp_path: Path) -> None:
    """Found: a GNU sparse member read as b"" (silently wrong bytes); a pax sparse member was
    reported as a truncated shard."""
    info = tarfile.TarInfo("g.bin")
    info.size, info.type = 4, tarfile.GNUTYPE_SPARSE
    raw = info.tobuf(format=tarfile.GNU_FORMAT) + b"abcd".ljust(512, b"\0") + b"\0" * 1024
    gnu = tmp_path / "gnu.tar"
    gnu.write_bytes(raw)
    with pytest.raises(DatasetError, match=r"gnu\.tar.*'g\.bin' is sparse"):
        TarDataset(str(gnu))
    sp, _ = _reg("s.bin", b"abcd")
    sp.pax_headers = {"GNU.sparse.size": "100000", "GNU.sparse.map": "0,4"}
    sp.pax_headers |= {"GNU.sparse.numblocks": "1", "GNU.sparse.offset": "0"}
    shard = _tar(tmp_path / "pax.tar", [(sp, b"abcd"), _reg("t.txt", b"zz")])
    with pytest.raises(DatasetError, match=r"pax\.tar.*'s\.bin' is sparse"):
        TarDataset(shard)


def test_shard_replaced_after_indexing_is_an_error_naming_it(tmp_path: Path) -> None:
    """Found: a shard rewritten with different bytes of the same length after indexing gave
    other members' bytes, silently."""
    path = tmp_path / "s.tar"
    _tar(path, [_reg("a.txt", b"A" * 100), _reg("b.txt", b"B" * 50)])
    ds = TarDataset(str(path))
    st = path.stat()
    _tar(path, [_reg("a.txt", b"A" * 50), _reg("b.txt", b"B" * 100)])  # same length
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match=r"s\.tar changed after it was indexed"):
        ds[1]


def test_odd_but_valid_tars(tmp_path: Path) -> None:
    """Guards: dots in folder names, 0-byte members, an empty tar, only directories,
    non-adjacent duplicate keys (two samples, as WebDataset), a symlinked shard."""
    d = tarfile.TarInfo("dir")
    d.type = tarfile.DIRTYPE
    main = _tar(
        tmp_path / "m.tar",
        [
            _reg("a.b/c.jpg", b"x"),
            _reg("a.b/c.cls", b""),
            _reg("k.txt", b"1"),
            _reg("z.txt", b"2"),
            _reg("k.txt", b"3"),
        ],
    )
    link = tmp_path / "link.tar"
    link.symlink_to(main)
    empty, dirs = _tar(tmp_path / "e.tar", []), _tar(tmp_path / "d.tar", [(d, None)])
    ds = TarDataset([str(link), empty, dirs])
    assert ds.keys() == ["a.b/c", "k", "z", "k"]
    assert ds[0]["jpg"] == b"x" and ds[0]["cls"] == b"" and ds[3]["txt"] == b"3"
    assert ds[0]["__url__"] == str(link)


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_tar_in_process_workers(tmp_path: Path, ctx: str) -> None:
    shard = _tar(tmp_path / "w.tar", [_reg(f"{i:03d}.cls", str(i).encode()) for i in range(20)])
    loader = DataLoader(
        TarDataset(shard),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=ctx,
        collate_fn=_fields,
    )
    got = [x for b in loader for x in b]
    assert got == [str(i).encode() for i in range(20)]


def _fields(batch: list[dict[str, Any]]) -> list[bytes]:
    return [s["cls"] for s in batch]


# ------------------------------------------------------------------------------ layout move
def test_public_paths_after_the_layout_move() -> None:
    import pickle

    from feedpipe.gpu import GPUFeed, GPUFeedWarning, Prefetcher, map_tensors, resolve_device

    import feedpipe
    import feedpipe.loader
    from feedpipe.device.feed import GPUFeed as Moved
    from feedpipe.loader.fetch import TimedCollate

    assert GPUFeed is Moved and callable(map_tensors) and callable(resolve_device)
    assert issubclass(GPUFeedWarning, Warning) and Prefetcher is not None
    assert feedpipe.loader.DataLoader is feedpipe.DataLoader
    back = pickle.loads(pickle.dumps(TimedCollate(default_collate, None)))  # type: ignore[arg-type]
    assert type(back) is TimedCollate and back.collate_fn is default_collate


class WhoAmI(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        import feedpipe

        info = feedpipe.get_worker_info()
        return -1 if info is None else info.id


def test_get_worker_info_in_thread_workers_and_auto_type() -> None:
    ids = list(DataLoader(WhoAmI(), batch_size=4, num_workers=2, worker_type="thread"))
    assert sorted(int(b[0]) for b in ids) == [0, 1]
    auto = DataLoader(WhoAmI(), batch_size=4, num_workers=2, worker_type="auto")
    assert auto.worker_type == "process"  # a per-sample __getitem__


def test_an_older_iterator_keeps_working_after_a_new_pass_starts() -> None:
    """Found: ``iter(loader)`` while an older iterator of the same (non-persistent) loader was
    still in use dropped the older workers' buffers; its next batch raised "worker slot buffer
    ... was never received". torch allows several live iterators."""
    ds = Rows(128)
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    it1 = iter(loader)
    got = [next(it1)["i"].clone() for _ in range(6)]  # the workers have seen their buffers
    it2 = iter(loader)
    got2 = [next(it2)["i"].clone()]
    got += [b["i"].clone() for b in it1]
    got2 += [b["i"].clone() for b in it2]
    for batches in (got, got2):
        assert torch.equal(torch.cat(batches), torch.arange(128))


def test_hostile_s3_shards_name_their_url(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    neg = _tar(tmp_path / "neg.tar", [_reg("a.txt", b"hello", size="-5")])
    huge = _tar(tmp_path / "huge.tar", [_reg("a.txt", b"hello", size=str(10**30))])
    for local in (neg, huge):
        url = f"s3://{bucket}/bad/{Path(local).name}"
        fs.put(local, url)
        with pytest.raises(DatasetError, match=rf"{url}"):
            TarDataset(url, storage_options=opts)


def test_worker_slots_reports_on_or_off_before_and_after_the_first_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found: ``loader.worker_slots`` was None before the first pass even when slots were on,
    so a check like ``DataLoader(..., collate_fn=f).worker_slots is None`` proved nothing."""
    on = DataLoader(Rows(16), batch_size=4, num_workers=1)
    assert on.worker_slots is not None and on.worker_slots["batches_in_slots"] == 0
    off = [
        DataLoader(Rows(16), batch_size=4, num_workers=1, collate_fn=_first),
        DataLoader(Rows(16), batch_size=4, num_workers=2, worker_type="thread"),
    ]
    for loader in off:
        assert loader.worker_slots is None
        assert len(list(loader)) == 4 and loader.worker_slots is None
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", "0")
    assert on.worker_slots is None


def _first(batch: list[Any]) -> Any:
    return batch[0]


def test_members_webdataset_skips_are_skipped(tmp_path: Path) -> None:
    """Found: a member without an extension (``README``) or a macOS ``._`` dot file became a
    sample with field ``""`` (or an extra field), where WebDataset skips it."""
    shard = _tar(
        tmp_path / "mac.tar",
        [
            _reg("README", b"r"),
            _reg("._0001.jpg", b"junk"),
            _reg("d/LICENSE", b"l"),
            _reg("0001.jpg", b"J"),
            _reg("0001.cls", b"1"),
            _reg("x/y.seg.png", b"P"),
        ],
    )
    ds = TarDataset(shard)
    assert ds.keys() == ["0001", "x/y"]
    assert ds[0]["jpg"] == b"J" and ds[1]["seg.png"] == b"P"
