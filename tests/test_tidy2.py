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
