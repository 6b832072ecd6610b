"""A batch from the worker slots is never overwritten while anything that reads its memory lives,
on every path a batch leaves the loader by (feedpipe.loader.slot_lease): ``.numpy()``, views of
views, ``torch.from_numpy`` round trips, ``numpy.from_dlpack``, ``share_memory_()`` (which moves
a storage that is not yet shared to new memory), a ``torch.multiprocessing`` queue to another
process, pickling and ``pin_memory()``; and the slot is free again once the last of them is gone
(nothing leaks).

Each path is checked twice: on one slot in this process (the slot's flag read directly), and
through a loader with real process workers that reuse their slots."""

from __future__ import annotations

import gc
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
import torch.utils.data as tud
from _helpers import fresh_worker_slots as _fresh_worker_slots  # noqa: F401
from _procs import cmdline, descendants, wait_gone

from feedpipe import DataLoader
from feedpipe.loader import slots as slots_mod
from feedpipe.loader.slot_lease import ATTR

Batch = dict[str, torch.Tensor]


# ------------------------------------------------------------------- the exits, one per path
def _numpy(b: Batch) -> Any:
    return b["x"].numpy()


def _share(b: Batch) -> Any:
    a = b["x"].numpy()
    # moves the storage to a new segment: `a` still reads the slot
    b["x"].share_memory_()  # type: ignore[no-untyped-call]
    return a


def _share_storage(b: Batch) -> Any:
    a = b["x"].numpy()
    b["x"].untyped_storage().share_memory_()  # type: ignore[no-untyped-call]
    return a


def _share_view_of_view(b: Batch) -> Any:
    a = b["x"][1:][:, 1:].numpy()  # a view of a view, as numpy
    # another view of a view moves the whole storage
    b["x"][2:][:, :2].share_memory_()  # type: ignore[no-untyped-call]
    return a


def _round_trip(b: Batch) -> Any:
    t2 = torch.from_numpy(b["x"].numpy())  # numpy -> torch: holds the batch's tensor
    a = t2[1:].numpy()
    b["x"].share_memory_()  # type: ignore[no-untyped-call]
    return a


def _dlpack(b: Batch) -> Any:
    a = np.from_dlpack(b["x"][1:])  # holds the storage through torch's DLPack capsule only
    b["x"].share_memory_()  # type: ignore[no-untyped-call]
    return a


def _share_other_leaf(b: Batch) -> Any:
    a = b["x"].numpy()
    # another leaf of the same slot moves
    b["i"].share_memory_()  # type: ignore[no-untyped-call]
    return a


def _pickled(b: Batch) -> Any:
    a = b["x"].numpy()
    back = pickle.loads(pickle.dumps(b))  # a copy, by torch's own reducer
    assert torch.equal(back["x"], b["x"])
    return a


def _pinned(b: Batch) -> tuple[np.ndarray, torch.Tensor]:
    a = b["x"].numpy()
    p = b["x"].pin_memory()  # a copy, or the batch itself when it is page-locked already
    assert torch.equal(p, b["x"])
    return a, p


EXITS: dict[str, Callable[[Batch], Any]] = {
    "numpy": _numpy,
    "share_memory_": _share,
    "storage share_memory_": _share_storage,
    "view of a view, shared": _share_view_of_view,
    "from_numpy round trip, shared": _round_trip,
    "numpy.from_dlpack, shared": _dlpack,
    "another leaf shared": _share_other_leaf,
    "pickle": _pickled,
}


def _arrays(kept: Any) -> list[np.ndarray]:
    return [k for k in (kept if isinstance(kept, tuple) else (kept,)) if isinstance(k, np.ndarray)]


# ----------------------------------------------------------- what torch does, that we rely on
def test_share_memory_moves_a_slot_storage_and_keeps_its_python_object() -> None:
    """The two facts the lease rests on, on the pinned torch: ``share_memory_()`` moves a storage
    that is not shared (an earlier ``.numpy()`` keeps the old address), and an attribute of a
    storage's Python object lives as long as the storage, not as long as a reference to it."""
    ref = slots_mod.collate_into([torch.ones(4)] * 2, k=1, rows=2)
    assert ref is not None
    ref.received = True
    x, _ = slots_mod.Slots(pin=False).resolve(ref)
    a = x.numpy()
    assert not x.is_shared() and a.ctypes.data == x.data_ptr()
    x.share_memory_()  # type: ignore[no-untyped-call]
    assert x.is_shared() and a.ctypes.data != x.data_ptr()  # moved; `a` reads the slot
    assert getattr(x.untyped_storage(), ATTR) is getattr(x[1:].untyped_storage(), ATTR)
    del x
    gc.collect()
    assert slots_mod.worker_slots().flags[0] == 1  # `a` -> tensor -> storage -> its lease


# ------------------------------------------------------------------ one slot, in this process
@pytest.fixture
def one_slot() -> Iterator[Callable[[], Batch]]:
    """Resolves batches of one worker with a single slot, in this process."""
    slots = slots_mod.Slots(pin=False)

    def next_batch(fill: float = 1.0) -> Batch:
        samples = [{"x": torch.full((3,), fill) + j, "i": torch.tensor(j)} for j in range(4)]
        ref = slots_mod.collate_into(samples, k=1, rows=4)
        assert ref is not None, "the slot is taken"
        ref.received = True
        batch, _ = slots.resolve(ref)
        return dict(batch)

    yield next_batch


@pytest.mark.parametrize("name", list(EXITS))
def test_each_exit_holds_the_slot_while_it_reads_it_and_frees_it_after(
    name: str, one_slot: Callable[..., Batch]
) -> None:
    batch = one_slot()
    kept = EXITS[name](batch)
    snapshot = [a.copy() for a in _arrays(kept)]
    del batch
    gc.collect()
    ws = slots_mod.worker_slots()
    assert ws.flags[0] == 1, f"{name}: the slot was freed while its memory is still read"
    assert slots_mod.collate_into([{"x": torch.zeros(3), "i": torch.tensor(0)}] * 4, 1, 4) is None
    assert all(np.array_equal(a, s) for a, s in zip(_arrays(kept), snapshot, strict=True))
    del kept
    gc.collect()
    assert ws.flags[0] == 0, f"{name}: the slot leaked"
    again = one_slot(7.0)  # the slot is reused
    assert torch.equal(again["x"][0], torch.full((3,), 7.0))


# ---------------------------------------------------------------- through real process workers
class Rows(tud.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 192) -> None:
        self.data = np.random.default_rng(1).standard_normal((n, 6)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.data[i], "i": i}


@pytest.mark.parametrize("name", list(EXITS))
def test_each_exit_through_process_workers_is_never_overwritten(name: str) -> None:
    """Every batch keeps what its exit returns: its slot stays taken (later batches go torch's
    way), no kept array ever changes, and a second pass after dropping them all runs in the
    slots again (nothing leaked)."""
    ds = Rows()
    loader = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    kept = []
    for batch in loader:
        out = EXITS[name](batch)
        kept.append((out, [a.copy() for a in _arrays(out)], batch["i"].clone()))
        del batch, out
    for out, snapshot, idx in kept:
        arrays = _arrays(out)
        assert all(np.array_equal(a, s) for a, s in zip(arrays, snapshot, strict=True)), name
        assert np.array_equal(snapshot[0][-1], ds.data[int(idx[-1])][-snapshot[0].shape[1] :])
    first = dict(loader.worker_slots or {})
    assert first["batches_in_slots"] > 0 and first["batches_fallback"] > 0, first
    del kept
    gc.collect()
    second = [b["x"].clone() for b in loader]
    assert torch.equal(torch.cat(second), torch.from_numpy(ds.data))
    now = loader.worker_slots or {}
    assert now["batches_in_slots"] - first["batches_in_slots"] >= len(second) - 2, now


def _consumer(inbox: Any, outbox: Any) -> None:
    """Another process: keeps every batch it receives, acknowledges each, and at the end sends
    back the bytes of all of them, read only then."""
    held = []
    while (item := inbox.get(timeout=60)) is not None:
        held.append(item)
        outbox.put(len(held))
    outbox.put([t.numpy().copy() for t in held])


@pytest.mark.parametrize("keep", [True, False], ids=["numpy kept here", "nothing kept here"])
def test_batches_put_on_a_torch_queue_are_never_overwritten_on_either_side(keep: bool) -> None:
    """A ``torch.multiprocessing`` queue moves each batch to a segment of its own: the consumer
    never maps the slot, so its batches keep their bytes while the workers reuse their slots
    (nothing kept here: every slot is reused), and this process's ``.numpy()`` arrays taken
    before the put keep theirs (kept here: the slots stay taken, later batches go torch's way)."""
    ctx = tmp.get_context("fork")  # as the loader starts its workers
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(inbox, outbox), daemon=True)
    proc.start()
    try:
        ds = Rows(256)
        loader = DataLoader(ds, batch_size=8, num_workers=2)
        kept = []
        for n, batch in enumerate(loader, 1):
            if keep:
                kept.append(batch["x"].numpy())
            inbox.put(batch["x"])  # the feeder thread pickles it: share_memory_ of its storage
            del batch
            assert outbox.get(timeout=60) == n
        inbox.put(None)
        theirs = outbox.get(timeout=60)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    want = ds.data.reshape(-1, 8, 6)
    assert len(theirs) == len(want) and all(map(np.array_equal, theirs, want))
    assert all(map(np.array_equal, kept, want[: len(kept)])) and len(kept) == keep * len(want)
    info = loader.worker_slots or {}
    if keep:
        assert info["batches_in_slots"] > 0 and info["batches_fallback"] > 0, info
    else:
        assert info["batches_in_slots"] >= len(want) - 2, info
    assert proc.exitcode == 0


def _share_every_batch_file_system(outbox: Any) -> None:
    """In a child process: torch's other sharing strategy (``_share_filename_cpu_``, which starts
    torch's shm manager for the rest of the process) moves storages the same way."""
    tmp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    ds = Rows(128)
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    kept = []
    for batch in loader:
        a = batch["x"].numpy()
        batch["x"].share_memory_()  # type: ignore[no-untyped-call]
        kept.append(a)
        del batch
    outbox.put((np.array_equal(np.concatenate(kept), ds.data), loader.worker_slots))


def test_share_memory_with_the_file_system_strategy() -> None:
    ctx = tmp.get_context("fork")  # the loader's own start method: no new interpreter
    outbox = ctx.Queue()
    proc = ctx.Process(target=_share_every_batch_file_system, args=(outbox,))
    proc.start()
    try:
        same, info = outbox.get(timeout=120)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    assert same and info["batches_in_slots"] > 0, info
    assert proc.exitcode == 0
    # torch's shm managers (the child's, its workers') end a moment after their last client
    managers = [p for p in descendants() if "torch_shm_manager" in cmdline(p)]
    assert wait_gone(managers, 60) == [], [cmdline(p) for p in managers]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pin_memory", [False, True])
def test_pin_memory_of_a_slot_batch_is_never_overwritten(pin_memory: bool) -> None:
    """``pin_memory()`` copies a batch to page-locked memory (or returns it, when it already is):
    the ``.numpy()`` arrays taken before keep their bytes, with torch's pinning on or off."""
    ds = Rows()
    loader = DataLoader(ds, batch_size=8, num_workers=2, pin_memory=pin_memory)
    kept = []
    for batch in loader:
        a, p = _pinned(batch)
        kept.append((a, a.copy(), p, p.clone()))
        del batch, a, p
    for a, a0, p, p0 in kept:
        assert np.array_equal(a, a0) and torch.equal(p, p0)


def test_a_forked_child_dropping_its_copy_of_a_batch_leaves_the_slot_taken(
    one_slot: Callable[..., Batch],
) -> None:
    """A child forked while a batch is held (a helper that forks and exits by unwinding, a pool
    made mid-epoch) has a copy of the batch and of its lease; the slot flags are shared memory.
    The child dropping its copy must not free the slot the parent's batch still reads."""
    batch = one_slot()
    ws = slots_mod.worker_slots()
    assert ws.flags[0] == 1
    pid = os.fork()
    if pid == 0:  # the child: drop its copy of the batch, then leave without cleanup
        code = 0
        try:
            del batch
            gc.collect()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ws.flags[0] == 1, "the child's copy of the lease freed the parent's slot"
    assert slots_mod.collate_into([{"x": torch.zeros(3), "i": torch.tensor(0)}] * 4, 1, 4) is None
    assert torch.equal(batch["x"][0], torch.full((3,), 1.0))
    del batch
    gc.collect()
    assert ws.flags[0] == 0  # the parent's own drop frees it


def test_a_forked_child_dropping_a_received_unresolved_ref_leaves_the_slot_taken() -> None:
    """A ref received but not resolved yet (the iterator holds those that came out of order)
    frees its slot when dropped, in the process that received it: not in a child forked
    meanwhile, whose copy going away would let the worker overwrite the batch before the
    parent resolves it."""
    slots = slots_mod.Slots(pin=False)
    samples = [torch.full((3,), 1.0)] * 2
    first = slots_mod.collate_into(samples, k=2, rows=2)
    assert first is not None
    first.received = True
    held, _ = slots.resolve(first)  # the buffer is known to this process from here on
    sent = slots_mod.collate_into([torch.full((3,), 2.0)] * 2, k=2, rows=2)
    assert sent is not None
    ref = pickle.loads(pickle.dumps(sent))  # as the queue delivers it: received
    ws = slots_mod.worker_slots()
    assert ws.flags[sent.slot] == 1
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            del ref
            gc.collect()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ws.flags[sent.slot] == 1, "the child's copy of the ref freed the parent's slot"
    del ref
    gc.collect()
    assert ws.flags[sent.slot] == 0  # dropped unresolved here: freed
    del held
