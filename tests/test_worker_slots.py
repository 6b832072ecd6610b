"""Process workers collate into reused shared-memory slots (feedpipe.loader.slots).

What is promised: the same batches as torch's ``default_collate`` bit for bit (dtypes,
structure); a slot is never written while any view of a delivered batch lives; a pass that
ends early frees its slots; anything the slots cannot hold goes torch's way."""

from __future__ import annotations

import collections
import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _helpers import fresh_worker_slots as _fresh_worker_slots  # noqa: F401
from torch.utils.data import default_collate

from feedpipe import DataLoader
from feedpipe.loader import slots as slots_mod

Point = collections.namedtuple("Point", ["x", "y"])


def _equal(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    else:
        assert a == b


def _mm(tmp: Path) -> np.memmap:
    path = tmp / "rows.bin"
    np.arange(8 * 6, dtype=np.float32).tofile(path)
    return np.memmap(path, dtype=np.float32, mode="r", shape=(8, 6))


CASES: dict[str, Any] = {
    "tensor": lambda i, mm: torch.full((3, 2), i, dtype=torch.float32),
    "bf16": lambda i, mm: torch.full((4,), i, dtype=torch.bfloat16),
    "scalar tensor": lambda i, mm: torch.tensor(i),
    "python numbers": lambda i, mm: {"i": i, "f": i / 3, "b": i % 2 == 0},
    "numpy": lambda i, mm: (np.full(5, i, np.int16), np.float32(i), np.bool_(i % 2)),
    "memmap row": lambda i, mm: mm[i],
    "namedtuple": lambda i, mm: Point(torch.ones(2) * i, [i, np.uint8(i)]),
    "nested": lambda i, mm: {"a": [torch.zeros(2, dtype=torch.int8) + i, {"b": i}], "c": (i,)},
    "empty rows": lambda i, mm: torch.zeros(0, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_collate_into_equals_default_collate(case: str, tmp_path: Path) -> None:
    mm = _mm(tmp_path)
    samples = [CASES[case](i, mm) for i in range(5)]
    ref = slots_mod.collate_into(samples, k=3, rows=5)
    assert ref is not None
    ref.received = True  # as if it had come through the queue
    batch, pinned = slots_mod.Slots(pin=False).resolve(ref)
    assert not pinned
    _equal(batch, default_collate(samples))


@pytest.mark.parametrize(
    "samples",
    [
        ["a", "b"],
        [torch.zeros(2), torch.zeros(3)],
        [{"a": 1}, {"b": 1}],
        [torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)],
        [np.array(["x"]), np.array(["y"])],
        [2**70, 1],
    ],
    ids=["str", "shapes", "keys", "dtypes", "str array", "int overflow"],
)
def test_what_the_slots_cannot_hold_goes_torchs_way(samples: list[Any]) -> None:
    assert slots_mod.collate_into(samples, k=2, rows=2) is None
    ws = slots_mod.worker_slots()
    assert ws is None or not ws.flags.any()  # no slot left taken


def test_a_slot_is_held_while_any_view_lives_and_freed_after() -> None:
    first = [torch.full((4,), 1.0) for _ in range(2)]
    ref = slots_mod.collate_into(first, k=1, rows=2)
    assert ref is not None
    ref.received = True
    slots = slots_mod.Slots(pin=False)
    batch, _ = slots.resolve(ref)
    row = batch[1]  # a view of the slot, kept past the batch
    del batch, ref
    gc.collect()
    ws = slots_mod.worker_slots()
    assert ws.flags[0] == 1  # still held by `row`
    assert slots_mod.collate_into([torch.zeros(4)] * 2, k=1, rows=2) is None  # no free slot
    assert torch.equal(row, torch.full((4,), 1.0))
    del row
    gc.collect()
    assert ws.flags[0] == 0
    again = slots_mod.collate_into([torch.full((4,), 2.0)] * 2, k=1, rows=2)
    assert again is not None and again.slot == 0


def test_a_ref_dropped_unresolved_frees_its_slot() -> None:
    ref = slots_mod.collate_into([torch.ones(3)] * 2, k=1, rows=2)
    assert ref is not None
    ws = slots_mod.worker_slots()
    assert ws.flags[0] == 1
    ref.received = True  # the main process's copy, dropped (a pass ended early)
    del ref
    gc.collect()
    assert ws.flags[0] == 0


# ------------------------------------------------------------------- through real workers
class Rows(tud.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 96) -> None:
        self.data = np.random.default_rng(0).integers(0, 1000, (n, 64), dtype=np.int32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.from_numpy(self.data[i].copy()), "i": i, "w": np.float32(i) / 7}


def test_loader_batches_equal_torchs_and_come_from_slots() -> None:
    ds = Rows()
    kw: dict[str, Any] = {"batch_size": 8, "num_workers": 2, "shuffle": True}
    want = list(tud.DataLoader(ds, generator=torch.Generator().manual_seed(3), **kw))
    loader = DataLoader(ds, generator=torch.Generator().manual_seed(3), **kw)
    got = []
    for batch in loader:
        got.append({k: v.clone() for k, v in batch.items()})  # the loop keeps copies only
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        _equal(a, b)
    info = loader.worker_slots
    assert info is not None and info["batches_in_slots"] >= len(want) - 2


def test_holding_every_batch_never_sees_a_reused_slot() -> None:
    ds = Rows()
    kw: dict[str, Any] = {"batch_size": 8, "num_workers": 2}
    want = list(tud.DataLoader(ds, **kw))
    loader = DataLoader(ds, **kw)
    kept = list(loader)  # every batch held: slots run out, later batches go torch's way
    for a, b in zip(want, kept, strict=True):
        _equal(a, b)
    info = loader.worker_slots
    assert info["batches_in_slots"] > 0 and info["batches_fallback"] > 0


def test_persistent_workers_after_a_break_use_their_slots_again() -> None:
    ds = Rows()
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    gc.collect()
    before = loader.worker_slots["batches_in_slots"]
    second = [b["x"].clone() for b in loader]
    assert len(second) == len(ds) // 4
    assert loader.worker_slots["batches_in_slots"] - before >= len(second) - 2
    assert torch.equal(torch.cat(second), torch.from_numpy(ds.data))


def test_off_switch_custom_collate_and_threads_keep_torchs_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ds = Rows(16)
    assert DataLoader(ds, batch_size=4, num_workers=1, collate_fn=lambda b: b).worker_slots is None
    assert DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread").worker_slots is None
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", "0")
    loader = DataLoader(ds, batch_size=4, num_workers=1)
    assert len(list(loader)) == 4 and loader.worker_slots is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_feed_copies_straight_from_page_locked_slots() -> None:
    ds = Rows(256)
    kw: dict[str, Any] = {"batch_size": 16, "num_workers": 2}
    want = [{k: v.cuda() for k, v in b.items()} for b in tud.DataLoader(ds, **kw)]
    loader = DataLoader(ds, device="cuda", **kw)
    for _epoch in range(2):
        got = [{k: v.clone() for k, v in b.items()} for b in loader]
        for a, b in zip(want, got, strict=True):
            _equal(a, b)
    info = loader.worker_slots
    assert info["pinned"] is True and info["batches_in_slots"] >= 2 * len(want) - 4
    assert loader.feed_info["slot_bytes"] == 0  # the feed's own ring was never needed


def test_auto_worker_type_picks_threads_for_read_batch_and_processes_otherwise() -> None:
    from feedpipe.loader.dataloader import auto_worker_type

    class Batched(Rows):
        def read_batch(self, indices: Any, out: Any = None) -> Any:
            return default_collate([self[i] for i in indices])

    assert auto_worker_type(Rows(4), None, None) == "process"
    assert auto_worker_type(Batched(4), None, None) == "thread"
    assert auto_worker_type(Batched(4), lambda b: b, None) == "process"
    assert auto_worker_type(Batched(4), None, lambda w: None) == "process"
    loader = DataLoader(Batched(16), batch_size=4, num_workers=2, worker_type="auto")
    assert loader.worker_type == "thread" and len(list(loader)) == 4
    assert DataLoader(Rows(16), batch_size=4, num_workers=1, worker_type="auto").worker_type == (
        "process"
    )
    with pytest.raises(ValueError, match="auto"):
        DataLoader(Rows(4), worker_type="fibers")


class Unsized(tud.Sampler):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(3))


def test_slots_are_sized_for_the_rows_a_batch_can_have() -> None:
    assert slots_mod.slot_rows(512, range(40)) == 40
    assert slots_mod.slot_rows(8, range(40)) == 8
    assert slots_mod.slot_rows(None, range(40)) is None  # a batch_sampler: the first batch
    assert slots_mod.slot_rows(16, Unsized()) == 16


def test_batch_size_beyond_the_dataset_with_process_workers() -> None:
    """Found: ``batch_size=2**40`` over 10 samples laid out slots for 2**40 rows (64 TB)."""
    ds = Rows(10)
    want = list(tud.DataLoader(ds, batch_size=2**40))
    loader = DataLoader(ds, batch_size=2**40, num_workers=1)
    got = list(loader)
    assert len(got) == len(want) == 1
    _equal(got[0], want[0])
    assert loader.worker_slots["batches_in_slots"] == 1


# ------------------------------------------------------------- little shared memory (issue 25)
_SMALL_SHM = """
import sys, torch, torch.utils.data as tud
import feedpipe

class Rows(tud.Dataset):
    def __init__(self, n, width): self.n, self.width = n, width
    def __len__(self): return self.n
    def __getitem__(self, i): return {"x": torch.full((self.width,), float(i)), "i": i}

def copies(loader):  # nothing kept in shared memory: torch's own batches fit
    return [{k: v.clone() for k, v in b.items()} for b in loader]

GROW = [[0]] + [list(range(i, i + 4)) for i in range(1, 61, 4)]  # 1 row, then 1 MiB batches
CASES = {  # name: dataset, loader arguments, what the slots do
    "batch_size over the dataset": (Rows(40, 1024), {"batch_size": 512}, "slots"),
    "no room for the slots": (Rows(64, 65536), {"batch_size": 4}, "torch"),
    "no room to grow": (Rows(64, 65536), {"batch_sampler": GROW}, "grown"),
    "batch_size 2**40": (Rows(10, 16), {"batch_size": 2**40}, "slots"),
}
if __name__ == "__main__":  # spawned workers import this file: no pytest for them
    from feedpipe.testing import assert_batches_equal

    for arg in sys.argv[1:]:
        ctx, name = arg.split(":")
        ds, kw, how = CASES[name]
        want = copies(tud.DataLoader(ds, **kw))
        workers = 2 if ctx == "fork" else 1  # a spawned worker costs an interpreter with torch
        loader = feedpipe.DataLoader(ds, num_workers=workers, multiprocessing_context=ctx, **kw)
        got = copies(loader)
        assert len(got) == len(want), (arg, len(got), len(want))
        for n, (a, b) in enumerate(zip(got, want)):
            assert_batches_equal(a, b, f"{arg} batch {n}")
        info = loader.worker_slots
        used, fell = info["batches_in_slots"], info["batches_fallback"]
        assert {"slots": used > 0, "torch": used == 0, "grown": fell >= len(want) - 2}[how], (
            arg, info)
        print(arg, "ok", info, flush=True)
"""
_MOUNT = "mount -t tmpfs -o size=8m feedpipe-test /dev/shm"


def test_little_shared_memory_goes_torchs_way_for_every_start_method(tmp_path: Path) -> None:
    """Found: with 8 MiB of /dev/shm, where torch's loader finishes, the slots failed with
    ENOSPC (sized for ``batch_size`` rows, 512 over 40 samples; 64 TB for ``2**40``), and a
    worker whose buffer could not be made did not fall back. Runs in a private mount namespace
    whose /dev/shm is a real 8 MiB tmpfs (``unshare -m``, as root)."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    if (
        unshare is None
        or subprocess.run([unshare, "-m", "sh", "-c", _MOUNT], check=False).returncode
    ):
        pytest.skip("needs unshare -m and mount (root) for a private 8 MiB /dev/shm")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM)
    runs = [f"fork:{name}" for name in ("batch_size over the dataset", "no room to grow")]
    runs += [f"{ctx}:no room for the slots" for ctx in ("fork", "spawn", "forkserver")]
    runs += ["fork:batch_size 2**40"]
    command = f'{_MOUNT} && exec "$0" "$@"'
    proc = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        [unshare, "-m", "sh", "-c", command, sys.executable, str(script), *runs],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok ") == len(runs), proc.stdout
