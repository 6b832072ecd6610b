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

from feedpipe import DataLoader, MemmapDataset, MemmapWriter, MixedDataset, TokenWindows
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


def _fixed(path: Path, base: int = 0, n: int = N) -> MemmapDataset:
    x = (base + np.arange(n, dtype=np.int64))[:, None] * np.ones((1, 3), np.int64)
    with MemmapWriter(
        path, shape=(3,), dtype="int64", fields={"label": "int32"}, shard_bytes=200
    ) as w:
        w.append_batch(x, label=np.arange(n, dtype=np.int32) % 5)
    return MemmapDataset(path)


def _columns(path: Path) -> MemmapDataset:
    rng = np.random.default_rng(0)
    spec = {"tokens": ("int32", (None,)), "text": "str", "meta": "json", "label": "int64"}
    with MemmapWriter(path, shape=(None,), dtype="int16", fields=spec, shard_bytes=120) as w:
        for i in range(N):
            k = int(rng.integers(0, 7))
            w.append(
                np.arange(i % 5, dtype=np.int16),
                tokens=rng.integers(-5, 1000, k).astype(np.int32),
                text="é" * k + f"-{i}",
                meta={"i": i, "tags": ["x"] * (k % 3)},
                label=i * 3,
            )
    return MemmapDataset(path)


def _tokens(path: Path) -> TokenWindows:
    rng = np.random.default_rng(1)
    fields = {"tokens": ("int32", (None,))}
    with MemmapWriter(path, records=False, fields=fields, shard_bytes=160) as w:
        for k in rng.integers(0, 20, 12):
            w.append(tokens=rng.integers(0, 50_000, k).astype(np.int32))
    windows = TokenWindows(path, block_size=5)
    assert len(windows) > BATCH * (K + 1), len(windows)
    return windows


def _mixed(path: Path) -> MixedDataset:
    members = {"a": _fixed(path / "a", 1000, 13), "b": _fixed(path / "b", 2000, 5)}
    return MixedDataset(members, weights={"a": 2, "b": 1}, seed=3, epoch_samples=N)


@dataclass(frozen=True)
class Layout:
    """How samples are stored: ``make(dir)`` builds the dataset; ``torch``: torch's
    ``default_collate`` can batch its samples (else the reference is feedpipe's inline pass)."""

    name: str
    make: Callable[[Path], Any]
    torch: bool = True


LAYOUTS = [
    Layout("fixed", lambda d: _fixed(d / "fixed")),
    Layout("columns", lambda d: _columns(d / "columns"), torch=False),  # ragged, str, json
    Layout("tokens", lambda d: _tokens(d / "tokens")),
    Layout("plain", lambda d: Plain()),
    Layout("mixed", lambda d: _mixed(d / "mixed")),
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
def _copy(batch: Any) -> Any:
    """A batch with every tensor copied to the CPU (nothing keeps a worker slot or the GPU)."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().to("cpu", copy=True)
    if isinstance(batch, dict):
        return {k: _copy(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_copy(v) for v in batch)
    return batch


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
            _WANT[layout.name] = [_copy(b) for b in torch_loader]
        else:
            _WANT[layout.name] = [_copy(b) for b in _loader(ds)]
    return _WANT[layout.name]


def _run(ds: Any, resume: str, kwargs: dict[str, Any]) -> list[Any]:
    """One pass, or ``K`` batches, a saved state (through JSON) and the rest in a new loader."""
    if resume == "fresh":
        return [_copy(b) for b in _loader(ds, **kwargs)]
    first = _loader(ds, **kwargs)
    it = iter(first)
    head = [_copy(next(it)) for _ in range(K)]
    state = json.loads(json.dumps(first.state_dict()))
    del it, first
    second = _loader(ds, **kwargs)
    second.load_state_dict(state)
    return head + [_copy(b) for b in second]


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
