"""feedpipe.device.hostreg: the bookkeeping of host registrations, on the CPU.

The CUDA runtime is replaced by :class:`Recorder`, which answers like it (error codes, a
per-thread last error) and records, at each unregister, whether the range was still mapped
(read from ``/proc/self/maps``): registered memory must never be unmapped first. The maps, files,
fork and garbage collection are real. The same paths run on the GPU in the ``gpu`` suite
(tests/test_gpu_direct.py, tests/test_worker_slots.py), in two orders (test_gpu_hygiene.py).
"""

from __future__ import annotations

import gc
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feedpipe.datasets._memmap_open import OpenShards
from feedpipe.device import dma, hostreg

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")


def _mapped(ptr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


class Recorder:
    """A stand-in for the CUDA runtime's register/unregister/last-error calls."""

    def __init__(self, register_err: int = 0, unregister_err: int = 0) -> None:
        self.register_err, self.unregister_err = register_err, unregister_err
        self.last = 0
        self.registered: dict[int, int] = {}
        self.unregistered: list[tuple[int, bool]] = []  # (ptr, still mapped then)
        self.sync_error: Exception | None = None
        self.syncs = 0

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.register_err:
            self.last = self.register_err
            return self.register_err
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> int:
        self.unregistered.append((ptr, _mapped(ptr)))
        err = self.unregister_err or (0 if self.registered.pop(ptr, None) else 713)
        if err:
            self.last = err
        return err

    def synchronize(self) -> None:
        self.syncs += 1
        if self.sync_error is not None:
            raise self.sync_error

    def get_last_error(self) -> int:
        err, self.last = self.last, 0
        return err

    def peek_last_error(self) -> int:
        return self.last


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(hostreg, "_RUNTIME", recorder)
    return recorder


def _anon(nbytes: int = 1 << 16) -> tuple[mmap.mmap, np.ndarray]:
    mm = mmap.mmap(-1, nbytes)
    return mm, np.frombuffer(mm, np.uint8)


def test_a_failed_register_raises_naming_what_and_leaves_no_error(rt: Recorder) -> None:
    rt.register_err = 712
    _mm, view = _anon()
    with pytest.raises(hostreg.HostRegisterError, match=r"shard-7: cudaHostRegister .*rror 712"):
        hostreg.register(view.ctypes.data, view.nbytes, 0, "shard-7", view)
    assert rt.last == 0  # read back: torch's next call does not meet it
    assert not [r for r in hostreg.live() if r.runtime is rt]
    with pytest.raises(ValueError, match="0 bytes"):
        hostreg.register(view.ctypes.data, 0, 0, "empty", view)


def test_release_unregisters_once_and_only_then_lets_the_memory_be_unmapped(rt: Recorder) -> None:
    mm, view = _anon()
    ptr = view.ctypes.data
    reg = hostreg.register(ptr, view.nbytes, 0, "a buffer", view)
    del view
    assert reg in hostreg.live()
    with pytest.raises(BufferError):  # the registration holds the map
        mm.close()
    assert reg.release() and reg.release()  # idempotent
    assert rt.unregistered == [(ptr, True)] and rt.syncs == 1
    assert reg not in hostreg.live()
    mm.close()  # now it may go
    assert rt.last == 0


@pytest.mark.parametrize(("err", "kept"), [(713, False), (1, True)])
def test_a_failed_unregister_is_cleared_and_keeps_a_registered_range_mapped(
    rt: Recorder, err: int, kept: bool
) -> None:
    mm, view = _anon()
    reg = hostreg.register(view.ctypes.data, view.nbytes, 0, "a buffer", view)
    del view
    rt.unregister_err = err
    assert reg.release(sync=False) is not kept
    assert rt.last == 0 and rt.syncs == 0
    if kept:  # still registered: never unmapped (a leak of locked pages, not a stale range)
        with pytest.raises(BufferError):
            mm.close()
    else:
        mm.close()


def test_unregister_runs_even_when_the_synchronize_before_it_raises(rt: Recorder) -> None:
    _mm, view = _anon()
    reg = hostreg.register(view.ctypes.data, view.nbytes, 0, "a buffer", view)
    rt.sync_error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        reg.release()
    assert [p for p, _ in rt.unregistered] == [reg.ptr] and reg.anchor is None


def test_a_forgotten_registration_is_released_when_its_owner_is_collected(rt: Recorder) -> None:
    class Owner:
        pass

    _mm, view = _anon()
    owner = Owner()
    reg = hostreg.register(view.ctypes.data, view.nbytes, 0, "a buffer", view)
    hostreg.release_when_collected(owner, reg, sync=False)
    del owner
    gc.collect()
    assert rt.unregistered == [(reg.ptr, True)] and rt.syncs == 0


def test_a_forked_child_never_unregisters_the_parents_range(rt: Recorder) -> None:
    _mm, view = _anon()
    reg = hostreg.register(view.ctypes.data, view.nbytes, 0, "a buffer", view)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = reg.release() and not rt.unregistered and rt.syncs == 0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reg.release()
    assert rt.unregistered == [(reg.ptr, True)]


# ----------------------------------------------------------------------- the shard maps (dma)
def _shards(tmp_path: Path, nbytes: int = 3 * 4096) -> tuple[OpenShards, list[str]]:
    path = tmp_path / "shard-0.data"
    path.write_bytes(os.urandom(nbytes))
    released: list[str] = []

    def opener(sid: int) -> tuple[int, Any]:
        return os.open(path, os.O_RDONLY), lambda: released.append(f"lease {sid}")

    return OpenShards(opener, [nbytes], None), released


def test_closing_a_shard_unregisters_before_unmapping_and_finishes_if_that_raises(
    rt: Recorder, tmp_path: Path
) -> None:
    files, released = _shards(tmp_path)
    with files.use(0) as shard:
        rows = files.rows(shard, 4096)
        reg = dma.register(shard, rows, "shard-0.data")
        assert dma.register(shard, rows, "shard-0.data") is reg  # once
        fd = shard.fd
    ptr = rows.ctypes.data
    del rows
    rt.sync_error = RuntimeError("CUDA error: unspecified launch failure")
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        files.close()
    assert rt.unregistered == [(ptr, True)]  # unregistered while still mapped
    assert not _mapped(ptr)  # then unmapped
    assert released == ["lease 0"]  # the rest of the close still ran
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_closed_shard_is_never_registered_again(rt: Recorder, tmp_path: Path) -> None:
    files, _ = _shards(tmp_path)
    with files.use(0) as shard:
        rows = files.rows(shard, 4096)
    shard.close()  # another thread closes the dataset while this one holds the map
    with pytest.raises(ValueError, match=r"shard-0\.data: the shard map is closed"):
        dma.register(shard, rows, "shard-0.data")
    assert not rt.registered


def test_a_shard_dropped_without_close_is_unregistered_while_still_mapped(
    rt: Recorder, tmp_path: Path
) -> None:
    files, _ = _shards(tmp_path)
    with files.use(0) as shard:
        ptr = dma.register(shard, files.rows(shard, 4096), "shard-0.data").ptr
    del shard, files
    gc.collect()
    assert rt.unregistered == [(ptr, True)] and not _mapped(ptr)
