"""MixedDataset merges its members' batches by what each list is, never guessed from values
(issue 28 item 3, ``feedpipe/datasets/_mixed_shape.py``): JSON columns of every shape (dicts
whose lists have as many items as the part has samples, nested values, empty lists and dicts,
strings, top-level lists) read in one pass, merged from declared members
(``MemmapDataset.per_sample_keys``) and merged from members known only by their samples equal
the per-sample reads; lists of collated fields (tuple samples) as wide as the part has samples
are still fields; members that disagree are refused, naming both."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _mix_reference import SamplesOnly

import feedpipe.datasets._mixed_merge as merge_module
from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets._mixed_shape import sample_shape
from feedpipe.errors import DatasetError

N = 4  # records per member: member "a" is positions 0-3, "b" 4-7
JSON: dict[str, Callable[[int, int], Any]] = {
    "dict of lists as long as the part": lambda base, i: {"n": [base + i, base + i + 1]},
    "nested": lambda base, i: {"a": {"b": [base + i, [base]]}, "c": [{"d": i}, {"e": []}]},
    "empty lists and dicts": lambda base, i: {"l": [], "m": {}, "k": [[]] * (i % 2)},
    "strings": lambda base, i: f"s{base + i}",
    "dict of strings": lambda base, i: {"s": "ab", "t": [str(i), "x"]},
    "top-level list as long as the part": lambda base, i: [base + i, base + i + 1],
    "top-level empty list": lambda base, i: [],
    "top-level lists of any length": lambda base, i: [base] * (i % 3),
}
# a top-level JSON list is a sequence sample: only a declared member says it is per-sample
BY_SAMPLES = [k for k in JSON if not k.startswith("top-level")]
BATCHES = [[0, 1, 4, 5], [4, 0, 5, 1, 2], [0, 4], [6, 3, 7, 2, 5, 1, 4, 0]]


def _write(path: Path, base: int, value: Callable[[int, int], Any], order: int) -> None:
    fields: dict[str, Any] = {"meta": "json", "label": "int64"}
    if order:  # the other member's column order: no one-pass read, the merge
        fields = dict(reversed(fields.items()))
    with MemmapWriter(path, fields=fields, records=False) as w:
        for i in range(N):
            w.append(meta=value(base, i), label=base + i)


def _members(tmp: Path, value: Callable[[int, int], Any], orders: tuple[int, int]) -> Any:
    out = {}
    for (name, base), order in zip((("a", 0), ("b", 100)), orders, strict=True):
        _write(tmp / name, base, value, order)
        out[name] = MemmapDataset(tmp / name)
    return out


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the merges (the merge path ran, not the one-pass read)."""
    calls: list[int] = []
    real = merge_module.merge_parts

    def merge_parts(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_module, "merge_parts", merge_parts)
    return calls


def _check(ds: MixedDataset) -> None:
    for idx in BATCHES:
        got = ds.read_batch(np.asarray(idx, np.int64))
        want = [ds[i] for i in idx]
        assert got["meta"] == [s["meta"] for s in want], idx
        assert got["label"].tolist() == [int(s["label"]) for s in want]


@pytest.mark.parametrize("shape", list(JSON))
def test_json_columns_read_in_one_pass_equal_the_per_sample_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    ds = MixedDataset(_members(tmp_path, JSON[shape], (0, 0)))
    merges = _spy(monkeypatch)
    _check(ds)
    assert not merges  # the one-pass read (typed_take)


@pytest.mark.parametrize("shape", list(JSON))
def test_json_columns_merged_from_declared_members_equal_the_per_sample_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    members = _members(tmp_path, JSON[shape], (0, 1))
    assert members["a"].per_sample_keys() == {"meta"}
    ds = MixedDataset(members)
    merges = _spy(monkeypatch)
    _check(ds)
    assert len(merges) == len(BATCHES)


@pytest.mark.parametrize("shape", BY_SAMPLES)
def test_json_columns_merged_from_members_known_by_their_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    members = _members(tmp_path, JSON[shape], (0, 0))
    ds = MixedDataset({k: SamplesOnly(v) for k, v in members.items()})
    merges = _spy(monkeypatch)
    _check(ds)
    assert len(merges) == len(BATCHES)
    _check(pickle.loads(pickle.dumps(ds)))  # a copy (a process worker's) learns them again
    assert len(merges) == 2 * len(BATCHES)


class _Pairs:
    """Tuple samples ``(text, tensor of 2)``: ``default_collate`` makes a list of 2 fields."""

    def __init__(self, base: int) -> None:
        self.base = base

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return (f"t{self.base + i}", torch.tensor([self.base + i, i]))

    def read_batch(self, idx: Any) -> Any:
        from torch.utils.data import default_collate

        return default_collate([self[int(i)] for i in idx])


def test_a_list_of_fields_as_wide_as_the_part_has_samples_is_fields() -> None:
    """Two fields, two samples of each member: merged field by field, as one dataset gives."""
    ds = MixedDataset({"a": _Pairs(0), "b": _Pairs(100)})
    assert sample_shape(ds[0]) == (None, None)
    for idx in BATCHES:
        text, values = ds.read_batch(idx)
        assert text == [ds[i][0] for i in idx]
        assert torch.equal(values, torch.stack([ds[i][1] for i in idx]))


class _Texts(_Pairs):
    """One string per sample: a per-sample list where ``_Pairs`` has a list of fields (two
    samples of each: both lists have two items)."""

    def __getitem__(self, i: int) -> Any:
        return f"x{i}"

    def read_batch(self, idx: Any) -> Any:
        return [self[int(i)] for i in idx]


def test_members_whose_lists_differ_are_refused_naming_both() -> None:
    ds = MixedDataset({"pairs": _Pairs(0), "texts": _Texts(100)})
    with pytest.raises(
        DatasetError, match=r"list of fields in 'pairs'.*per-sample list in 'texts'"
    ):
        ds.read_batch([0, 1, 4, 5])


def test_a_member_whose_batch_is_not_as_wide_as_its_samples_is_refused() -> None:
    class Wider(_Pairs):
        def read_batch(self, idx: Any) -> Any:
            text, values = super().read_batch(idx)
            return [text, values, values]

    ds = MixedDataset({"a": _Pairs(0), "b": Wider(100)})
    with pytest.raises(DatasetError, match=r"3 fields in 'b'.s batch, 2 in its samples"):
        ds.read_batch([0, 1, 4, 5])


def test_sample_shapes_follow_default_collate() -> None:
    t = torch.zeros(2)
    assert sample_shape({"a": (t, "s"), "b": {"c": [1, 2]}, "d": "x"}) == {
        "a": (None, None),
        "b": {"c": (None, None)},
        "d": None,
    }
    assert sample_shape(t) is None and sample_shape("abc") is None and sample_shape([]) == ()


class _Numbers(_Texts):
    """A tensor where ``_Texts`` has a per-sample list of strings."""

    def read_batch(self, idx: Any) -> Any:
        return torch.arange(len(idx))


def test_a_list_and_a_tensor_are_refused_naming_both() -> None:
    ds = MixedDataset({"texts": _Texts(0), "numbers": _Numbers(100)})
    with pytest.raises(DatasetError, match=r"'texts' and 'numbers'.*a list and a Tensor"):
        ds.read_batch([0, 1, 4, 5])
