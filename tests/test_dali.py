"""feedpipe.dali.ImageLoader on DALI's CPU backend (the GPU path is marked ``gpu``).

Real JPEGs (PIL), real corrupt records (truncated, garbage, zero-length, corrupt entropy data),
real DALI pipelines with their parallel worker processes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
Image = pytest.importorskip("PIL.Image")

from _procs import alive, descendants, key_lines, run_python, wait_gone  # noqa: E402
from test_dali_datasets import BytesDataset, ExplodingDataset, HangingDataset  # noqa: E402

from feedpipe.dali import ImageLoader  # noqa: E402
from feedpipe.errors import DatasetError, WorkerError  # noqa: E402
from feedpipe.sampler import DistributedSampler  # noqa: E402
from feedpipe.stall import StallMeter  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CROP, RESIZE = 32, 40
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _jpeg(seed: int, w: int = 60, h: int = 48) -> bytes:
    """A smooth colour gradient (so resampling filters agree) with a per-image offset."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // w, y * 255 // h, (x + y + 17 * seed) % 256], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _corrupt(kind: str, good: bytes) -> bytes:
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "garbage":
        return bytes(np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8))
    if kind == "empty":
        return b""
    if kind == "corrupt_data":  # valid header and end marker, broken entropy-coded data
        bad = bytearray(good)
        bad[400 : len(bad) - 200] = b"\xff\x07" * ((len(bad) - 600) // 2)
        return bytes(bad)
    raise ValueError(kind)


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [_jpeg(i) for i in range(22)]


def _loader(ds: BytesDataset, **kw: object) -> ImageLoader:
    opts: dict[str, object] = dict(
        device="cpu", crop=CROP, resize=RESIZE, num_threads=2, py_num_workers=1, timeout=60
    )
    opts.update(kw)
    return ImageLoader(ds, **opts)  # type: ignore[arg-type]


def _reference_eval(record: bytes) -> torch.Tensor:
    """PIL: resize the shorter side to RESIZE, center-crop CROP, normalize, CHW."""
    img = Image.open(io.BytesIO(record)).convert("RGB")
    w, h = img.size
    s = RESIZE / min(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.BILINEAR)
    w, h = img.size
    left, top = round((w - CROP) / 2), round((h - CROP) / 2)
    a = np.asarray(img.crop((left, top, left + CROP, top + CROP)), dtype=np.float32)
    a = (a - np.array(MEAN) * 255) / (np.array(STD) * 255)
    return torch.from_numpy(a.transpose(2, 0, 1).astype(np.float32))


def test_eval_values_shapes_and_determinism(images: list[bytes]) -> None:
    ds = BytesDataset(images)
    meter = StallMeter()
    with _loader(ds, batch_size=5, train=False, shuffle=False, meter=meter) as loader:
        assert len(loader) == 5  # 22 images, last batch of 2
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert [len(y) for _, y in batches] == [5, 5, 5, 5, 2]
            epochs.append(batches)
        assert meter.samples == 44 and meter.batches == 10
        assert meter.stage_bytes["fetch"] == 2 * sum(len(r) for r in images)
    x = torch.cat([b[0] for b in epochs[0]])
    y = torch.cat([b[1] for b in epochs[0]])
    assert x.shape == (22, 3, CROP, CROP) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == list(range(22))
    for (x0, y0), (x1, y1) in zip(epochs[0], epochs[1], strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)  # eval is deterministic
    ref = torch.stack([_reference_eval(r) for r in images])
    err = (x - ref).abs()
    assert err.mean() < 0.05, err.mean()  # normalized units; interpolation differs slightly
    assert err.max() < 1.0
    # not a constant image: the per-image blue offset shows up
    assert (x[0, 2] - x[1, 2]).abs().mean() > 0.1


def test_train_layout_dtype_and_drop_last(images: list[bytes]) -> None:
    ds = BytesDataset(images)
    with _loader(
        ds,
        batch_size=4,
        train=True,
        shuffle=True,
        seed=3,
        drop_last=True,
        output_layout="NHWC",
        dtype="float16",
    ) as loader:
        assert len(loader) == 5
        loader.set_epoch(0)
        first = list(loader)
        loader.set_epoch(1)
        second = list(loader)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3, pad=False)
    for epoch, batches in enumerate((first, second)):
        sampler.set_epoch(epoch)
        assert len(batches) == 5
        for x, _ in batches:
            assert x.shape == (4, CROP, CROP, 3) and x.dtype == torch.float16
            assert torch.isfinite(x).all()
        labels = torch.cat([y for _, y in batches]).tolist()
        assert labels == list(sampler)[:20]  # the sampler's order; the last 2 dropped
    assert labels != torch.cat([y for _, y in first]).tolist()  # reshuffled per epoch


def test_uint8_is_unnormalized(images: list[bytes]) -> None:
    with _loader(BytesDataset(images[:4]), batch_size=4, train=False, dtype="uint8") as loader:
        ((x, _y),) = list(loader)
    assert x.dtype == torch.uint8 and x.shape == (4, 3, CROP, CROP)
    ref = torch.stack([_reference_eval(r) for r in images[:4]])
    ref_u8 = ref * torch.tensor(STD).view(3, 1, 1) * 255 + torch.tensor(MEAN).view(3, 1, 1) * 255
    assert (x.float() - ref_u8[torch.argsort(_y)]).abs().mean() < 12


def test_two_ranks_disjoint_and_complete(images: list[bytes]) -> None:
    ds = BytesDataset(images)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, seed=5, pad=False)
        sampler.set_epoch(1)
        with _loader(ds, batch_size=4, sampler=sampler, train=False) as loader:
            seen.append(torch.cat([y for _, y in loader]).tolist())
    assert len(seen[0]) == len(seen[1]) == 11
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(22))


def test_resume_mid_epoch(images: list[bytes]) -> None:
    ds = BytesDataset(images)
    kw = dict(batch_size=4, train=True, shuffle=True, seed=11)
    with _loader(ds, **kw) as loader:
        loader.set_epoch(2)
        it = iter(loader)
        head = [next(it)[1] for _ in range(2)]
        state = json.loads(json.dumps(loader.state_dict()))  # plain and JSON-able
        # abandon mid-epoch, then iterate again: a fresh epoch 2 from the start
        assert torch.cat([y for _, y in loader]).tolist()[:8] == torch.cat(head).tolist()
    assert state["sampler"]["consumed"] == 8
    with _loader(ds, **kw) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == 4  # 14 samples left
        tail = torch.cat([y for _, y in resumed]).tolist()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=11, pad=False)
    sampler.set_epoch(2)
    order = list(sampler)
    assert torch.cat(head).tolist() == order[:8]
    assert tail == order[8:]


class _ListSampler:
    """A sampler without ``set_epoch``: its next order cannot be predicted."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def test_one_pipeline_across_epochs_in_sampler_order(images: list[bytes]) -> None:
    """Epochs stream through one DALI pipeline: predicted, mispredicted, abandoned, resumed."""
    ds = BytesDataset(images)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=9, pad=False)
    twin = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=9, pad=False)
    with _loader(ds, batch_size=4, sampler=sampler, train=False) as loader:
        pipe = None
        for epoch in (0, 1, 2, 7, 8):  # 2 -> 7: the predicted order (epoch 3) is overridden
            loader.set_epoch(epoch)
            twin.set_epoch(epoch)
            if epoch == 8:  # abandon epoch 8 after one batch, then iterate it whole
                assert next(iter(loader))[1].tolist() == list(twin)[:4]
            got = torch.cat([y for _, y in loader]).tolist()
            assert got == list(twin), epoch
            pipe = pipe or loader._pipe
            assert loader._pipe is pipe  # never rebuilt
        assert not loader._speculate  # switched off by the wrong guess
        state = loader.state_dict()
    assert state["sampler"]["epoch"] == 8 and state["sampler"]["consumed"] == 22


def test_unpredictable_sampler_order_is_kept(images: list[bytes]) -> None:
    ds = BytesDataset(images)
    sampler = _ListSampler(list(range(22)))
    with _loader(ds, batch_size=5, sampler=sampler, train=False, drop_last=True) as loader:
        pipe = None
        for epoch in range(3):
            sampler.order = np.random.default_rng(epoch).permutation(22).tolist()
            got = torch.cat([y for _, y in loader]).tolist()
            assert got == sampler.order[:20]
            pipe = pipe or loader._pipe
            assert loader._pipe is pipe


def _with_corrupt(images: list[bytes], bad: dict[int, str]) -> BytesDataset:
    records = list(images)
    for i, kind in bad.items():
        records[i] = _corrupt(kind, images[i])
    return BytesDataset(records)


BAD = {3: "truncated", 4: "garbage", 9: "empty", 14: "corrupt_data", 15: "corrupt_data"}


def test_skip_replaces_with_next_valid_record_and_resumes(images: list[bytes]) -> None:
    ds = _with_corrupt(images, BAD)
    # 3 and 4 -> 5; 9 -> 10; 14 and 15 -> 16 (the next valid record in dataset order)
    expected = [0, 1, 2, 5, 5, 5, 6, 7, 8, 10, 10, 11, 12, 13, 16, 16, 16, *range(17, 22)]
    with _loader(ds, batch_size=4, train=False, shuffle=False, on_error="skip") as loader:
        it = iter(loader)
        head = [next(it) for _ in range(2)]
        state = json.loads(json.dumps(loader.state_dict()))
        rest = list(it)
        labels = torch.cat([y for _, y in head + rest]).tolist()
        assert labels == expected
        assert loader.skipped == 5 and loader.skipped_indices == sorted(BAD)
        x = torch.cat([b[0] for b in head + rest])
        assert x.shape == (22, 3, CROP, CROP) and torch.isfinite(x).all()
        # a replaced sample is the replacement record, decoded: identical to the real one
        assert torch.equal(x[3], x[5]) and torch.equal(x[14], x[16])
    assert state["skipped"] == [3, 4]  # found so far
    # a resumed run replaces the same records (it knows 3 and 4, finds 9, 14, 15 again)
    with _loader(ds, batch_size=4, train=False, shuffle=False, on_error="skip") as resumed:
        resumed.load_state_dict(state)
        tail = torch.cat([y for _, y in resumed]).tolist()
        assert resumed.skipped_indices == sorted(BAD)
    assert tail == expected[8:]


def test_skip_state_prevents_decode_failures(images: list[bytes]) -> None:
    """Records only DALI finds bad, once in the state, are replaced before decode next time."""
    ds = _with_corrupt(images, {14: "corrupt_data"})
    with _loader(ds, batch_size=8, train=False, shuffle=False, on_error="skip") as loader:
        first = torch.cat([y for _, y in loader]).tolist()
        state = loader.state_dict()
        repair_s = loader.meter.stage_s["repair"]
        assert repair_s > 0
        loader.load_state_dict({**state, "sampler": {**state["sampler"], "consumed": 0}})
        second = torch.cat([y for _, y in loader]).tolist()
        assert loader.meter.stage_s["repair"] == repair_s  # no DALI failure this time
    assert first == second and first[14] == 15
    assert state["skipped"] == [14]


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "corrupt_data"])
def test_raise_names_dataset_shard_and_record(images: list[bytes], kind: str) -> None:
    ds = _with_corrupt(images[:16], {11: kind})
    with _loader(ds, batch_size=4, train=False, shuffle=False) as loader:
        it = iter(loader)
        assert torch.cat([next(it)[1] for _ in range(2)]).tolist() == list(range(8))
        with pytest.raises(DatasetError) as info:
            next(it)
    msg = str(info.value)
    assert "mem://images" in msg and "shard 1, record 3" in msg and "index 11" in msg, msg
    assert {
        "truncated": "truncated",
        "garbage": "magic",
        "empty": "zero-length",
        "corrupt_data": "decode",
    }[kind] in msg


def test_read_error_is_reported_or_skipped(images: list[bytes]) -> None:
    ds = ExplodingDataset(images[:6])
    with (
        _loader(ds, batch_size=3, train=False, shuffle=False) as loader,
        pytest.raises(DatasetError, match="checksum mismatch"),
    ):
        list(loader)
    with _loader(ds, batch_size=3, train=False, shuffle=False, on_error="skip") as loader:
        assert torch.cat([y for _, y in loader]).tolist() == [0, 1, 3, 3, 4, 5]


def test_hung_worker_times_out(images: list[bytes]) -> None:
    ds = HangingDataset(images[:8])
    before = set(descendants())
    loader = _loader(ds, batch_size=4, train=False, shuffle=False, timeout=3)
    # DALI prefetches batch 1 while producing batch 0, so either may be the one that times out
    with pytest.raises(WorkerError, match=r"produced no batch [01] within 3 s \(dataset mem://"):
        list(loader)
    loader.close()
    assert alive(set(descendants()) - before) == []  # the stuck worker is ended, and reaped


_EXIT_SCRIPT = """
import os, sys, time
sys.path[:0] = [{tests!r}]
from _procs import alive, descendants
from test_dali_datasets import HangingDataset
from feedpipe.dali import ImageLoader

def main():
    records = [open(os.path.join({tmp!r}, f"{{i}}.jpg"), "rb").read() for i in range(8)]
    ds = HangingDataset(records)
    ds.marker = os.path.join({tmp!r}, "hung")
    loader = ImageLoader(ds, 2, device="cpu", crop=32, resize=40, num_threads=1,
                         py_num_workers=1, train=False, shuffle=False, timeout=30)
    next(iter(loader))  # batch 0; the worker goes on to batch 2 and hangs on record 5
    while not os.path.exists(ds.marker):
        pass
    print("WORKERS", os.getpid(), *descendants(), flush=True)
    t = time.monotonic()
    loader.close()
    print("CLOSE_S", time.monotonic() - t, flush=True)
    print("AFTER", *alive(descendants()), flush=True)

if __name__ == "__main__":
    main()
"""


def test_hung_worker_gone_after_close_and_exit(images: list[bytes], tmp_path: Path) -> None:
    """A worker hung in the dataset, then close(), then interpreter exit: no process of the
    loader's and no plan directory in /dev/shm is left."""
    for i, rec in enumerate(images[:8]):
        (tmp_path / f"{i}.jpg").write_bytes(rec)
    script = tmp_path / "hang.py"
    tests = str(Path(__file__).parent)
    script.write_text(_EXIT_SCRIPT.format(tests=tests, tmp=str(tmp_path)))
    proc = run_python(script, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = key_lines(proc.stdout)
    pid, *workers = (int(p) for p in lines["WORKERS"].split())
    assert workers, "the hung DALI worker was not seen"
    assert lines["AFTER"] == ""  # close() ended the stuck worker
    assert wait_gone(workers, 30.0) == []  # nothing outlives the interpreter (30 s: load 10)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"feedpipe-dali-{pid}-")]


_IDLE_EXIT_SCRIPT = """
import os, sys, threading
sys.path[:0] = [{tests!r}]
from test_dali_datasets import BytesDataset
from feedpipe.dali import ImageLoader

signalled = os.path.join({tmp!r}, "signalled")
real_kill = os.kill

def kill(pid, sig):  # every signal this process sends as it exits, and the sending thread
    with open(signalled, "a") as f:
        f.write(f"{{pid}} {{sig}} {{threading.current_thread().name}}\\n")
    real_kill(pid, sig)

def main():
    records = [open(os.path.join({tmp!r}, f"{{i}}.jpg"), "rb").read() for i in range(8)]
    loader = ImageLoader(BytesDataset(records), 4, device="cpu", crop=32, resize=40,
                         num_threads=1, py_num_workers=1, train=False, shuffle=False, timeout=60)
    for _ in loader:  # a whole epoch: the worker waits for the next task
        pass
    os.kill = kill
    print("LOADED", flush=True)
    return loader  # still alive at exit: the reaper's exit hook ends its worker

if __name__ == "__main__":
    kept = main()
"""


def test_an_idle_worker_at_exit_is_closed_by_dali_not_signalled(
    images: list[bytes], tmp_path: Path
) -> None:
    """Found: at interpreter exit the reaper signalled DALI's idle source worker while DALI's
    pool still counted it as waiting; DALI's own pool close (the pipeline's finalizer, after)
    then waited for it to wake, for ever (examples/image_classification_dali.py hung at exit,
    under load). The pool is now closed first: the idle worker is told to exit by DALI."""
    for i, rec in enumerate(images[:8]):
        (tmp_path / f"{i}.jpg").write_bytes(rec)
    script = tmp_path / "idle.py"
    script.write_text(_IDLE_EXIT_SCRIPT.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)))
    proc = run_python(script, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED" in proc.stdout
    sent = (tmp_path / "signalled").read_text() if (tmp_path / "signalled").exists() else ""
    # DALI's own close may still terminate a worker that did not exit within its 1 s join (from
    # its observer thread, once it has told the waiting workers): never the reaper before it
    early = [line for line in sent.splitlines() if "_observer_thread" not in line]
    assert early == [], f"signalled before DALI closed its pool (pid signal thread): {sent!r}"


@pytest.mark.gpu
def test_gpu_matches_cpu(images: list[bytes]) -> None:
    ds = BytesDataset(images)
    out = {}
    for device in ("cpu", "cuda"):
        with _loader(ds, batch_size=8, train=False, shuffle=False, device=device) as loader:
            out[device] = [(x, y) for x, y in loader]
    for (xc, yc), (xg, yg) in zip(out["cpu"], out["cuda"], strict=True):
        assert xg.is_cuda and yg.is_cuda
        assert torch.equal(yc, yg.cpu())
        assert (xc - xg.cpu()).abs().mean() < 0.05  # nvJPEG vs libjpeg-turbo IDCT


def test_memmap_dataset_bad_record_names_shard(images: list[bytes], tmp_path: object) -> None:
    memmap = pytest.importorskip("feedpipe.memmap")
    path = str(tmp_path) + "/ds"  # type: ignore[operator]
    records = list(images[:12])
    records[10] = _corrupt("truncated", images[10])
    with memmap.MemmapWriter(path, fields={"label": "int64"}, shard_bytes=8 * len(images[0])) as w:
        for i, rec in enumerate(records):
            w.append(rec, label=100 + i)
    ds = memmap.MemmapDataset(path)
    assert len(ds.index.shards) >= 2
    with _loader(ds, batch_size=4, train=False, shuffle=False) as loader:
        it = iter(loader)
        x, y = next(it)
        assert y.tolist() == [100, 101, 102, 103] and x.shape == (4, 3, CROP, CROP)
        next(it)
        with pytest.raises(DatasetError) as info:
            next(it)
    starts = np.cumsum([0] + [s.records for s in ds.index.shards])
    sid = int(np.searchsorted(starts, 10, side="right") - 1)
    assert f"{path}" in str(info.value) and f"shard {sid}" in str(info.value)
    assert f"record {10 - starts[sid]}" in str(info.value) and "truncated" in str(info.value)


_KILLED_SCRIPT = _EXIT_SCRIPT.replace(
    "    t = time.monotonic()\n",
    "    os.kill(os.getpid(), 9)  # the OOM killer: no close, no exit hook\n",
)


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_hung_worker_gone_when_the_owner_is_sigkilled(
    images: list[bytes], tmp_path: Path, start: str
) -> None:
    """Found: the loader's process killed outright (OOM) left its source worker, hung in the
    dataset, running as an orphan for good. A ``spawn`` worker sets its watch on unpickling the
    source, a ``fork`` worker (which unpickles nothing) on its first batch."""
    for i, rec in enumerate(images[:8]):
        (tmp_path / f"{i}.jpg").write_bytes(rec)
    script, out = tmp_path / "killed.py", tmp_path / "out"
    tests = str(Path(__file__).parent)
    body = _KILLED_SCRIPT.replace(
        "py_num_workers=1,", f"py_num_workers=1, py_start_method={start!r},"
    )
    script.write_text(body.format(tests=tests, tmp=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tests).parent), tests])}
    with open(out, "w") as f:  # a file, not a pipe: an orphan would hold a pipe open
        subprocess.run(
            [sys.executable, str(script)], check=False, stdout=f, stderr=subprocess.DEVNULL,
            env=env, timeout=90,
        )  # fmt: skip
    lines = {k: v for k, _, v in (ln.partition(" ") for ln in out.read_text().splitlines())}
    pid, *workers = (int(p) for p in lines["WORKERS"].split())
    try:
        assert workers, "the hung DALI worker was not seen"
        assert wait_gone(workers, 30.0) == []  # returns once gone; 30 s: a hang guard at load 10
    finally:
        for left in alive(workers):
            os.kill(left, signal.SIGKILL)
        for name in os.listdir("/dev/shm"):  # the plan a killed process could not remove
            if name.startswith(f"feedpipe-dali-{pid}-"):
                shutil.rmtree(f"/dev/shm/{name}", ignore_errors=True)


def test_source_watch_only_in_a_worker_the_owner_started() -> None:
    """The owner watch is set only in a process the loader's process started: never in the
    owner itself (a copy of the source) nor in a process whose parent is not the owner (a source
    unpickled elsewhere), where the owner's exit must not end it."""
    import copy
    import pickle
    import threading

    from feedpipe.dali.source import BatchSource, watch_owner

    def watches() -> int:
        return sum(t.name == "feedpipe-parent-watch" for t in threading.enumerate())

    before = watches()
    src = BatchSource([b"x"], "/nonexistent", 1, False, 1)
    copy.deepcopy(src)
    pickle.loads(pickle.dumps(src))
    watch_owner(os.getpid())
    watch_owner(None)
    watch_owner(1 if os.getppid() != 1 else 2)  # an owner that is not this process's parent
    assert watches() == before


def test_watch_that_cannot_open_a_pidfd_leaves_the_worker_running(tmp_path: Path) -> None:
    """Found: the withdrawn watch took any pidfd_open failure (EMFILE, a seccomp sandbox's
    ENOSYS/EPERM) for a dead owner and ended a live source worker at its start; only a
    parent that is gone (ESRCH) may end it."""
    script = tmp_path / "nofd.py"
    script.write_text(
        "import errno, os\n"
        "def refuse(pid):\n"
        "    raise OSError(errno.EMFILE, 'Too many open files')\n"
        "os.pidfd_open = refuse\n"
        "from feedpipe.io.reaper import die_with_parent\n"
        "die_with_parent()\n"
        "print('STILL_RUNNING', flush=True)\n"
    )
    proc = run_python(script, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STILL_RUNNING" in proc.stdout


_EXIT_CASES = {
    "two loaders": "kept = [make(), make()]\nfor ld in kept:\n    for _ in ld: pass",
    "closed twice, another alive": (
        "a, b = make(), make()\nfor ld in (a, b):\n    for _ in ld: pass\n"
        "a.close()\na.close()\nkept = b"
    ),
}

_EXIT_CASE_SCRIPT = """
import os, sys, threading
sys.path[:0] = [{tests!r}]
from test_dali_datasets import BytesDataset
from feedpipe.dali import ImageLoader

signalled = os.path.join({tmp!r}, "signalled")
real_kill = os.kill

def kill(pid, sig):
    with open(signalled, "a") as f:
        f.write(f"{{pid}} {{sig}} {{threading.current_thread().name}}\\n")
    real_kill(pid, sig)

records = [open(os.path.join({tmp!r}, f"{{i}}.jpg"), "rb").read() for i in range(8)]

def make():
    return ImageLoader(BytesDataset(records), 4, device="cpu", crop=32, resize=40,
                       num_threads=1, py_num_workers=1, train=False, shuffle=False, timeout=60)

def main():
{body}
    os.kill = kill
    print("LOADED", flush=True)
    return kept  # still alive at exit: the reaper's exit hook ends the workers

if __name__ == "__main__":
    kept = main()
"""


@pytest.mark.parametrize("case", sorted(_EXIT_CASES))
def test_idle_workers_exit_cleanly_in_other_shapes(
    images: list[bytes], tmp_path: Path, case: str
) -> None:
    """Two loaders alive at exit, a loader closed twice beside a live one: the process exits (no
    hang) and no idle worker is signalled before DALI's pool close told it to exit."""
    for i, rec in enumerate(images[:8]):
        (tmp_path / f"{i}.jpg").write_bytes(rec)
    script = tmp_path / "case.py"
    body = textwrap.indent(_EXIT_CASES[case], "    ")
    script.write_text(
        _EXIT_CASE_SCRIPT.format(tests=str(Path(__file__).parent), tmp=str(tmp_path), body=body)
    )
    proc = run_python(script, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED" in proc.stdout
    sent = (tmp_path / "signalled").read_text() if (tmp_path / "signalled").exists() else ""
    early = [line for line in sent.splitlines() if "_observer_thread" not in line]
    assert early == [], f"signalled before DALI closed its pool (pid signal thread): {sent!r}"
