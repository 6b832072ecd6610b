"""The one error for "the shard maps are closed" (``MapsClosedError``, in ``_gather``):
a read whose maps another thread closed falls back to the path that reopens them (a single
dataset's ``fresh`` take, the mix's one gather), and any other ``ValueError`` raised inside
those reads, or while the mix takes its members' maps, reaches the caller instead of being
taken for a close and read again another way.

The close is made to land exactly between a read taking the maps and entering them (the race
``test_attack7_mixed::test_readers_racing_close`` hits now and then), by closing the dataset
from inside that read's first ``enter``: deterministic, no thread, no timing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _mix_reference import expected_batch

from feedpipe import MemmapDataset, MemmapWriter, MixedDataset
from feedpipe.datasets._gather import MapsClosedError, ShardSpace


def _dataset(path: Path, base: int, n: int, record: int, shard_records: int = 0) -> MemmapDataset:
    """``n`` uint8 records of ``record`` bytes from ``base``; shards of ``shard_records``
    records (0: one shard)."""
    x = ((base + np.arange(n)[:, None] * 5 + np.arange(record)[None, :]) % 251).astype(np.uint8)
    kwargs: dict[str, Any] = {"shard_bytes": shard_records * record} if shard_records else {}
    with MemmapWriter(path, shape=(record,), dtype="uint8", **kwargs) as w:
        w.append_batch(x)
    return MemmapDataset(path)


def _expected(ds: MemmapDataset | MixedDataset, idx: np.ndarray) -> torch.Tensor:
    """The batch as the per-sample reads make it."""
    if isinstance(ds, MixedDataset):
        return expected_batch(ds, idx)
    return torch.stack([torch.as_tensor(np.asarray(ds[int(i)])) for i in idx])


def _space(ds: MemmapDataset) -> ShardSpace:
    space = ds.record_space()
    assert space is not None, "a local fixed-record dataset reads through one ShardSpace"
    return space


def _once(
    monkeypatch: pytest.MonkeyPatch, obj: object, name: str, before: Callable[[], None]
) -> list[int]:
    """``obj.name`` (a bound method) runs ``before`` on its first call only, then itself;
    returns the list of calls made (one entry each)."""
    real = getattr(obj, name)
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            before()
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)
    return calls


def _boom() -> None:
    raise ValueError("a value error of the read itself")


def _raised_once(
    read: Callable[[], torch.Tensor], want: torch.Tensor, calls: list[int], *ds: MemmapDataset
) -> None:
    """``read()`` raises :func:`_boom`'s ValueError itself: not read again another way (the
    injected call made once), no maps of ``ds`` left entered; the next ``read()`` is ``want``.
    Closes ``ds``."""
    with pytest.raises(ValueError, match="a value error of the read itself") as got:
        read()
    assert type(got.value) is ValueError
    assert len(calls) == 1  # not made again by a fallback read
    assert [_space(d).reading for d in ds] == [0] * len(ds)  # none left entered
    assert torch.equal(read(), want)  # the next batch reads as ever
    for d in ds:
        d.close()


def _mix(
    tmp_path: Path, shard_records: int = 0
) -> tuple[MemmapDataset, MemmapDataset, MixedDataset]:
    a = _dataset(tmp_path / "a", 0, 30, 8, shard_records)
    b = _dataset(tmp_path / "b", 90, 12, 8, shard_records)
    return a, b, MixedDataset({"a": a, "b": b}, epoch_samples=48, seed=3)


def test_maps_closed_is_a_value_error() -> None:
    """Callers that caught the bare ValueError this was before still catch it."""
    assert issubclass(MapsClosedError, ValueError)


def test_fresh_take_falls_back_on_closed_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single dataset's small batch (``FixedRecords.fresh``): its maps closed between taking
    them and entering them, the read raises MapsClosedError inside, and the batch is still read
    (the general path reopens the maps): the per-sample reads' bytes."""
    ds = _dataset(tmp_path / "d", 0, 40, 16)
    idx = np.array([3, 39, 0, 7, 7], np.int64)
    want = _expected(ds, idx)
    space = _space(ds)
    seen: list[BaseException] = []
    real_enter = space.enter

    def enter(*args: Any, **kwargs: Any) -> bool:
        ds.close()  # another thread's close, landing here
        try:
            return real_enter(*args, **kwargs)
        except BaseException as exc:
            seen.append(exc)
            raise

    monkeypatch.setattr(space, "enter", enter)
    assert torch.equal(ds.read_batch(idx), want)
    assert len(seen) == 1 and type(seen[0]) is MapsClosedError, seen
    assert _space(ds) is not space  # reopened
    ds.close()


def test_fresh_take_raises_other_value_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ValueError from inside the fresh take (its guard's check, once) reaches the caller:
    it is not read again by the general path as a closed map would be (it was, before
    MapsClosedError: the batch came back and the error was lost)."""
    ds = _dataset(tmp_path / "d", 0, 40, 16)
    idx = np.array([1, 2, 30], np.int64)
    want = _expected(ds, idx)
    calls = _once(monkeypatch, _space(ds).guard, "check", _boom)
    _raised_once(lambda: ds.read_batch(idx), want, calls, ds)


@pytest.mark.parametrize("shard_records", [0, 4], ids=["one-shard-members", "many-shard-members"])
def test_mix_one_gather_falls_back_on_closed_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_records: int
) -> None:
    """The mix's one gather (members of one shard each: every guard entered at once; of many:
    the shards touched): a member closed between the mix taking its maps and entering them,
    the batch is read member by member, reopened: the per-sample reads' bytes."""
    a, b, mix = _mix(tmp_path, shard_records)
    idx = np.random.default_rng(1).integers(0, 48, 24).astype(np.int64)
    want = _expected(mix, idx)
    assert torch.equal(mix.read_batch(idx), want)  # the table of the members' maps is made
    space = _space(b)
    calls = _once(monkeypatch, space, "enter", b.close)
    assert torch.equal(mix.read_batch(idx), want)
    assert calls, "the mix's one gather entered member b's maps"
    assert _space(b) is not space  # reopened
    a.close()
    b.close()


@pytest.mark.parametrize("shard_records", [0, 4], ids=["one-shard-members", "many-shard-members"])
def test_mix_one_gather_raises_other_value_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_records: int
) -> None:
    """A ValueError from a member's guard inside the mix's one gather reaches the caller (it
    was read again member by member before, the error lost), and leaves no member's maps
    entered (``close`` would wait for it: members of one shard each are entered all at once,
    and the first stayed entered when the second's check raised)."""
    a, b, mix = _mix(tmp_path, shard_records)
    idx = np.arange(48, dtype=np.int64)  # every member touched
    want = _expected(mix, idx)
    assert torch.equal(mix.read_batch(idx), want)
    calls = _once(monkeypatch, _space(b).guard, "check", _boom)
    _raised_once(lambda: mix.read_batch(idx), want, calls, a, b)


def test_mix_members_maps_table_raises_other_value_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ValueError while the mix takes its members' maps (``record_space``) reaches the
    caller (it was read member by member before, the error lost); a batch after it reads."""
    a, b, mix = _mix(tmp_path)
    idx = np.arange(0, 48, 3, dtype=np.int64)
    want = _expected(mix, idx)
    calls = _once(monkeypatch, b, "record_space", _boom)
    _raised_once(lambda: mix.read_batch(idx), want, calls, a, b)
