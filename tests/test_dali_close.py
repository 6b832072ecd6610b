"""``ImageLoader.close()`` ends DALI's pipeline on the calling thread, before it returns.

Found in CI: ``examples/image_classification_dali.py`` died at exit with "terminate called
without an active exception" (SIGABRT) after it had closed its loader. The caller thread that
runs ``pipe.run()`` kept the bound method of its last call, so dropping the pipeline's last
reference (and DALI's C++ shutdown of its executor threads) happened on that daemon thread,
after ``close()`` had returned, racing the interpreter's exit. These tests fail if any thread
of the loader still holds, shuts down or closes the pipeline once ``close()`` (or a timeout's
``WorkerError``) has returned. Real DALI pipelines on the CPU backend, with a source worker.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

dali = pytest.importorskip("nvidia.dali")
Image = pytest.importorskip("PIL.Image")

from test_dali import _jpeg, _loader  # noqa: E402
from test_dali_datasets import BytesDataset, HangingDataset  # noqa: E402

from feedpipe.dali import stream  # noqa: E402
from feedpipe.errors import WorkerError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _dali_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedpipe-dali")]


class Shutdowns:
    """The pipelines a loader built in this test, and the threads each shut down on."""

    def __init__(self) -> None:
        self.built: list[int] = []
        self.on: dict[int, list[str]] = {}

    def mine(self) -> list[list[str]]:
        """For each pipeline built here, the threads it shut down on (other tests' pipelines
        may be collected meanwhile: they are not counted)."""
        return [self.on.get(i, []) for i in self.built]


@pytest.fixture
def shutdowns(monkeypatch: pytest.MonkeyPatch) -> Shutdowns:
    gc.collect()
    seen = Shutdowns()
    real = dali.Pipeline._shutdown
    for name in ("build_main", "build_fed"):
        build = getattr(stream, name)

        def built(*a: Any, _build: Any = build, **kw: Any) -> Any:
            pipe = _build(*a, **kw)
            seen.built.append(id(pipe))
            return pipe

        monkeypatch.setattr(stream, name, built)

    def shutdown(self: Any) -> None:
        if self._pipe:
            seen.on.setdefault(id(self), []).append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(dali.Pipeline, "_shutdown", shutdown)
    return seen


HERE = [threading.current_thread().name]


@pytest.mark.parametrize("closing", ["close", "with", "twice"])
def test_close_shuts_the_pipeline_down_on_the_calling_thread(
    shutdowns: Shutdowns, closing: str
) -> None:
    ds = BytesDataset([_jpeg(i) for i in range(8)])
    loader = _loader(ds, batch_size=4, train=False, shuffle=False)
    if closing == "with":
        with loader:
            assert len(list(loader)) == 2
    else:
        assert len(list(loader)) == 2
        loader.close()
        if closing == "twice":
            loader.close()
    assert shutdowns.mine() == [HERE]
    assert _dali_threads() == []


def test_an_epoch_in_progress_is_closed_the_same_way(shutdowns: Shutdowns) -> None:
    ds = BytesDataset([_jpeg(i) for i in range(16)])
    loader = _loader(ds, batch_size=4, train=False, shuffle=False)
    it = iter(loader)
    next(it)  # DALI is producing the next batches: its executor and the caller are busy
    loader.close()
    assert shutdowns.mine() == [HERE]
    assert _dali_threads() == []


def test_a_timeout_returns_after_the_stuck_caller_has_ended(shutdowns: Shutdowns) -> None:
    """The caller stuck in ``pipe.run()`` holds the pipeline until the ended worker lets that
    call return: the ``WorkerError`` comes after it did, and after the pipeline shut down (on
    the caller, whose failed call held the last reference: joined before the error)."""
    ds = HangingDataset([_jpeg(i) for i in range(8)])
    loader = _loader(ds, batch_size=4, train=False, shuffle=False, timeout=3)
    with pytest.raises(WorkerError, match="within 3 s"):
        list(loader)
    assert _dali_threads() == []
    assert [len(on) for on in shutdowns.mine()] == [1]
    loader.close()
    assert [len(on) for on in shutdowns.mine()] == [1]


def test_after_a_corrupt_record_too(shutdowns: Shutdowns) -> None:
    """A batch DALI failed on (its error's frames held the pipeline) is repaired; close() ends
    every pipeline the loader built on the calling thread."""
    records = [_jpeg(i) for i in range(8)]
    records[2] = b"not a jpeg" * 50
    loader = _loader(BytesDataset(records), batch_size=4, train=False, shuffle=False,
                     on_error="skip")  # fmt: skip
    assert sum(len(y) for _, y in loader) == 8
    assert loader.skipped_indices == [2]
    loader.close()
    assert shutdowns.mine() and all(on == HERE for on in shutdowns.mine())
    assert _dali_threads() == []
