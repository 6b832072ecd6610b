"""The tidy2 items: small code-quality and correctness fixes, one section each."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import feedpipe
from feedpipe.loader import threads

# ------------------------------------------------------------------ 1: thread worker options


def test_thread_worker_takes_one_frozen_options_object() -> None:
    """``_worker_loop`` and ``_worker_body`` take (wid, dataset, inbox, options): the shared
    settings travel in one frozen dataclass instead of a 17-parameter signature."""
    for fn in (threads._worker_loop, threads._worker_body):
        params = list(inspect.signature(fn).parameters)
        assert params == ["wid", "dataset", "inbox", "opts"], fn.__name__
    opts_type = threads._WorkerOptions
    assert dataclasses.is_dataclass(opts_type)
    assert opts_type.__dataclass_params__.frozen  # type: ignore[attr-defined]


class _Squares(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i * i


def _seen_seed(_: int) -> None:
    info = feedpipe.get_worker_info()
    assert info is not None
    _SEEDS.append((info.id, info.num_workers, info.seed))


_SEEDS: list[tuple[int, int, int]] = []


def test_thread_workers_behave_as_before() -> None:
    """Same batches, order, worker info and init hook as torch's process workers would give."""
    _SEEDS.clear()
    loader = feedpipe.DataLoader(
        _Squares(), batch_size=4, num_workers=3, worker_type="thread", worker_init_fn=_seen_seed,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    out = torch.cat(list(loader))
    assert out.tolist() == [i * i for i in range(40)]
    assert sorted(s[:2] for s in _SEEDS) == [(0, 3), (1, 3), (2, 3)]
    seeds = sorted(s[2] for s in _SEEDS)
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    with pytest.raises(ZeroDivisionError):
        list(feedpipe.DataLoader(_Squares(), num_workers=2, worker_type="thread",
                                 worker_init_fn=lambda w: 1 // 0))  # fmt: skip


# ------------------------------------------------------------------ 2: one column type in format


def test_layout_and_field_share_one_column_type() -> None:
    """``Layout`` and ``FieldSpec`` are one column type (shared sizes and JSON), not two copies."""
    from feedpipe.datasets.format import FieldSpec, Layout

    for name in ("record_bytes", "row_bytes", "to_json"):
        assert getattr(Layout, name) is getattr(FieldSpec, name), name


@pytest.mark.parametrize(
    ("spec", "doc", "record", "row"),
    [
        (
            ("L", "fixed", (2, 3), "int32"),
            {"kind": "fixed", "shape": [2, 3], "dtype": "int32"},
            24,
            24,
        ),
        (("L", "bytes"), {"kind": "bytes"}, 0, 1),
        (("L", "none"), {"kind": "none"}, 0, 1),
        (
            ("L", "ragged", (4,), "float16"),
            {"kind": "ragged", "shape": [None, 4], "dtype": "float16"},
            0,
            8,
        ),
        (("F", "int64"), {"dtype": "int64", "shape": []}, 8, 8),
        (("F", "uint8", (5,)), {"dtype": "uint8", "shape": [5]}, 5, 5),
        (
            ("F", "int32", (2,), "ragged"),
            {"kind": "ragged", "dtype": "int32", "shape": [None, 2]},
            0,
            8,
        ),
        (("F", "uint8", (), "str"), {"kind": "str"}, 0, 1),
        (("F", "uint8", (), "json"), {"kind": "json"}, 0, 1),
    ],
)
def test_column_json_and_sizes_are_unchanged(
    spec: tuple[object, ...], doc: dict[str, object], record: int, row: int
) -> None:
    """The exact JSON (key order included, so index.json bytes do not change) and sizes."""
    from feedpipe.datasets.format import FieldSpec, Layout, _parse_fields, _parse_layout

    cls = Layout if spec[0] == "L" else FieldSpec
    col = cls(*spec[1:])  # type: ignore[arg-type]
    assert list(col.to_json().items()) == list(doc.items())
    assert (col.record_bytes, col.row_bytes) == (record, row)
    back = _parse_layout(doc) if cls is Layout else _parse_fields({"f": doc})["f"]
    assert back == col
