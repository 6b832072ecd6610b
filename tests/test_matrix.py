"""The composition matrix: every dataset layout through every worker path, device and resume
point, each compared with torch's DataLoader over the same samples (issue 25).

A case is ``layout x workers x device x resume``:

- ``LAYOUTS``: how the samples are stored (fixed-record memmap, typed/ragged columns,
  TokenWindows, a plain per-sample torch Dataset, MixedDataset over two memmaps).
- ``WORKERS``: who reads them (inline, threads, processes started by fork and by spawn).
- ``DEVICES``: where the batch lands (``cuda`` cases are marked ``gpu``).
- ``RESUMES``: ``fresh`` (one pass) or ``mid`` (``K`` batches, ``state_dict()`` through JSON,
  a new loader's ``load_state_dict()``, the rest of the pass).

The reference is torch's own DataLoader with the same shuffle seed where torch can collate the
samples, else feedpipe's inline, un-resumed pass (``Layout.torch``). A new layout or worker
path joins every case by adding one entry to its list.

Covering subset: spawn runs one worker and the ``fresh`` pass only. What differs under spawn
is how the dataset and the collate wrapper travel to a worker (pickled, not inherited), which a
fresh pass over every layout covers with one worker; the order across several workers and the
resume (arithmetic on the sampler in the main process) are checked on every layout by the other
three worker paths. Each spawned worker is a new interpreter importing torch (seconds on the
2-core VM), and the whole file must stay under 40 s there.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _helpers import columns_memmap, copy_batch, fixed_memmap, mixed, token_windows

from feedpipe import DataLoader, TokenWindows
from feedpipe.testing import assert_batches_equal

pytestmark = pytest.mark.timeout(120)

N = 22  # samples per layout: with BATCH 4, five full batches and a partial one
BATCH = 4
K = 2  # batches taken before a mid-epoch stop
SEED = 11


# --------------------------------------------------------------------------- the layouts
class Plain(tud.Dataset):  # type: ignore[type-arg]
    """A per-sample torch Dataset (torch's default path): nested, mixed-type samples."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.arange(3, dtype=torch.float32) + i, "i": i, "w": np.float32(i) / 7}


def _tokens(path: Path) -> TokenWindows:
    windows = token_windows(path)
    assert len(windows) > BATCH * (K + 1), len(windows)
    return windows


@dataclass(frozen=True)
class Layout:
    """How samples are stored: ``make(dir)`` builds the dataset; ``torch``: torch's
    ``default_collate`` can batch its samples (else the reference is feedpipe's inline pass)."""

    name: str
    make: Callable[[Path], Any]
    torch: bool = True


LAYOUTS = [
    Layout("fixed", lambda d: fixed_memmap(d / "fixed", n=N)),
    Layout("columns", lambda d: columns_memmap(d / "columns", n=N), torch=False),  # ragged, str
    Layout("tokens", lambda d: _tokens(d / "tokens")),
    Layout("plain", lambda d: Plain()),
    Layout("mixed", lambda d: mixed(d / "mixed", n=N)),
]


# ------------------------------------------------------------------------- the worker paths
@dataclass(frozen=True)
class Workers:
    """Who reads the samples: the loader's arguments, and the resume points run with them."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    resumes: tuple[str, ...] = ("fresh", "mid")


WORKERS = [
    Workers("inline"),
    Workers("thread", {"num_workers": 2, "worker_type": "thread"}),
    Workers(
        "fork", {"num_workers": 2, "worker_type": "process", "multiprocessing_context": "fork"}
    ),
    Workers(  # one worker, fresh passes only: see the module docstring
        "spawn",
        {"num_workers": 1, "worker_type": "process", "multiprocessing_context": "spawn"},
        resumes=("fresh",),
    ),
]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
RESUMES = ["fresh", "mid"]

CASES = [
    pytest.param(layout, workers, resume, id=f"{layout.name}-{workers.name}-{resume}")
    for layout, workers, resume in itertools.product(LAYOUTS, WORKERS, RESUMES)
    if resume in workers.resumes
]


# ------------------------------------------------------------------------------ the runs
def _loader(ds: Any, **kwargs: Any) -> DataLoader:
    gen = torch.Generator().manual_seed(SEED)
    return DataLoader(ds, batch_size=BATCH, shuffle=True, generator=gen, **kwargs)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("matrix")
    return {layout.name: layout.make(root) for layout in LAYOUTS}


_WANT: dict[str, list[Any]] = {}


def _reference(layout: Layout, ds: Any) -> list[Any]:
    """torch's batches for ``layout`` (same sampler seed), or feedpipe's inline pass."""
    if layout.name not in _WANT:
        if layout.torch:
            gen = torch.Generator().manual_seed(SEED)
            torch_loader = tud.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=gen)
            _WANT[layout.name] = [copy_batch(b) for b in torch_loader]
        else:
            _WANT[layout.name] = [copy_batch(b) for b in _loader(ds)]
    return _WANT[layout.name]


def _run(ds: Any, resume: str, kwargs: dict[str, Any]) -> list[Any]:
    """One pass, or ``K`` batches, a saved state (through JSON) and the rest in a new loader."""
    if resume == "fresh":
        return [copy_batch(b) for b in _loader(ds, **kwargs)]
    first = _loader(ds, **kwargs)
    it = iter(first)
    head = [copy_batch(next(it)) for _ in range(K)]
    state = json.loads(json.dumps(first.state_dict()))
    del it, first
    second = _loader(ds, **kwargs)
    second.load_state_dict(state)
    return head + [copy_batch(b) for b in second]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layout", "workers", "resume"), CASES)
def test_matrix(
    datasets: dict[str, Any], layout: Layout, workers: Workers, resume: str, device: str
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ds = datasets[layout.name]
    want = _reference(layout, ds)
    kwargs = dict(workers.kwargs)
    if device != "cpu":
        kwargs["device"] = device
    got = _run(ds, resume, kwargs)
    assert len(got) == len(want), f"{len(got)} batches, torch's loader gave {len(want)}"
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_batches_equal(a, b, f"batch {n}")


def test_the_matrix_covers_every_layout_and_worker_path() -> None:
    """Every layout meets every worker path, and every layout is resumed on some path."""
    ids = {p.id for p in CASES}
    for layout, workers in itertools.product(LAYOUTS, WORKERS):
        assert f"{layout.name}-{workers.name}-fresh" in ids
    for layout in LAYOUTS:
        assert any(f"{layout.name}-{w.name}-mid" in ids for w in WORKERS)
