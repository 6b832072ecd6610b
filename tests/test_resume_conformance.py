"""One resume test for every dataset kind x worker kind (as torchdata runs one resume test
across its node types): a seeded pass records every batch and the loader's ``state_dict()``
after a few batches; a fresh loader resumed from each state must give exactly the rest.

A new dataset kind joins by adding a ``Kind``; a new worker path by adding a ``WORKERS`` entry.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import (
    bytes_memmap,
    columns_memmap,
    copy_batch,
    fixed_memmap,
    mixed,
    tar_shards,
    token_windows,
    zarr_group,
)

from feedpipe import DataLoader, TarDataset
from feedpipe.testing import assert_batches_equal

pytestmark = pytest.mark.timeout(120)

BATCH = 4
SEED = 5
STOPS = (1, 3, 5)  # batches delivered before a state is taken (a pass has 6 or more)


def _tar_collate(samples: list[dict[str, Any]]) -> list[tuple[str, bytes, bytes]]:
    return [(s["__key__"], s["bin"], s["cls"]) for s in samples]


def _zarr(path: Path) -> Any:
    pytest.importorskip("zarr")
    from feedpipe import ZarrDataset

    return ZarrDataset(zarr_group(path))


@dataclass(frozen=True)
class Kind:
    """A dataset kind: ``make(dir)`` builds a tiny one; ``kwargs`` go to the loader."""

    name: str
    make: Callable[[Path], Any]
    kwargs: tuple[tuple[str, Any], ...] = ()


KINDS = [
    Kind("fixed", fixed_memmap),
    Kind("columns", columns_memmap),  # ragged, str and json columns
    Kind("bytes", bytes_memmap),
    Kind("tokens", token_windows),
    Kind("zarr", _zarr),
    Kind("mixed", mixed),
    Kind("tar", lambda d: TarDataset(tar_shards(d)), (("collate_fn", _tar_collate),)),
]

WORKERS: dict[str, dict[str, Any]] = {
    "inline": {"num_workers": 0},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "fork": {"num_workers": 2, "worker_type": "process", "multiprocessing_context": "fork"},
}


def _seeded_loader(ds: Any, kind: Kind, workers: str) -> DataLoader:
    gen = torch.Generator().manual_seed(SEED)
    return DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=gen, **dict(kind.kwargs), **WORKERS[workers]
    )


def _pass_and_states(
    ds: Any, kind: Kind, workers: str
) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """Every batch of one pass, and the state (through JSON) after each of ``STOPS`` batches."""
    loader = _seeded_loader(ds, kind, workers)
    batches, states = [], {}
    for batch in loader:
        batches.append(copy_batch(batch))
        if len(batches) in STOPS:
            states[len(batches)] = json.loads(json.dumps(loader.state_dict()))
    return batches, states


_BUILT: dict[str, Any] = {}


@pytest.mark.parametrize(
    ("kind", "workers"),
    [pytest.param(k, w, id=f"{k.name}-{w}") for k, w in itertools.product(KINDS, WORKERS)],
)
def test_resume_gives_the_rest_of_the_pass(
    tmp_path_factory: pytest.TempPathFactory, kind: Kind, workers: str
) -> None:
    if kind.name not in _BUILT:
        _BUILT[kind.name] = kind.make(tmp_path_factory.mktemp(kind.name) / kind.name)
    ds = _BUILT[kind.name]
    batches, states = _pass_and_states(ds, kind, workers)
    assert len(batches) > max(STOPS), f"{len(batches)} batches: the dataset is too small"
    assert sorted(states) == list(STOPS)
    for stop, state in states.items():
        resumed = _seeded_loader(ds, kind, workers)
        resumed.load_state_dict(state)
        rest = [copy_batch(b) for b in resumed]
        assert len(rest) == len(batches) - stop, f"resumed after {stop}: {len(rest)} batches"
        for n, (got, want) in enumerate(zip(rest, batches[stop:], strict=True)):
            assert_batches_equal(got, want, f"resumed after {stop}, batch {stop + n}")


def test_every_dataset_kind_meets_every_worker_kind() -> None:
    assert {k.name for k in KINDS} >= {"fixed", "columns", "bytes", "tokens", "zarr", "mixed"}
    assert set(WORKERS) == {"inline", "thread", "fork"}
