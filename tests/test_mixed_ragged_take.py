"""MixedDataset reads typed/ragged memmap members straight into one batch (issue 28, item 3):
no member's ``read_batch``, no merge; every batch equals a per-sample reference of the
documented layout and the old read-per-member-and-merge path, with weights, over several
epochs, in both ``ragged=`` modes, with members that pad with different values, after a resume
mid-epoch; a member's file rewritten in place is refused; other members fall back."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _mix_reference import SamplesOnly, mix_loader, reference, resume_epoch, start_epoch

import feedpipe.datasets._mixed_merge as merge_module
from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.errors import DatasetError

WEIGHTS = {"web": 0.6, "code": 0.25, "books": 0.15}
SIZES = {"web": 70, "code": 9, "books": 20}  # web down-sampled, code up-sampled, books part
TOTAL = 90
FIELDS: dict[str, Any] = {
    "tokens": ("int32", (None,)),
    "meta": "json",
    "text": "str",
    "label": "int64",
}


def _write(path: Path, base: int, n: int, *, records: bool = True) -> None:
    """Ragged records ``(i % 4, 2)`` int16 of ``base + i``, ragged tokens, JSON, str, label."""
    kwargs: dict[str, Any] = (
        {"shape": (None, 2), "dtype": "int16"} if records else {"records": False}
    )
    with MemmapWriter(path, fields=FIELDS, shard_bytes=96, **kwargs) as w:
        for i in range(n):
            row = {
                "tokens": base + np.arange(i % 5, dtype=np.int32),
                "meta": {"m": base, "i": i, "l": list(range(i % 3))},
                "text": f"{base}:{i}",
                "label": base + i,
            }
            if records:
                w.append(np.full((i % 4, 2), base % 1000 + i, np.int16), **row)
            else:
                w.append(**row)


def _members(tmp: Path, pads: dict[str, int] | None = None, **kwargs: Any) -> dict[str, Any]:
    out = {}
    for k, (name, n) in enumerate(SIZES.items()):
        path = tmp / name
        if not path.exists():
            _write(path, 1000 * (k + 1), n, records=kwargs.get("ragged") != "nested-none")
        pad = (pads or {}).get(name, -1)
        out[name] = MemmapDataset(path, pad_value=pad, ragged=kwargs.get("mode", "pad"))
    return out


def _reference(seed: int, epoch: int) -> list[tuple[str, int]]:
    """(member, sample) of every position of this file's mix in ``epoch``."""
    return reference(SIZES, WEIGHTS, seed, epoch, TOTAL)


def _check(got: Any, samples: list[Any], pads: list[int], mode: str) -> None:
    """A batch equals the per-sample reads ``samples`` (each row padded with ``pads[j]``)."""
    assert got["text"] == [s["text"] for s in samples]
    assert got["meta"] == [s["meta"] for s in samples]
    assert got["label"].tolist() == [int(s["label"]) for s in samples]
    for key in ("data", "tokens"):
        if mode == "nested":
            rows = got[key].unbind()
            assert len(rows) == len(samples)
            for row, s in zip(rows, samples, strict=True):
                assert torch.equal(row, s[key])
            continue
        width = max(len(s[key]) for s in samples)
        assert got[key].shape[1] == width
        for j, s in enumerate(samples):
            n = len(s[key])
            assert int(got[f"{key}_lengths"][j]) == n
            assert torch.equal(got[key][j, :n], s[key])
            assert (got[key][j, n:] == pads[j]).all()


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the typed one-read path must not call this")


def _no_member_batches(monkeypatch: pytest.MonkeyPatch, members: dict[str, Any]) -> None:
    monkeypatch.setattr(merge_module, "merge_parts", _refuse)
    monkeypatch.setattr(merge_module, "fill_out", _refuse)
    for ds in members.values():
        monkeypatch.setattr(ds, "read_batch", _refuse)


@pytest.mark.parametrize("mode", ["pad", "nested"])
def test_typed_ragged_batches_equal_the_per_sample_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    pads = {"web": -1, "code": 7, "books": -3}  # each row pads with its own member's value
    members = _members(tmp_path, pads, mode=mode)
    ds = MixedDataset(members, weights=WEIGHTS, seed=9, epoch_samples=TOTAL)
    _no_member_batches(monkeypatch, members)
    for epoch in (0, 1, 3):
        ds.set_epoch(epoch)
        want = _reference(9, epoch)
        for batch in np.array_split(np.random.default_rng(epoch).permutation(TOTAL), 4):
            got = ds.read_batch(batch)
            names = [want[i][0] for i in batch]
            samples = [members[name][s] for name, s in (want[i] for i in batch)]
            _check(got, samples, [pads[n] for n in names], mode)


class _Hidden(SamplesOnly):
    """A member seen through ``read_batch`` only: the mix reads and merges it (the old path)."""

    def __init__(self, ds: Any) -> None:
        super().__init__(ds)
        self.pad_value = ds.pad_value


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_nested or b.is_nested:
            return all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("mode", ["pad", "nested"])
def test_one_read_equals_the_merge_path(tmp_path: Path, mode: str) -> None:
    """Same keys in the same order, dtypes, widths and values as reading member by member."""
    members = _members(tmp_path, {"code": 5}, mode=mode)
    fast = MixedDataset(members, weights=WEIGHTS, seed=2, epoch_samples=TOTAL)
    hidden = {k: _Hidden(v) for k, v in members.items()}
    slow = MixedDataset(hidden, weights=WEIGHTS, seed=2, epoch_samples=TOTAL)
    for epoch in (0, 5):
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        for batch in np.array_split(np.random.default_rng(3).permutation(TOTAL), 7):
            assert _equal(fast.read_batch(batch), slow.read_batch(batch))


def test_fields_only_members_read_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = _members(tmp_path, ragged="nested-none")
    assert all(ds.kind == "none" for ds in members.values())
    ds = MixedDataset(members, weights=WEIGHTS, seed=1, epoch_samples=TOTAL)
    _no_member_batches(monkeypatch, members)
    want = _reference(1, 0)
    got = ds.read_batch(np.arange(TOTAL))
    assert "data" not in got
    samples = [members[n][s] for n, s in want]
    assert got["text"] == [s["text"] for s in samples]
    for j, s in enumerate(samples):
        assert torch.equal(got["tokens"][j, : len(s["tokens"])], s["tokens"])


def test_resume_mid_epoch_gives_the_reference_batches(tmp_path: Path) -> None:
    """Epoch 2 through the loader: 3 batches, both states saved; a fresh mix (thread workers)
    resumes, and the rest equals the uninterrupted run, which equals the reference."""
    members = _members(tmp_path)
    ds = MixedDataset(members, weights=WEIGHTS, seed=6, epoch_samples=TOTAL)
    loader = mix_loader(ds)
    start_epoch(loader, ds, 2)
    positions = list(loader.sampler)
    full = list(loader)
    want = _reference(6, 2)
    at = 0
    for batch in full:
        picks = [want[p] for p in positions[at : at + len(batch["label"])]]
        _check(batch, [members[n][s] for n, s in picks], [-1] * len(picks), "pad")
        at += len(batch["label"])
    assert at == TOTAL

    def make() -> MixedDataset:
        return MixedDataset(_members(tmp_path), weights=WEIGHTS, seed=6, epoch_samples=TOTAL)

    got, _again = resume_epoch(loader, ds, 2, stop=3, make=make, workers=2)
    assert len(got) == len(full)
    for a, b in zip(got, full, strict=True):
        assert _equal(a, b)


def test_a_member_rewritten_in_place_is_refused(tmp_path: Path) -> None:
    members = _members(tmp_path)
    ds = MixedDataset(members, weights=WEIGHTS, seed=0, epoch_samples=TOTAL)
    everything = np.arange(TOTAL)
    ds.read_batch(everything)  # every shard mapped
    shard = tmp_path / "code" / "shard-00000.tokens"
    st = shard.stat()
    size = st.st_size
    with open(shard, "r+b") as f:  # other bytes, same size
        f.write(b"\x55" * size)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match=r"code.shard-00000\.tokens: shard 0 file was rewritten"):
        ds.read_batch(everything)


def test_fixed_records_with_fields_and_transforms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fixed records with side fields: one gather for the records, one take per fixed field;
    a member with a transform sends the batch down the merge path, with the same result."""
    members = {}
    for k, (name, n) in enumerate(SIZES.items()):
        with MemmapWriter(
            tmp_path / name, shape=(3,), dtype="int32", fields={"t": "str", "y": "float32"}
        ) as w:
            for i in range(n):
                w.append(np.full(3, 100 * k + i, np.int32), t=f"{name}{i}", y=float(i) / 2)
        members[name] = MemmapDataset(tmp_path / name)
    ds = MixedDataset(members, weights=WEIGHTS, seed=4, epoch_samples=TOTAL)
    want = _reference(4, 0)
    with monkeypatch.context() as patch:
        _no_member_batches(patch, members)
        got = ds.read_batch(np.arange(TOTAL))
    samples = [members[n][s] for n, s in want]
    assert torch.equal(got["data"], torch.stack([s["data"] for s in samples]))
    assert got["t"] == [s["t"] for s in samples]
    assert torch.equal(got["y"], torch.stack([s["y"] for s in samples]))
    members["code"] = MemmapDataset(tmp_path / "code", transform=lambda s: s)
    other = MixedDataset(members, weights=WEIGHTS, seed=4, epoch_samples=TOTAL)
    assert other.read_batch(np.arange(TOTAL))["t"] == got["t"]


def test_an_out_goes_through_the_merge_and_is_filled(tmp_path: Path) -> None:
    members = _members(tmp_path)
    ds = MixedDataset(members, weights=WEIGHTS, seed=3, epoch_samples=TOTAL)
    want = ds.read_batch(np.arange(TOTAL))
    out = {"label": torch.zeros(TOTAL + 4, dtype=torch.int64)}
    got = ds.read_batch(np.arange(TOTAL), out=out)
    assert got["label"].data_ptr() == out["label"].data_ptr()
    assert _equal(got, want)


def test_a_bad_json_record_is_an_error_naming_its_member_file(tmp_path: Path) -> None:
    members = _members(tmp_path)
    shard = tmp_path / "books" / "shard-00000.meta"
    raw = bytearray(shard.read_bytes())
    raw[0:1] = b"["  # the first record's JSON no longer parses
    with open(shard, "r+b") as f:
        f.write(bytes(raw))
    members["books"] = MemmapDataset(tmp_path / "books", verify=False, pad_value=-1)
    ds = MixedDataset(members, weights=WEIGHTS, seed=3, epoch_samples=TOTAL)
    with pytest.raises(DatasetError, match=r"books.shard-00000\.meta: record 0 \(shard 0\)"):
        ds.read_batch(np.arange(TOTAL))


def test_threads_and_a_changed_mode_read_the_reference(tmp_path: Path) -> None:
    """Two threads read the same batches as one; switching the members to ``ragged="nested"``
    between batches gives nested batches (the plan follows the members' mode)."""
    members = _members(tmp_path)
    ds = MixedDataset(members, weights=WEIGHTS, seed=8, epoch_samples=TOTAL)
    batches = np.array_split(np.random.default_rng(1).permutation(TOTAL), 9)
    want = [ds.read_batch(b) for b in batches]
    got: dict[int, list[Any]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            got[t] = [ds.read_batch(b) for b in batches]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert not errors
    for k in (0, 1):
        assert all(_equal(a, b) for a, b in zip(got[k], want, strict=True))
    for m in members.values():
        m.ragged = "nested"
    nested = ds.read_batch(batches[0])
    assert nested["tokens"].is_nested
    rows = nested["tokens"].unbind()
    lengths = want[0]["tokens_lengths"].tolist()
    for j, row in enumerate(rows):
        assert torch.equal(row, want[0]["tokens"][j, : lengths[j]])


def _write_rows(path: Path, n: int, rows: Any) -> None:
    """Ragged ``(rows(i), 2)`` int16 records of ``i`` and an int64 label."""
    with MemmapWriter(
        path, fields={"label": "int64"}, shard_bytes=64, shape=(None, 2), dtype="int16"
    ) as w:
        for i in range(n):
            w.append(np.full((rows(i), 2), i, np.int16), label=i)


def test_empty_rows_of_members_that_pad_differently_keep_the_dtype(tmp_path: Path) -> None:
    """A batch whose rows are all empty, from members with different pad values: the padded
    column keeps the records' dtype (int16), as the merge and each member's own read give."""
    _write_rows(tmp_path / "z", 6, lambda i: 0)
    _write_rows(tmp_path / "a", 10, lambda i: i % 3)
    members = {
        "z": MemmapDataset(tmp_path / "z", pad_value=3),
        "a": MemmapDataset(tmp_path / "a", pad_value=5),
    }
    fast = MixedDataset(members)
    slow = MixedDataset({k: _Hidden(v) for k, v in members.items()})
    for idx in ([0, 1, 6, 9], [0, 7, 8], [6, 9], [0, 1]):  # all empty, some not, one member
        got, want = fast.read_batch(idx), slow.read_batch(idx)
        assert got["data"].dtype == torch.int16
        assert _equal(got, want)


def test_a_reassigned_pad_value_pads_the_member_and_the_mix(tmp_path: Path) -> None:
    """``ds.pad_value = v`` pads every later batch with ``v``: the member's own read, the mix's
    one read (its plan was made before) and the merge path alike; a value that does not fit the
    column is refused, naming it."""
    _write_rows(tmp_path / "a", 10, lambda i: i % 3)
    _write_rows(tmp_path / "b", 10, lambda i: i % 4)
    members = {
        "a": MemmapDataset(tmp_path / "a", pad_value=1),
        "b": MemmapDataset(tmp_path / "b", pad_value=2),
    }
    fast = MixedDataset(members)
    slow = MixedDataset({k: _Hidden(v) for k, v in members.items()})
    assert int(fast.read_batch([0, 2])["data"][0, 0, 0]) == 1  # the plan is made with 1
    members["a"].pad_value = 9
    slow.datasets["a"].pad_value = 9
    assert members["a"].read_batch(np.array([0, 2]))["data"][0].tolist() == [[9, 9], [9, 9]]
    for idx in ([0, 2], [0, 2, 11, 13]):  # one member's pad; each row its own member's
        got = fast.read_batch(idx)
        assert (got["data"][0] == 9).all()  # row 0 is empty: all pad
        assert _equal(got, slow.read_batch(idx))
    with pytest.raises(ValueError, match=r"pad_value 1000000\.0 does not fit column 'data'"):
        members["a"].pad_value = 1e6
    assert members["a"].pad_value == 9


@pytest.mark.parametrize("extra", [{}, {"s": "ab"}])
def test_json_dicts_through_the_merge_equal_the_per_sample_reads(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    """Members read member by member and merged (the path of any non-plain member): a JSON
    column of dicts whose lists have 2 items, 2 samples of each member in the batch (the one
    read, :func:`typed_take`, gives the right batch)."""
    for name, base in (("a", 0), ("b", 100)):
        with MemmapWriter(tmp_path / name, fields={"meta": "json"}, records=False) as w:
            for i in range(4):
                w.append(meta={"n": [base + i, base + i + 1], **extra})
    members = {n: MemmapDataset(tmp_path / n) for n in ("a", "b")}
    slow = MixedDataset({k: _Hidden(v) for k, v in members.items()})
    idx = [0, 1, 4, 5]
    got = slow.read_batch(idx)
    assert got["meta"] == [slow[i]["meta"] for i in idx]
