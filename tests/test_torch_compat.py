"""Each touch of torch's private API (feedpipe.loader._torch_compat, rule 4 of
tests/test_layers.py) checked against the pinned torch: when torch renames or changes one, a
test here fails with the member's name instead of the loader misbehaving somewhere else."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.utils.data as tud

from feedpipe.loader import _torch_compat as compat


class _Iterable(tud.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(5))

    def __len__(self) -> int:
        return 5


def test_index_sampler_is_the_batch_sampler_or_the_sampler() -> None:
    batched = tud.DataLoader(list(range(10)), batch_size=3)
    assert compat.index_sampler(batched) is batched.batch_sampler
    unbatched = tud.DataLoader(list(range(10)), batch_size=None)
    assert compat.index_sampler(unbatched) is unbatched.sampler


def test_auto_collation_follows_batch_size() -> None:
    assert compat.auto_collation(tud.DataLoader(list(range(4)), batch_size=2)) is True
    assert compat.auto_collation(tud.DataLoader(list(range(4)), batch_size=None)) is False


def test_len_called_records_len_and_can_be_handed_on() -> None:
    outer = tud.DataLoader(_Iterable(), batch_size=2)
    assert compat.len_called(outer) is None
    assert len(outer) == 3
    assert compat.len_called(outer) == 5  # torch stores the dataset's len() it compared against
    inner = tud.DataLoader(_Iterable(), batch_size=2)
    compat.set_len_called(inner, compat.len_called(outer))
    assert compat.len_called(inner) == 5


def test_exception_wrapper_reraises_with_the_original_type_and_context() -> None:
    try:
        raise KeyError("record 7")
    except KeyError as exc:
        wrapped = compat.ExceptionWrapper((type(exc), exc, exc.__traceback__), "in worker 3")
    with pytest.raises(KeyError, match="in worker 3"):
        wrapped.reraise()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs an accelerator")
def test_pin_memory_pins_nested_batches() -> None:
    out = compat.pin_memory({"x": torch.zeros(3), "y": [torch.ones(2)]})
    assert out["x"].is_pinned() and out["y"][0].is_pinned()


def test_pin_memory_is_torchs_recursive_pin() -> None:
    from torch.utils.data._utils import pin_memory as torch_pin

    assert compat.pin_memory is torch_pin.pin_memory


def test_worker_info_shim_gives_threads_their_own_info() -> None:
    assert compat.install_worker_info_shim() in (True, False)  # idempotent either way
    info = compat.make_worker_info(1, 2, 123, dataset="ds")
    seen: list[Any] = []

    def body() -> None:
        compat.set_thread_worker_info(info)
        seen.append(tud.get_worker_info())
        compat.set_thread_worker_info(None)
        seen.append(tud.get_worker_info())

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen[0] is info and seen[0].id == 1 and seen[0].num_workers == 2
    assert seen[1] is None
    assert tud.get_worker_info() is None  # the main thread never saw the worker's info


def test_workers_running_sees_torchs_persistent_iterator() -> None:
    loader = tud.DataLoader(list(range(8)), batch_size=4, num_workers=1, persistent_workers=True)
    assert compat.workers_running(loader) is False
    assert len(list(loader)) == 2
    assert compat.workers_running(loader) is True  # the next iter() reuses the workers
    compat.shutdown_iterator(loader)
    plain = tud.DataLoader(list(range(8)), batch_size=4, num_workers=1)
    list(plain)
    assert compat.workers_running(plain) is False
