"""Settings assigned after construction take effect at the next ``iter()``, as in torch.

torch's ``DataLoader.__setattr__`` locks only ``dataset``, ``batch_size``, ``sampler``,
``batch_sampler``, ``drop_last`` and ``persistent_workers`` once constructed; every other argument
may be assigned and is read by the next pass. Each case below builds a loader, runs a first pass
(so that the workers and the plan exist), assigns one setting and observes the next pass: the
same observation on torch's ``DataLoader`` where torch has the attribute.
"""

from __future__ import annotations

import copy
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import feedpipe
from feedpipe.device.feed import GPUFeedWarning

Make = Callable[..., Any]

#: read by worker processes: a fork inherits what the parent set, a spawn re-imports 0
_MARK = 0


class _Range(tud.Dataset):  # type: ignore[type-arg]
    """``i + offset``; ``worker_init_fn=_add_100`` sets the offset of a worker's copy."""

    def __init__(self, n: int = 6, delay: float = 0.0) -> None:
        self.n, self.offset, self.delay = n, 0, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        return i + self.offset


class _Mark(_Range):
    def __getitem__(self, i: int) -> int:
        return _MARK


class _WorkerId(_Range):
    def __getitem__(self, i: int) -> int:
        info = tud.get_worker_info()
        return -1 if info is None else info.id


class _Seed(_Range):
    """The sample, and the worker's seed (the base seed plus its id)."""

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        info = tud.get_worker_info()
        return torch.tensor([i, -1 if info is None else info.seed])


class _FailsAt3(_Range):
    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise ValueError("bad sample 3")
        return i


class _Counting(tud.Sampler[int]):
    """A sampler that counts the indices drawn from it."""

    def __init__(self, n: int) -> None:
        self.n, self.drawn = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.drawn += 1
            yield i


def _add_100(worker_id: int) -> None:
    info = tud.get_worker_info()
    assert info is not None and isinstance(info.dataset, _Range)
    info.dataset.offset = 100


def _as_lists(loader: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in loader]


# ---- torch's assignable arguments: the same observation on torch's DataLoader ---------------


def _num_workers(make: Make) -> Any:
    loader = make(_WorkerId(), batch_size=2, num_workers=1)
    passes = [_as_lists(loader)]
    loader.num_workers = 2  # batches alternate between the two workers
    passes.append(_as_lists(loader))
    loader.num_workers = 0  # read in this process
    passes.append(_as_lists(loader))
    return passes


def _collate_fn(make: Make) -> Any:
    loader = make(_Range(4), batch_size=2)
    _as_lists(loader)
    loader.collate_fn = sum
    return _as_lists(loader)


def _worker_init_fn(make: Make) -> Any:
    loader = make(_Range(4), batch_size=2, num_workers=1)
    first = _as_lists(loader)
    loader.worker_init_fn = _add_100
    return first, _as_lists(loader)


def _pin_memory(make: Make) -> Any:
    loader = make(_Range(4), batch_size=2, num_workers=1)
    _as_lists(loader)
    loader.pin_memory = True
    with pytest.warns(UserWarning, match="pin_memory"):
        return _as_lists(loader)


def _timeout(make: Make) -> Any:
    loader = make(_Range(2, delay=3.0), batch_size=2, num_workers=1)
    loader.timeout = 0.5
    # feedpipe's message names the worker and the batch: "... timed out after 0.5 s loading ..."
    with pytest.raises(RuntimeError, match=r"timed out after 0\.5 s"):
        list(loader)
    return "timed out"


def _prefetch_factor(make: Make) -> Any:
    sampler = _Counting(40)
    loader = make(_Range(40), batch_size=1, sampler=sampler, num_workers=1)
    _as_lists(loader)
    loader.prefetch_factor = 5
    sampler.drawn = 0
    it = iter(loader)
    next(it)
    drawn = sampler.drawn  # torch puts prefetch_factor batches per worker in flight at once
    del it
    return drawn >= 5


def _multiprocessing_context(make: Make) -> Any:
    global _MARK  # the point: what a worker process inherits
    loader = make(_Mark(2), batch_size=2, num_workers=1, multiprocessing_context="fork")
    _MARK = 1
    try:
        first = _as_lists(loader)  # forked: the parent's 1
        loader.multiprocessing_context = "spawn"
        return first, _as_lists(loader)  # spawned: the module's 0
    finally:
        _MARK = 0


def _generator(make: Make) -> Any:
    # torch's RandomSampler keeps the generator it was built with (None: the global RNG);
    # the loader's generator seeds the workers' base seed: worker processes see it
    torch.manual_seed(3)
    loader = make(_Seed(), batch_size=2, shuffle=True, num_workers=1)
    first = _as_lists(loader)
    loader.generator = torch.Generator().manual_seed(7)
    return first, _as_lists(loader)


TORCH_CASES: dict[str, Callable[[Make], Any]] = {
    "num_workers": _num_workers,
    "collate_fn": _collate_fn,
    "worker_init_fn": _worker_init_fn,
    "pin_memory": _pin_memory,
    "timeout": _timeout,
    "prefetch_factor": _prefetch_factor,
    "multiprocessing_context": _multiprocessing_context,
    "generator": _generator,
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_assigned_torch_setting_takes_effect_at_the_next_pass(name: str) -> None:
    if name == "pin_memory" and torch.accelerator.is_available():
        pytest.skip("observed through torch's warning when there is nothing to pin for")
    case = TORCH_CASES[name]
    assert case(feedpipe.DataLoader) == case(tud.DataLoader)


@pytest.mark.parametrize("worker_type", ["process", "thread"])
@pytest.mark.parametrize("name", ["collate_fn", "worker_init_fn", "num_workers", "generator"])
def test_assigned_torch_setting_with_either_worker_type(name: str, worker_type: str) -> None:
    def make(*args: Any, **kwargs: Any) -> feedpipe.DataLoader:
        return feedpipe.DataLoader(*args, worker_type=worker_type, **kwargs)

    case = TORCH_CASES[name]
    assert case(make) == case(tud.DataLoader)


# ---- feedpipe's own settings ----------------------------------------------------------------


def test_assigned_on_error_takes_effect_at_the_next_pass() -> None:
    loader = feedpipe.DataLoader(_FailsAt3(), batch_size=2)
    with pytest.raises(ValueError, match="bad sample 3"):
        list(loader)
    loader.on_error = "skip"
    assert _as_lists(loader) == [[0, 1], [2], [4, 5]]
    loader.on_error = "raise"
    with pytest.raises(ValueError, match="bad sample 3"):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_assigned_worker_type_takes_effect_at_the_next_pass(num_workers: int) -> None:
    loader = feedpipe.DataLoader(_Range(4), batch_size=2, num_workers=num_workers)
    first = _as_lists(loader)
    loader.worker_type = "thread"
    assert _as_lists(loader) == first
    if num_workers:
        assert loader.stats.worker_type == "thread"
    loader.worker_type = "auto"  # resolved as the constructor resolves it
    assert loader.worker_type == "process"


def test_assigned_device_takes_effect_at_the_next_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEEDPIPE_HOST_RING", "1")  # the feed's ring, in host memory
    loader = feedpipe.DataLoader(_Range(4), batch_size=2)
    assert loader.feed_info is None
    with pytest.warns(GPUFeedWarning):
        loader.device = "cpu"
    assert loader.device == "cpu"
    assert loader.feed_info is not None
    assert _as_lists(loader) == [[0, 1], [2, 3]]
    loader.device = None
    assert loader.feed_info is None


@pytest.mark.parametrize(
    ("name", "value"),
    [("worker_type", "fiber"), ("on_error", "ignore")],
)
def test_assigned_bad_value_raises_as_the_constructor_does(name: str, value: str) -> None:
    with pytest.raises(ValueError) as built:
        options: dict[str, Any] = {name: value}
        feedpipe.DataLoader(_Range(4), **options)
    loader = feedpipe.DataLoader(_Range(4), batch_size=2)
    before = getattr(loader, name)
    with pytest.raises(ValueError) as assigned:
        setattr(loader, name, value)
    assert str(assigned.value) == str(built.value)
    assert getattr(loader, name) == before  # the loader is left as it was
    assert _as_lists(loader) == [[0, 1], [2, 3]]


def test_assigned_skip_on_an_iterable_dataset_raises_as_the_constructor_does() -> None:
    class Stream(tud.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    with pytest.raises(ValueError) as built:
        feedpipe.DataLoader(Stream(), on_error="skip")
    loader = feedpipe.DataLoader(Stream())
    with pytest.raises(ValueError) as assigned:
        loader.on_error = "skip"
    assert str(assigned.value) == str(built.value)


@pytest.mark.parametrize(
    "name", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_locked_settings_refuse_assignment_as_torch_does(name: str) -> None:
    theirs = tud.DataLoader(_Range(4), batch_size=2)
    ours = feedpipe.DataLoader(_Range(4), batch_size=2)
    with pytest.raises(ValueError) as torch_error:
        setattr(theirs, name, getattr(theirs, name))
    with pytest.raises(ValueError) as our_error:
        setattr(ours, name, getattr(ours, name))
    assert str(our_error.value) == str(torch_error.value)


# ---- copies, pickles and states ------------------------------------------------------------


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))])
def test_a_copy_keeps_the_assigned_settings(copier: Callable[[Any], Any]) -> None:
    loader = feedpipe.DataLoader(_FailsAt3(), batch_size=2, meter=feedpipe.StallMeter(False))
    loader.on_error = "skip"
    again = copier(loader)
    assert again.on_error == "skip"
    assert not again.meter.enabled
    assert _as_lists(again) == _as_lists(loader) == [[0, 1], [2], [4, 5]]


def test_a_copy_resumes_from_the_state_it_was_given() -> None:
    loader = feedpipe.DataLoader(_Range(8), batch_size=2, shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = _as_lists(it)
    again = copy.deepcopy(feedpipe.DataLoader(_Range(8), batch_size=2, shuffle=True))
    again.load_state_dict(state)
    assert _as_lists(again) == rest


@pytest.mark.parametrize("state", [None, [1, 2], "state"])
def test_load_state_dict_of_a_non_dict_names_what_a_state_is(state: Any) -> None:
    loader = feedpipe.DataLoader(_Range(4), batch_size=2)
    with pytest.raises(TypeError, match=r"must be the dict that DataLoader.state_dict\(\)"):
        loader.load_state_dict(state)
