"""Adversarial review of issue 16 points 3-5: torch-doc idioms that tried to break the loader.

Each test is an attack that broke a promise of docs/migration.md (thread workers) before its fix:
the ``get_worker_info()`` patch leaking into torch's own process workers, and the global-RNG
warnings blaming the dataset or ``worker_init_fn`` for draws made by the training loop, the
sampler, or another ``iter()``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _helpers import rng_warnings as _rng_warnings
from torch.utils.data import Dataset, IterableDataset

from feedpipe import DataLoader
from feedpipe.errors import WorkerError

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------ get_worker_info() patch leaks
class _WhoAmI(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        info = tud.get_worker_info()
        return torch.tensor([info.id, info.num_workers])


class _RunsATorchLoader(Dataset):  # type: ignore[type-arg]
    """A dataset that runs a plain torch process-worker loader in each of its items."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        inner = tud.DataLoader(
            _WhoAmI(), batch_size=None, num_workers=3, multiprocessing_context="fork"
        )
        return torch.stack(list(inner))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
def test_torch_process_workers_forked_from_a_thread_worker_see_their_own_info() -> None:
    """A process forked from a feedpipe worker thread must not inherit the thread's info."""
    loader = DataLoader(_RunsATorchLoader(), batch_size=None, num_workers=2, worker_type="thread")
    for got in loader:
        assert got.tolist() == [[0, 3], [1, 3], [2, 3]]


# ------------------------------------------------- global-RNG warnings blame the right thread
class _Items(Dataset):  # type: ignore[type-arg]
    """Leaves every global RNG alone; items 2, 3 (worker 1's first batch) are slow."""

    def __init__(self, slow_s: float = 0.0) -> None:
        self.slow_s = slow_s

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if i in {2, 3}:
            time.sleep(self.slow_s)
        return i


def test_no_rng_warning_for_draws_of_the_training_loop() -> None:
    """Dropout on CPU or a numpy mixup in the loop is not the dataset drawing in a worker."""
    loader = DataLoader(_Items(0.1), batch_size=2, num_workers=2, worker_type="thread")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            for _batch in loader:
                torch.rand(3)
                np.random.rand()
    assert _rng_warnings(record) == []


def test_no_rng_warning_for_zip_of_two_thread_loaders() -> None:
    """torch's idiom ``zip(loader_a, loader_b)``: b's ``iter()`` draws its base seed from the
    global torch RNG while a's workers read."""
    a = DataLoader(_Items(0.1), batch_size=2, num_workers=2, worker_type="thread")
    b = DataLoader(_Items(), batch_size=4, num_workers=2, worker_type="thread")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert len(list(zip(a, b, strict=False))) == 4
        it1, it2 = iter(a), iter(b)  # two iterators alive at once
        assert len(list(zip(it1, it2, strict=False))) == 4
    assert _rng_warnings(record) == []


class _NumpySampler:
    """A custom sampler drawing from numpy's global RNG lazily, one index at a time."""

    def __len__(self) -> int:
        return 16

    def __iter__(self) -> Any:
        for _ in range(16):
            yield int(np.random.randint(16))


def test_no_rng_warning_for_a_sampler_drawing_from_the_global_rng() -> None:
    def init(wid: int) -> None:  # opens a file, say: no RNG
        time.sleep(0.05)

    loader = DataLoader(_Items(0.05), batch_size=2, sampler=_NumpySampler(), num_workers=2,
                        worker_type="thread", worker_init_fn=init)  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert len(list(loader)) == 8
    assert _rng_warnings(record) == []


class _Draws(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        return i + int(np.random.rand() * 0)  # a numpy augmentation (adds 0)


def test_rng_warning_still_fires_for_a_drawing_dataset_in_zip() -> None:
    a = DataLoader(_Items(), batch_size=2, num_workers=2, worker_type="thread")
    b = DataLoader(_Draws(), batch_size=2, num_workers=2, worker_type="thread")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = [int(x) for _, batch in zip(a, b, strict=True) for x in batch]
    assert got == list(range(16))
    msgs = _rng_warnings(record)
    assert len(msgs) == 1 and "dataset drew from the global RNG of numpy.random" in msgs[0]


# --------------------------------------------- a worker that finished its stream did not die
class _Uneven(IterableDataset):  # type: ignore[type-arg]
    """Worker 0 streams 2 samples at once; worker 1 streams 12, slowly."""

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        if info is None or info.id == 0:
            yield from range(2)
            return
        for i in range(100, 112):
            time.sleep(0.02)
            yield i


def test_a_process_worker_done_with_its_stream_is_not_a_death() -> None:
    """torch ends a worker whose IterableDataset is exhausted (exit code 0) while the others go
    on: its SIGCHLD, arriving inside ``next()``, must not become a ``WorkerError``."""
    for _ in range(3):
        loader = DataLoader(_Uneven(), batch_size=2, num_workers=2)
        got = sorted(int(x) for b in loader for x in b)
        assert got == [0, 1, *range(100, 112)]


class _SlowItems(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.15)
        return i


class _ExitsAt4(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if i == 4:
            os._exit(3)
        return i


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_worker_death_of_one_loader_while_inside_another_loaders_next() -> None:
    """``zip(loader_a, loader_b)``: b's worker dies while the main thread waits in a's
    ``next()``; b's next ``next()`` reports it at once (not after torch's 5 s status poll)."""
    a = DataLoader(_SlowItems(), batch_size=2, num_workers=1)
    b = DataLoader(_ExitsAt4(), batch_size=2, num_workers=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="exit code 3"):
        for _pair in zip(a, b, strict=True):
            pass
    assert time.monotonic() - t0 < 4.0


class _SlowPlain(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.15)
        return i


@pytest.mark.serial
def test_ctrl_c_while_waiting_for_the_first_batches_is_prompt_and_blames_no_one() -> None:
    """Ctrl-C while the first ``next()`` waits for the workers' first batches: raised at once;
    the training loop's RNG draws after it are not blamed on the abandoned workers."""
    loader = DataLoader(_SlowPlain(), batch_size=2, num_workers=2, worker_type="thread")
    timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                for _batch in loader:
                    pass
            assert time.monotonic() - t0 < 0.25
            for _ in range(20):  # the loop goes on (say, saves a checkpoint): draws meanwhile
                torch.rand(3)
                time.sleep(0.02)
        finally:
            timer.cancel()
        assert sorted(int(x) for b in loader for x in b) == list(range(8))  # usable again
    assert _rng_warnings(record) == []


# ------------------------------------------------ persistent_workers keeps thread workers' state
class _EpochAware(IterableDataset):  # type: ignore[type-arg]
    """Each worker's copy counts its own passes (state a persistent worker keeps)."""

    def __init__(self) -> None:
        self.passes = 0
        self.opened = -1

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        self.passes += 1
        yield torch.tensor([info.id, self.passes, self.opened])


def _open_per_worker(wid: int) -> None:
    tud.get_worker_info().dataset.opened = wid  # torch's docs: configure this worker's copy


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_thread_workers_keep_their_dataset_and_init_once(persistent: bool) -> None:
    def run(**kw: Any) -> list[list[list[int]]]:
        kw.update(persistent_workers=persistent, worker_init_fn=_open_per_worker)
        loader = DataLoader(_EpochAware(), batch_size=None, num_workers=2, **kw)
        return [sorted(b.tolist() for b in loader) for _ in range(3)]

    want = run(multiprocessing_context="fork")  # torch's process workers
    assert run(worker_type="thread") == want


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_first_pass_wait_for_the_checked_batches_is_stall() -> None:
    """The RNG check waits for each worker's first batch inside the first ``next()`` (counted as
    stall), never inside ``iter()`` (before the first pass's clock starts)."""
    loader = DataLoader(_Items(0.15), batch_size=2, num_workers=2, worker_type="thread")
    t0 = time.perf_counter()
    it = iter(loader)
    assert time.perf_counter() - t0 < 0.1
    assert len(list(it)) == 8
    assert loader.stats.stall_s >= 0.25  # worker 1's first batch: two 0.15 s items


class _StuckAt2(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i == 2:
            time.sleep(1.5)
        return i


@pytest.mark.serial  # bounds wall time: alone, after the parallel phase
def test_thread_timeout_is_not_doubled_by_the_first_round() -> None:
    loader = DataLoader(_StuckAt2(), batch_size=2, num_workers=2, worker_type="thread", timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"timed out after 0\.3 s"):
        list(loader)
    assert time.monotonic() - t0 < 0.5


def test_explicit_default_convert_with_a_batch_size_gives_torchs_list() -> None:
    """Found by the dataset contract suite: collate_fn=default_convert with batch_size set was
    taken as the default collation, so a read_batch dataset returned a stacked batch where torch
    returns a list of converted samples."""
    import tempfile

    from torch.utils.data import DataLoader as TorchLoader
    from torch.utils.data._utils.collate import default_convert

    from feedpipe import MemmapDataset, MemmapWriter

    with tempfile.TemporaryDirectory() as tmp:
        with MemmapWriter(tmp, shape=(3,), dtype="float32") as w:
            w.append_batch(np.arange(24, dtype=np.float32).reshape(8, 3))
        ds = MemmapDataset(tmp)
        ours = list(DataLoader(ds, batch_size=4, collate_fn=default_convert))
        theirs = list(TorchLoader(ds, batch_size=4, collate_fn=default_convert))
        assert [type(b) for b in ours] == [type(b) for b in theirs] == [list, list]
        for a, b in zip(ours, theirs, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
