"""feedpipe.TokenWindows (issue 19, point 3): fixed windows over the concatenation of
variable-length documents, the index from the shards' sizes, one read per window (two across
a shard boundary), the dataset contract, shuffling, and exact and elastic resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import DataLoader, DistributedSampler, MemmapDataset, MemmapWriter, TokenWindows
from feedpipe.datasets._memmap_files import ShardSource
from feedpipe.errors import DatasetError
from feedpipe.testing import DatasetContractTests, assert_batches_equal


def _corpus(path: Path, docs: int = 120, seed: int = 0, shard_bytes: int = 400) -> np.ndarray:
    """A token corpus (a ragged ``tokens`` field, no records column); returns its concatenation."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, docs)
    lengths[[3, 4, 5]] = 0  # empty documents
    tokens = [rng.integers(0, 50_000, k).astype(np.int32) for k in lengths]
    with MemmapWriter(
        path, records=False, fields={"tokens": ("int32", (None,))}, shard_bytes=shard_bytes
    ) as w:
        for t in tokens:
            w.append(tokens=t)
    return np.concatenate(tokens)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("tok") / "ds"
    return path, _corpus(path)


@pytest.mark.parametrize("block", [1, 7, 64, 500])
def test_windows_are_slices_of_the_concatenation(
    corpus: tuple[Path, np.ndarray], block: int
) -> None:
    path, cat = corpus
    tw = TokenWindows(path, block_size=block)
    assert len(tw) == len(cat) // block and tw.num_tokens == len(cat)
    order = np.random.default_rng(1).permutation(len(tw))
    got = tw.read_batch(order)
    assert got.dtype == torch.int32 and got.shape == (len(tw), block)
    for j, i in enumerate(order.tolist()):
        assert np.array_equal(got[j].numpy(), cat[i * block : (i + 1) * block])
    assert torch.equal(tw[len(tw) - 1], got[int(np.argmax(order == len(tw) - 1))])
    assert torch.equal(tw[-1], tw[len(tw) - 1])


def test_drop_last_false_pads_the_last_window(corpus: tuple[Path, np.ndarray]) -> None:
    path, cat = corpus
    block = 37
    assert len(cat) % block  # a partial last window exists
    tw = TokenWindows(MemmapDataset(path), block_size=block, drop_last=False, pad_value=-1)
    assert len(tw) == -(-len(cat) // block)
    last = tw[len(tw) - 1].numpy()
    tail = cat[(len(tw) - 1) * block :]
    assert np.array_equal(last[: len(tail)], tail) and (last[len(tail) :] == -1).all()


def test_index_reads_no_offsets_and_a_window_is_one_read(
    corpus: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """O(shards) index: building and reading never touch an offsets file. One read per window
    inside a shard, one per shard it touches when it crosses shard boundaries."""
    path, cat = corpus

    def no_offsets(self: Any, sid: int, role: str, *_: Any) -> bytes:
        raise AssertionError(f"read the {role} file of shard {sid}")

    monkeypatch.setattr(ShardSource, "read_whole", no_offsets)
    ds = MemmapDataset(path)
    spans: list[tuple[int, int, int]] = []
    real = ds.read_span

    def spy(name: str, shard: int, start: int, out: np.ndarray) -> None:
        spans.append((shard, start, out.nbytes))
        real(name, shard, start, out)

    monkeypatch.setattr(ds, "read_span", spy)
    tw = TokenWindows(ds, block_size=16)
    sizes = [s.files["field.tokens"].bytes // 4 for s in ds.index.shards]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    crossing = 0
    for i in range(len(tw)):
        spans.clear()
        assert np.array_equal(tw[i].numpy(), cat[i * 16 : (i + 1) * 16])
        a, b = i * 16, (i + 1) * 16
        touched = [s for s in range(len(sizes)) if starts[s] < b and starts[s + 1] > a]
        assert [s for s, _, _ in spans] == touched, i
        assert sum(n for _, _, n in spans) == 16 * 4
        crossing += len(touched) > 1
    assert crossing > 3


def test_a_window_crossing_a_boundary_is_two_reads(tmp_path: Path) -> None:
    with MemmapWriter(tmp_path / "d", shape=(None,), dtype="int64", shard_bytes=80) as w:
        for k in range(12):
            w.append(np.arange(10 * k, 10 * k + 5, dtype=np.int64))  # 40 bytes: 2 docs per shard
    ds = MemmapDataset(tmp_path / "d")
    calls: list[int] = []
    real = ds.read_span
    ds.read_span = lambda n, s, st, out: (calls.append(s), real(n, s, st, out))[1]  # type: ignore[method-assign]
    tw = TokenWindows(ds, block_size=4, field="data")
    assert tw[0].tolist() == [0, 1, 2, 3] and calls == [0]
    calls.clear()
    assert tw[4].tolist() == [31, 32, 33, 34] and calls == [1]  # docs 2, 3: shard 1
    calls.clear()
    assert tw[2].tolist() == [13, 14, 20, 21] and calls == [0, 1]  # crosses shards 0 -> 1
    calls.clear()
    assert tw[7].tolist() == [53, 54, 60, 61] and calls == [2, 3]  # crosses shards 2 -> 3


class TestTokenWindowsContract(DatasetContractTests):
    """The shipped dataset contract: read_batch is default_collate of the windows, out= works."""

    def make_dataset(self, tmp_path: Path) -> Any:
        _corpus(tmp_path / "ds", docs=40, seed=4, shard_bytes=120)
        return TokenWindows(tmp_path / "ds", block_size=9)


def test_loader_shuffles_windows(corpus: tuple[Path, np.ndarray]) -> None:
    path, cat = corpus
    tw = TokenWindows(path, block_size=32)
    gen = torch.Generator().manual_seed(0)
    batches = list(DataLoader(tw, batch_size=5, shuffle=True, generator=gen, num_workers=2))
    rows = torch.cat(batches).numpy()
    want = cat[: len(tw) * 32].reshape(len(tw), 32)
    assert sorted(map(bytes, rows)) == sorted(map(bytes, want))
    assert not np.array_equal(rows, want)  # shuffled over windows


def _loader(tw: TokenWindows, world: int, rank: int) -> DataLoader:
    sampler = DistributedSampler(tw, world, rank, seed=5, batch_size=3, pad=False)
    loader = DataLoader(tw, batch_size=3, sampler=sampler, num_workers=2, worker_type="thread")
    loader.sampler.set_epoch(1)
    return loader


def test_exact_and_elastic_resume(corpus: tuple[Path, np.ndarray]) -> None:
    """Loader + DistributedSampler state (as tests/test_sampler_loader.py): the same world
    resumes batch for batch; 4 ranks stopped, 3 finish the epoch, every window exactly once."""
    path, cat = corpus
    tw = TokenWindows(path, block_size=16)
    window_of = {bytes(cat[i * 16 : (i + 1) * 16]): i for i in range(len(tw))}
    assert len(window_of) == len(tw)
    taken: list[int] = []
    states = []
    for rank in range(4):
        full = list(_loader(tw, 4, rank))
        loader = _loader(tw, 4, rank)
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        taken += [window_of[bytes(r.numpy())] for b in first for r in b]
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
        again = _loader(tw, 4, rank)
        again.load_state_dict(states[-1])
        again.sampler.set_epoch(1)
        got = first + list(again)
        assert len(got) == len(full)
        for k, (g, w) in enumerate(zip(got, full, strict=True)):
            assert_batches_equal(g, w, f"rank {rank} batch {k}")
    rest: list[int] = []
    for rank in range(3):
        loader = _loader(tw, 3, rank)
        loader.load_state_dict(states[-1])
        loader.sampler.set_epoch(1)
        rest += [window_of[bytes(r.numpy())] for b in loader for r in b]
    assert sorted(taken + rest) == list(range(len(tw)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"field": "text"}, DatasetError, r"no field 'text'.*field='data'"),
        ({"field": "label"}, DatasetError, "column 'label' is fixed"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 2.5}, ValueError, "block_size"),
        ({"pad_value": 2**40}, ValueError, "pad_value"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], error: type, match: str) -> None:
    with MemmapWriter(
        tmp_path / "d", records=False, fields={"tokens": ("int32", (None,)), "label": "int64"}
    ) as w:
        w.append(tokens=[1, 2, 3], label=1)
    with pytest.raises(error, match=match):
        TokenWindows(tmp_path / "d", **kwargs)
    with pytest.raises(IndexError):
        TokenWindows(tmp_path / "d", block_size=2).read_batch([1])


def test_public_name() -> None:
    assert feedpipe.TokenWindows is TokenWindows


def test_guide_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_columns import run_guide

    ns = run_guide("token-windows.md", tmp_path, monkeypatch)
    windows = ns["windows"]
    assert len(windows) == windows.num_tokens // 2049 and ns["batch"].shape == (8, 2049)
    got = next(iter(ns["resumed"]))
    ref = ns["loader"]
    assert got.shape == (8, 2049) and ref.state_dict()["sampler"]["consumed"] == 24


def test_remote_corpus_through_the_cache(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A typed corpus written straight to S3, read through the lazy cache with a tight limit:
    typed columns and windows read the same as locally."""
    bucket, opts = s3_bucket
    cat = _corpus(tmp_path / "local", docs=24, seed=7, shard_bytes=400)
    url = f"s3://{bucket}/corpus"
    with MemmapWriter(
        url,
        records=False,
        fields={"tokens": ("int32", (None,)), "n": "json"},
        shard_bytes=400,
        storage_options=opts,
    ) as w:
        local = MemmapDataset(tmp_path / "local")
        for i in range(len(local)):
            w.append(tokens=local[i]["tokens"], n={"i": i})
    ds = MemmapDataset(
        url, cache_dir=tmp_path / "cache", cache_limit_bytes=2000, storage_options=opts
    )
    assert ds.read_batch([5, 23])["n"] == [{"i": 5}, {"i": 23}]
    tw = TokenWindows(ds, block_size=23)
    order = np.random.default_rng(2).permutation(len(tw))
    got = tw.read_batch(order)
    for j, i in enumerate(order.tolist()):
        assert np.array_equal(got[j].numpy(), cat[i * 23 : (i + 1) * 23])
    tw.close()


# ------------------------------------------------------------------------------ TokenWindows
class TestPaddedTokenWindowsContract(DatasetContractTests):
    """The dataset contract with ``drop_last=False`` (a padded last window), empty documents
    and shards, and windows crossing shards: only ``drop_last=True`` was run through it."""

    def make_dataset(self, tmp_path: Path) -> Any:
        rng = np.random.default_rng(7)
        with MemmapWriter(
            tmp_path / "c", records=False, fields={"tokens": ("int16", (None,))}, shard_bytes=30
        ) as w:
            for k in (5, 0, 0, 13, 1, 0, 22, 3):
                w.append(tokens=rng.integers(-(2**15), 2**15, k).astype(np.int16))
        tw = TokenWindows(tmp_path / "c", block_size=7, drop_last=False, pad_value=-1)
        assert tw.num_tokens % 7 and len(tw) == -(-tw.num_tokens // 7)
        return tw


def _window_loader(tw: TokenWindows, world: int, rank: int) -> DataLoader:
    sampler = DistributedSampler(tw, world, rank, seed=3, batch_size=2, pad=False)
    loader = DataLoader(tw, batch_size=2, sampler=sampler, num_workers=2, worker_type="thread")
    loader.sampler.set_epoch(2)
    return loader


def test_padded_windows_resume_exactly_and_elastically(tmp_path: Path) -> None:
    """drop_last=False through the loader + sampler state (as tests/test_token_windows.py for
    drop_last=True): the same world resumes batch for batch; 3 ranks stopped, 2 finish the
    epoch, and every window, the padded last one included, is read exactly once."""
    rng = np.random.default_rng(1)
    with MemmapWriter(
        tmp_path / "c", records=False, fields={"tokens": ("int32", (None,))}, shard_bytes=64
    ) as w:
        for k in rng.integers(0, 12, 30):
            w.append(tokens=np.arange(k, dtype=np.int32) + 1000 * len(w.shards))
    tw = TokenWindows(tmp_path / "c", block_size=7, drop_last=False, pad_value=-7)
    assert tw.num_tokens % 7 and (tw[len(tw) - 1] == -7).any()
    window_of = {bytes(tw[i].numpy()): i for i in range(len(tw))}
    assert len(window_of) == len(tw)
    taken: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(3):
        full = list(_window_loader(tw, 3, rank))
        loader = _window_loader(tw, 3, rank)
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        taken += [window_of[bytes(r.numpy())] for b in first for r in b]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        again = _window_loader(tw, 3, rank)
        again.load_state_dict(state)
        again.sampler.set_epoch(2)
        got = first + list(again)
        assert len(got) == len(full)
        for g, want in zip(got, full, strict=True):
            assert torch.equal(g, want)
    rest: list[int] = []
    for rank in range(2):
        loader = _window_loader(tw, 2, rank)
        loader.load_state_dict(state)
        loader.sampler.set_epoch(2)
        rest += [window_of[bytes(r.numpy())] for b in loader for r in b]
    assert sorted(taken + rest) == list(range(len(tw)))
