"""MixedDataset's one-gather read path (issue 28, item 3): every batch equals a straightforward
per-sample reference of the documented layout (members' ranges, whole passes, the Feistel
permutation of the partial pass), for fixed members (one ``np.take`` over every member's map)
and typed/ragged members (read per member and merged), with weights, over several epochs, and
after a resume from a state_dict mid-epoch; the fast path reads no member's ``read_batch``, keeps
every member's shard checks, and falls back where it cannot serve."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _mix_reference import SamplesOnly, mix_loader, reference, resume_epoch, start_epoch

import feedpipe.datasets._mixed_layout as layout_module
from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets.mixed import mix_counts
from feedpipe.errors import DatasetError

WEIGHTS = {"web": 0.6, "code": 0.25, "books": 0.15}
SIZES = {"web": 70, "code": 9, "books": 20}  # web down-sampled, code up-sampled, books part
TOTAL = 90


def _fixed(path: Path, base: int, n: int, shard_bytes: int = 320, **kwargs: Any) -> MemmapDataset:
    """Records of 4 int32 whose first value is ``base + i``, in several shards."""
    x = (base + np.arange(n, dtype=np.int32))[:, None] * np.ones((1, 4), np.int32)
    x[:, 1:] = np.arange(3, dtype=np.int32) - 7  # other bytes per column
    with MemmapWriter(path, shape=(4,), dtype="int32", shard_bytes=shard_bytes) as w:
        w.append_batch(x)
    return MemmapDataset(path, **kwargs)


def _ragged(path: Path, base: int, n: int) -> MemmapDataset:
    """Typed records: ragged tokens (``i % 5`` of them), a string and a label."""
    fields = {"tokens": ("int32", (None,)), "text": "str", "label": "int64"}
    with MemmapWriter(path, records=False, fields=fields, shard_bytes=256) as w:
        for i in range(n):
            w.append(
                tokens=base + np.arange(i % 5, dtype=np.int32), text=f"{base}:{i}", label=base + i
            )
    return MemmapDataset(path, pad_value=-1)


def _fixed_members(tmp: Path, **kwargs: Any) -> dict[str, MemmapDataset]:
    return {
        name: _fixed(tmp / name, 1000 * (k + 1), n, **kwargs)
        for k, (name, n) in enumerate(SIZES.items())
    }


def _check_fixed(batch: torch.Tensor, members: dict[str, Any], want: list[tuple[str, int]]) -> None:
    rows = [members[name][s] for name, s in want]
    assert torch.equal(batch, torch.stack(rows))


@pytest.fixture(scope="module")
def fixed_members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MemmapDataset]:
    return _fixed_members(tmp_path_factory.mktemp("mixfast"))


@pytest.mark.parametrize("tabulated", [True, False])
def test_fixed_batches_equal_the_per_sample_reference_over_epochs(
    fixed_members: dict[str, MemmapDataset], monkeypatch: pytest.MonkeyPatch, tabulated: bool
) -> None:
    """Every position of three epochs, in shuffled batches: the one-gather batch is the
    reference's samples, whether the epoch is tabulated whole or located per batch (and the
    partial passes tabulated or permuted per batch)."""
    if not tabulated:
        monkeypatch.setattr(layout_module, "POSITIONS_MAX", 10)
        monkeypatch.setattr(layout_module, "TABLE_MAX", 3)
    ds = MixedDataset(fixed_members, weights=WEIGHTS, seed=5, epoch_samples=TOTAL)
    for epoch in range(3):
        ds.set_epoch(epoch)
        want = reference(SIZES, WEIGHTS, 5, epoch, TOTAL)
        order = np.random.default_rng(epoch).permutation(TOTAL)
        for batch in np.array_split(order, 7):
            _check_fixed(ds.read_batch(batch), fixed_members, [want[i] for i in batch])


def test_fast_path_reads_no_member_batch(
    fixed_members: dict[str, MemmapDataset], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fixed memmap members: one gather over their maps, never a member's read_batch."""
    ds = MixedDataset(fixed_members, weights=WEIGHTS, seed=1, epoch_samples=TOTAL)
    want = reference(SIZES, WEIGHTS, 1, 0, TOTAL)
    for member in fixed_members.values():
        monkeypatch.setattr(member, "read_batch", _refuse, raising=False)
    idx = np.arange(TOTAL)[::-1].copy()
    _check_fixed(ds.read_batch(idx), fixed_members, [want[i] for i in idx])


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a member's read_batch was called")


def test_out_is_filled_and_an_ill_fitting_out_still_merges(
    fixed_members: dict[str, MemmapDataset],
) -> None:
    ds = MixedDataset(fixed_members, weights=WEIGHTS, seed=2, epoch_samples=TOTAL)
    want = reference(SIZES, WEIGHTS, 2, 0, TOTAL)
    idx = np.array([3, 80, 60, 0, 89, 61])
    out = torch.full((10, 4), -99, dtype=torch.int32)
    got = ds.read_batch(idx, out=out)
    assert got.data_ptr() == out.data_ptr()
    _check_fixed(got, fixed_members, [want[i] for i in idx])
    assert (out[len(idx) :] == -99).all()
    strided = torch.full((6, 8), -99, dtype=torch.int32)[:, ::2]  # not contiguous
    _check_fixed(ds.read_batch(idx, out=strided), fixed_members, [want[i] for i in idx])
    with pytest.raises(ValueError, match="rows"):
        ds.read_batch(idx, out=torch.empty((2, 4), dtype=torch.int32))
    with pytest.raises(IndexError, match="out of range"):
        ds.read_batch([0, TOTAL])
    with pytest.raises(IndexError, match="out of range"):
        ds.read_batch([-1])
    assert ds.read_batch(np.empty(0, np.int64)).shape == (0, 4)


def test_members_that_cannot_share_a_gather_fall_back(tmp_path: Path) -> None:
    """A pread member, a transform or another dtype: read per member and merged (or refused by
    name, as before), with the same samples."""
    pread = _fixed_members(tmp_path / "p")
    pread["code"] = _fixed(tmp_path / "pc", 2000, SIZES["code"], read="pread")
    ds = MixedDataset(pread, weights=WEIGHTS, seed=4, epoch_samples=TOTAL)
    want = reference(SIZES, WEIGHTS, 4, 0, TOTAL)
    idx = np.random.default_rng(0).permutation(TOTAL)[:40]
    _check_fixed(ds.read_batch(idx), pread, [want[i] for i in idx])
    other = dict(pread)
    with MemmapWriter(tmp_path / "f", shape=(4,), dtype="float32") as w:
        w.append_batch(np.zeros((SIZES["code"], 4), np.float32))
    other["code"] = MemmapDataset(tmp_path / "f")
    mixed = MixedDataset(other, weights=WEIGHTS, seed=4, epoch_samples=TOTAL)
    with pytest.raises(DatasetError, match="different batches"):
        mixed.read_batch(np.arange(TOTAL))


def test_ragged_typed_members_equal_the_per_sample_reference(tmp_path: Path) -> None:
    members = {
        name: _ragged(tmp_path / name, 1000 * (k + 1), n)
        for k, (name, n) in enumerate(SIZES.items())
    }
    ds = MixedDataset(members, weights=WEIGHTS, seed=9, epoch_samples=TOTAL)
    for epoch in (0, 2):
        ds.set_epoch(epoch)
        want = reference(SIZES, WEIGHTS, 9, epoch, TOTAL)
        for batch in np.array_split(np.random.default_rng(epoch).permutation(TOTAL), 4):
            got = ds.read_batch(batch)
            samples = [members[name][s] for name, s in (want[i] for i in batch)]
            assert got["text"] == [s["text"] for s in samples]
            assert got["label"].tolist() == [int(s["label"]) for s in samples]
            for j, s in enumerate(samples):
                n = len(s["tokens"])
                assert int(got["tokens_lengths"][j]) == n
                assert torch.equal(got["tokens"][j, :n], s["tokens"])
                assert (got["tokens"][j, n:] == -1).all()


def test_resume_mid_epoch_gives_the_reference_batches(tmp_path: Path) -> None:
    """Through the loader, epoch 1: 4 batches, save both states; a fresh loader (thread
    workers) and dataset resume. The rest equals the uninterrupted run, and every batch holds
    the reference's samples of the sampler's positions, in order."""
    members = _fixed_members(tmp_path)
    ds = MixedDataset(members, weights=WEIGHTS, seed=6, epoch_samples=TOTAL)
    loader = mix_loader(ds)
    start_epoch(loader, ds, 1)
    positions = list(loader.sampler)
    full = list(loader)
    want = reference(SIZES, WEIGHTS, 6, 1, TOTAL)
    _check_fixed(torch.cat(full), members, [want[p] for p in positions])

    def make() -> MixedDataset:
        members = _fixed_members(tmp_path / "b")
        return MixedDataset(members, weights=WEIGHTS, seed=6, epoch_samples=TOTAL)

    got, _again = resume_epoch(loader, ds, 1, stop=4, make=make, workers=2)
    assert len(got) == len(full)
    for a, b in zip(got, full, strict=True):
        assert torch.equal(a, b)


def test_a_shard_rewritten_in_place_is_refused_on_the_fast_path(tmp_path: Path) -> None:
    members = _fixed_members(tmp_path)
    ds = MixedDataset(members, weights=WEIGHTS, seed=0, epoch_samples=TOTAL)
    everything = np.arange(TOTAL)
    ds.read_batch(everything)  # every shard mapped
    shard = tmp_path / "code" / "shard-00000.data"
    st = shard.stat()
    with open(shard, "r+b") as f:  # other bytes, same size
        f.write(b"\x55" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match=r"code.shard-00000\.data: shard 0 file was rewritten"):
        ds.read_batch(everything)


def test_threads_read_the_same_batches(fixed_members: dict[str, MemmapDataset]) -> None:
    ds = MixedDataset(fixed_members, weights=WEIGHTS, seed=8, epoch_samples=TOTAL)
    batches = np.array_split(np.random.default_rng(1).permutation(TOTAL), 9)
    want = [ds.read_batch(b) for b in batches]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                for b, w in zip(batches, want, strict=True):
                    assert torch.equal(ds.read_batch(b), w)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_resume_with_old_weights_in_the_epoch_already_selected(
    fixed_members: dict[str, MemmapDataset],
) -> None:
    """Found: a dataset made with new weights, resuming a state of its current epoch (0) with
    the old weights, reported the old counts but kept reading the new layout. Now the resumed
    epoch reads the old weights' layout, as the reference gives it."""
    old = {"web": 0.2, "code": 0.4, "books": 0.4}
    state = MixedDataset(fixed_members, weights=old, seed=3, epoch_samples=TOTAL).state_dict()
    ds = MixedDataset(fixed_members, weights=WEIGHTS, seed=3, epoch_samples=TOTAL)
    ds.read_batch([0, 1])  # the new weights' layout is in use
    ds.load_state_dict(state, weights=old)
    want = reference(SIZES, old, 3, 0, TOTAL)
    assert ds.counts == mix_counts([old[n] for n in SIZES], TOTAL)
    _check_fixed(ds.read_batch(np.arange(TOTAL)), fixed_members, want)
    assert [ds.locate([i])[0][0] for i in (0, TOTAL - 1)] == [0, 2]


def _write_wide(path: Path, n: int, width: int = 4096) -> np.ndarray:
    x = np.arange(n * width, dtype=np.int32).reshape(n, width) * 3 - 5
    with MemmapWriter(path, shape=(width,), dtype="int32") as w:
        w.append_batch(x)
    return x


# ---------------------------------------------------------------- held: the mixed one gather


class _NoSpace(SamplesOnly):
    """A member read through its own ``read_batch`` (no ``record_space``): the merge path."""

    takes_index_arrays = True


def test_one_gather_equals_the_merge_and_per_sample_reads(tmp_path: Path) -> None:
    """Members of 50 (many shards), 7 and 1 records, one member twice, weights that repeat and
    subsample, three epochs and a resume with the old weights: the one-gather batch is the
    merged one and the per-sample one, row for row."""
    from feedpipe import MixedDataset

    def member(name: str, n: int, shard_bytes: int) -> MemmapDataset:
        x = np.arange(n * 8, dtype=np.int32).reshape(n, 8) + 1000 * len(name) * n
        with MemmapWriter(tmp_path / name, shape=(8,), dtype="int32", shard_bytes=shard_bytes) as w:
            w.append_batch(x)
        return MemmapDataset(tmp_path / name)

    a, b, c = member("a", 50, 200), member("bb", 7, 1 << 20), member("ccc", 1, 1 << 20)
    for members, weights in (
        ({"a": a, "b": b, "c": c}, {"a": 1.0, "b": 2.0, "c": 0.5}),
        ({"a": a, "a2": a, "c": c}, {"a": 1.0, "a2": 1.0, "c": 3.0}),
    ):
        fast = MixedDataset(members, weights, seed=3, epoch_samples=61)
        slow = MixedDataset(
            {k: _NoSpace(v) for k, v in members.items()}, weights, seed=3, epoch_samples=61
        )
        for epoch in (0, 1, 7):
            fast.set_epoch(epoch)
            slow.set_epoch(epoch)
            idx = np.random.default_rng(epoch).permutation(61)
            got = fast.read_batch(idx)
            assert torch.equal(got, slow.read_batch(idx))
            assert torch.equal(got, torch.stack([fast[int(i)] for i in idx]))
        state = fast.state_dict()
        resumed = MixedDataset(members, {k: 1.0 for k in members}, seed=3, epoch_samples=61)
        resumed.load_state_dict(state, weights=weights)
        assert torch.equal(resumed.read_batch(idx), got)


def test_a_mix_batch_memory_goes_with_the_mix(tmp_path: Path) -> None:
    """The one-gather batches came from a module-level pool: up to 256 MiB per thread that ever
    read a mix stayed allocated after every mix and batch was gone."""
    import gc

    from feedpipe import MixedDataset
    from feedpipe.datasets._batch_pool import BatchPool

    def held() -> int:
        return sum(p.held() for p in gc.get_objects() if type(p) is BatchPool)

    for name in ("a", "b"):
        _write_wide(tmp_path / name, 64)
    before = held()
    mix = MixedDataset({n: MemmapDataset(tmp_path / n) for n in ("a", "b")})
    batch = mix.read_batch(np.arange(128))  # 2 MiB: from the pool
    assert held() >= before + batch.numel() * 4
    del batch, mix
    gc.collect()
    assert held() == before


@pytest.mark.parametrize(
    "indices",
    [[1.7, 2.2], np.array([True, False]), torch.tensor([1.0, 2.0]), [[1, 2], [3, 4]], ["1"]],
)
def test_mix_indices_that_are_not_integers_are_refused(tmp_path: Path, indices: Any) -> None:
    """``MixedDataset.read_batch([1.7, 2.2])`` read samples 1 and 2 (truncated), a bool mask
    read samples 1 and 0, strings were parsed: a MemmapDataset refuses all of them."""
    from feedpipe import MixedDataset

    _write_wide(tmp_path / "a", 10, width=2)
    mix = MixedDataset({"a": MemmapDataset(tmp_path / "a")})
    with pytest.raises(TypeError, match="indices must be a 1-D sequence of integers"):
        mix.read_batch(indices)
    assert torch.equal(mix.read_batch(np.array([1, 2], np.uint64)), mix.read_batch([1, 2]))


@pytest.mark.parametrize("index", [1.5, True, np.float64(2.0)])
def test_mix_item_index_that_is_not_an_int_is_refused(tmp_path: Path, index: Any) -> None:
    from feedpipe import MixedDataset

    _write_wide(tmp_path / "a", 10, width=2)
    mix = MixedDataset({"a": MemmapDataset(tmp_path / "a")})
    with pytest.raises(TypeError, match="index must be an int"):
        mix[index]


@pytest.mark.parametrize("tabulated", [True, False])
def test_shards_tabulated_or_searched_give_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tabulated: bool
) -> None:
    """Each record's shard comes from a table of every record's shard (members of up to
    SHARD_TABLE_MAX records) or a searchsorted: members of many shards (some left out of a
    batch), the same samples either way."""
    import feedpipe.datasets._mixed_take as take_module

    if not tabulated:
        monkeypatch.setattr(take_module, "SHARD_TABLE_MAX", 0)
    members = _fixed_members(tmp_path, shard_bytes=48)  # 3 records a shard
    ds = MixedDataset(members, weights=WEIGHTS, seed=2, epoch_samples=TOTAL)
    want = reference(SIZES, WEIGHTS, 2, 0, TOTAL)
    for batch in np.array_split(np.random.default_rng(3).permutation(TOTAL), 11):
        _check_fixed(ds.read_batch(batch), members, [want[i] for i in batch])


@pytest.mark.parametrize("name", ["web", "books"])
def test_every_members_guard_sees_a_rewrite_with_one_drain_per_batch(
    tmp_path: Path, name: str
) -> None:
    """The process's inotify watcher is drained once per batch, by the first member's check;
    the later members' checks see their events all the same (first and last member here). A
    batch that reads no record of the rewritten file is still served."""
    members = _fixed_members(tmp_path, shard_bytes=1 << 20)  # one shard each
    ds = MixedDataset(members, weights=WEIGHTS, seed=0, epoch_samples=TOTAL)
    everything = np.arange(TOTAL)
    ds.read_batch(everything)  # every shard mapped and watched
    shard = tmp_path / name / "shard-00000.data"
    st = shard.stat()
    with open(shard, "r+b") as f:  # other bytes, same size
        f.write(b"\x55" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    member, _sample = ds.locate(everything)
    other = everything[member != list(SIZES).index(name)]
    want = reference(SIZES, WEIGHTS, 0, 0, TOTAL)
    _check_fixed(ds.read_batch(other), members, [want[i] for i in other])
    with pytest.raises(
        DatasetError, match=rf"{name}.shard-00000\.data: shard 0 file was rewritten"
    ):
        ds.read_batch(everything)


def test_big_records_are_copied_row_by_row_into_their_places(tmp_path: Path) -> None:
    """Records of 64 KiB or more (ROW_COPY_MIN) are copied one by one in address order, each
    into its own row of the batch: the batch is the per-sample reads, in the batch's order."""
    from feedpipe.datasets._gather import ROW_COPY_MIN

    width = ROW_COPY_MIN // 4
    members = {
        name: _fixed_wide(tmp_path / name, 1000 * (k + 1), n, width)
        for k, (name, n) in enumerate({"a": 5, "b": 2, "c": 3}.items())
    }
    ds = MixedDataset(members, weights={"a": 0.5, "b": 0.3, "c": 0.2}, seed=4, epoch_samples=12)
    order = np.random.default_rng(0).permutation(12)
    got = ds.read_batch(order)
    assert torch.equal(got, torch.stack([ds[int(i)] for i in order]))
    assert len({int(r[0]) for r in got}) > 3  # several members, several records


def _fixed_wide(path: Path, base: int, n: int, width: int) -> MemmapDataset:
    x = (base + np.arange(n, dtype=np.int32))[:, None] * np.ones((1, width), np.int32)
    with MemmapWriter(path, shape=(width,), dtype="int32") as w:
        w.append_batch(x)
    return MemmapDataset(path)
