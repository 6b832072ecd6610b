"""Adversarial review of the commit protocol and the no-follow rules (issue 15 points 2, 3).

Special files where ckpt expects a regular file (a FIFO, a directory) are a clear error and
never hang; ``ckpt.save(path)`` never deletes a path that is not a checkpoint.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import save_two_steps as _run
from _helpers import small_state as _state

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _no_hang(fn: Callable[[], Any], fifos: list[Path], timeout_s: float = 5.0) -> Any:
    """Run ``fn`` in a thread; if it is still running after ``timeout_s`` (blocked opening a
    FIFO), release it by opening the FIFOs' write ends and fail."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"hung on a FIFO: {fifos}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _fifo(path: Path) -> Path:
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


def test_manifest_fifo_never_hangs(tmp_path: Path) -> None:
    """A manifest replaced by a FIFO: ckpt.load, CkptStorageReader-free CLI verify and ls end
    with a clear error, never block on open."""
    path = ckpt.save(tmp_path / "one", _state(1))
    fifo = _fifo(path / "manifest.json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: .*not a regular file"):
        _no_hang(lambda: ckpt.load(path), [fifo])
    assert _no_hang(lambda: ckpt_main(["verify", str(path)]), [fifo]) == 1


def test_data_file_fifo_never_hangs(tmp_path: Path) -> None:
    """A data file replaced by a FIFO: restore falls back to the older step (logged), verify
    fails, and nothing blocks."""
    root = _run(tmp_path / "run")
    fifo = _fifo(root / "step-2" / "data.bin")
    with CheckpointManager(root) as m:
        state = _no_hang(m.restore, [fifo])
    assert state["step"] == 1
    with pytest.raises(CheckpointError, match=r"data\.bin: .*not a regular file"):
        _no_hang(lambda: ckpt.load(root / "step-2"), [fifo])
    assert _no_hang(lambda: ckpt_main(["verify", str(root)]), [fifo]) == 1


def test_data_file_directory_is_corrupt(tmp_path: Path) -> None:
    """A data file replaced by a directory is a CheckpointError naming it, not a raw OSError."""
    root = _run(tmp_path / "run")
    (root / "step-2" / "data.bin").unlink()
    (root / "step-2" / "data.bin").mkdir()
    with pytest.raises(CheckpointError, match=r"data\.bin"):
        ckpt.load(root / "step-2")


def test_dcp_data_file_fifo_never_hangs(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt.dcp import CkptStorageReader, CkptStorageWriter

    root = tmp_path / "run"
    dcp.save({"w": torch.ones(10)}, storage_writer=CkptStorageWriter(root, step=5))
    data = [p for p in (root / "step-5").iterdir() if p.name != "manifest.json"]
    assert data
    fifos = [_fifo(p) for p in data]
    out = {"w": torch.zeros(10)}
    with pytest.raises((CheckpointError, CheckpointException)) as info:  # DCP wraps it
        _no_hang(lambda: dcp.load(out, storage_reader=CkptStorageReader(root / "step-5")), fifos)
    assert "rank-00000.bin: not a regular file" in repr(info.value) + str(info.value)


def test_latest_fifo_never_hangs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``DIR/latest`` replaced by a FIFO: ``ckpt ls`` does not block; the next save commits its
    step, then refuses to replace a ``latest`` that ckpt did not write, naming it (issue 25)."""
    root = _run(tmp_path / "run")
    fifo = _fifo(root / "latest")
    assert _no_hang(lambda: ckpt_main(["ls", str(root)]), [fifo]) == 0
    with (
        pytest.raises(CheckpointError, match=r"latest: was not written by ckpt"),
        CheckpointManager(root, keep_last=None) as m,
    ):
        _no_hang(lambda: m.save(3, _state(3)).result(30), [fifo])
    assert stat.S_ISFIFO(os.lstat(root / "latest").st_mode)
    with CheckpointManager(root) as m:
        assert m.steps() == [1, 2, 3]


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_lock_special_file_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    """``DIR/.lock`` that is a directory or a FIFO: a CheckpointError naming it, never a hang."""
    root = _run(tmp_path / "run")
    lock = root / ".lock"
    lock.unlink()
    if kind == "dir":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(CheckpointError, match=r"\.lock"):
        _no_hang(lambda: CheckpointManager(root).save(3, _state(3)).result(30), [lock])


def test_save_never_deletes_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    """``ckpt.save("outputs", state)`` over a user's directory refuses; the files stay."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "results.csv").write_text("precious\n")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ckpt.save(outputs, _state(1))
    assert (outputs / "results.csv").read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


def test_save_never_deletes_a_file(tmp_path: Path) -> None:
    """``ckpt.save(path)`` where ``path`` is a regular file refuses; the file stays."""
    victim = tmp_path / "model.pt"
    victim.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ckpt.save(victim, _state(1))
    assert victim.read_bytes() == b"precious"


def test_save_into_an_empty_directory_and_over_a_checkpoint(tmp_path: Path) -> None:
    """An empty directory and an existing checkpoint are replaced (trailing slash, relative)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    ckpt.save(str(empty) + "/", _state(1))
    assert ckpt.load(empty)["step"] == 1
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ckpt.save("empty/", _state(2))
        assert ckpt.load("empty")["step"] == 2
    finally:
        os.chdir(cwd)


# ---- recovery killed after each of its own filesystem operations, then recovered again ----


def _cut_run(base: Path) -> None:
    """A directory as crashed writers leave it: step 5 only under a complete ``.del-`` name, a
    half-deleted ``.del-`` copy, a dead save's temporary directory, an eviction cut after its
    manifest went, and a stray ``latest.tmp-``."""
    import shutil

    from _ckpt_commit_worker import state

    with CheckpointManager(base, keep_last=None) as m:
        for s in (4, 5, 6):
            m.save(s, state(s, "old")).result(30)
    shutil.copytree(base / "step-5", base / "step-5.tmp-1-abcd")
    shutil.copytree(base / "step-5", base / "step-5.del-bbbb")
    (base / "step-5.del-bbbb" / "manifest.json").unlink()
    (base / "step-5").rename(base / "step-5.del-aaaa")
    (base / "step-6" / "manifest.json").unlink()
    (base / "latest.tmp-1-abcd").write_text("step-6\n")


def _recover_manager(root: str) -> None:
    with CheckpointManager(root, keep_last=None) as m:
        m.gc()  # takes the writer lock: recovery and leftover removal


def _recover_reader(root: str) -> None:
    from ckpt.saving import commit

    commit.steps(Path(root))


def _recover_simple(root: str) -> None:
    ckpt.load(Path(root) / "model")


def _killed(fn: Callable[[str], None], root: Path, k: int) -> int | None:
    import multiprocessing as mp

    def body() -> None:
        os.environ["CKPT_TEST_KILL_AFTER"] = str(k)
        fn(str(root))

    proc = mp.get_context("fork").Process(target=body)
    proc.start()
    proc.join(30)
    return proc.exitcode


@pytest.mark.parametrize("mode", ["manager", "reader", "simple"])
def test_recovery_is_idempotent_under_kills(tmp_path: Path, mode: str) -> None:
    """Recovery itself killed after its k-th operation, then killed again after its first, then
    run to the end: the only complete copy of step 5 is never lost."""
    import shutil

    from _ckpt_commit_worker import state

    base = tmp_path / "base"
    if mode == "simple":
        base.mkdir()
        ckpt.save(base / "model", state(5, "old"))
        shutil.copytree(base / "model", base / "model.del-bbbb")
        (base / "model.del-bbbb" / "manifest.json").unlink()
        (base / "model").rename(base / "model.del-aaaa")
    else:
        _cut_run(base)
    fn = {"manager": _recover_manager, "reader": _recover_reader, "simple": _recover_simple}[mode]
    for kills, k in enumerate(range(1, 40)):
        root = tmp_path / f"k{k}"
        shutil.copytree(base, root)
        code = _killed(fn, root, k)
        assert code in (0, -9), code
        assert _killed(fn, root, 1) in (0, -9)
        if mode == "simple":
            got = ckpt.load(root / "model")
        else:
            _recover_manager(str(root))
            with CheckpointManager(root) as m:
                assert m.steps() == [4, 5], k
                got = m.restore(5)
        assert got["tag"] == "old" and torch.equal(got["w"], state(5, "old")["w"]), k
        shutil.rmtree(root)
        if code == 0:
            assert kills >= (1 if mode == "reader" else 3), kills  # the harness did kill it
            return
    pytest.fail("recovery never finished")


def test_hard_linked_lock_is_never_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``DIR/.lock`` hard-linked to a file elsewhere (``cp -al``, an attacker): the writer lock
    refuses it instead of truncating the other file; ``ckpt gc`` too."""
    root = _run(tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    (root / ".lock").unlink()
    os.link(victim, root / ".lock")
    with pytest.raises(CheckpointError, match=r"\.lock: .*hard link"):
        CheckpointManager(root).save(3, _state(3)).result(30)
    for args in (["gc", str(root), "--dry-run"], ["gc", str(root), "--keep-last", "1"]):
        assert ckpt_main(args) == 1
        assert "hard link" in capsys.readouterr().err
    assert victim.read_bytes() == b"precious\n"


def _deflated(obj: Any) -> bytes:
    """``torch.save(obj)`` re-zipped with deflate: a few KiB that expand to the full size."""
    import io
    import zipfile

    plain = io.BytesIO()
    torch.save(obj, plain)
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(plain.getvalue())) as zin,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout,
    ):
        for name in zin.namelist():
            zout.writestr(name, zin.read(name))
    return out.getvalue()


def test_byte_item_bomb_is_refused() -> None:
    """A DCP byte item is loaded with ``weights_only=True``, which also inflates deflated zip
    entries: a 50 KiB item would allocate 50 MB (GBs for a larger one). Only what torch.save
    writes (stored entries, the zip format) is accepted, so memory is bounded by the item."""
    import io

    from ckpt.dcp import load_bytes_item

    bomb = _deflated(torch.zeros(50_000_000, dtype=torch.uint8))
    assert len(bomb) < 1_000_000
    with pytest.raises(CheckpointError, match=r"item 'x'.*compressed"):
        load_bytes_item(bomb, "item 'x'")
    legacy = io.BytesIO()
    torch.save({"a": 1}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"item 'y'.*not a torch\.save zip"):
        load_bytes_item(legacy.getvalue(), "item 'y'")
    plain = io.BytesIO()
    torch.save({"a": torch.arange(3), "b": "text"}, plain)
    got = load_bytes_item(plain.getvalue(), "item 'z'")
    assert got["b"] == "text" and torch.equal(got["a"], torch.arange(3))


def test_latest_directory_is_named_and_kept(tmp_path: Path) -> None:
    """A directory named ``latest``: the save commits its step, then fails naming ``latest``;
    the directory and its files are left alone, and no ``latest.tmp-`` is left behind."""
    root = _run(tmp_path / "run")
    (root / "latest").unlink()
    (root / "latest").mkdir()
    (root / "latest" / "notes.txt").write_text("keep\n")
    with (
        pytest.raises(CheckpointError, match=r"latest: is a directory"),
        CheckpointManager(root, keep_last=None) as m,
    ):
        m.save(3, _state(3)).result(30)
    assert (root / "latest" / "notes.txt").read_text() == "keep\n"
    assert not [p for p in os.listdir(root) if p.startswith("latest.tmp-")]
    with CheckpointManager(root) as m:
        assert m.steps() == [1, 2, 3]


def test_eviction_never_unlinks_through_a_swapped_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step-N`` swapped for a symlink after eviction opened and locked it (at the
    ``retention`` fault point): the manifest it removes is the locked step's, never one that
    the symlink reaches."""
    from ckpt import _faults
    from ckpt.saving import commit

    root = _run(tmp_path / "run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text("precious\n")
    real = _faults.pause

    def swap(point: str) -> None:
        if point == "retention":
            (root / "step-1").rename(tmp_path / "moved")
            (root / "step-1").symlink_to(victim)
        real(point)

    monkeypatch.setattr(_faults, "pause", swap)
    commit.evict(root, 1)
    assert (victim / "manifest.json").read_text() == "precious\n"
    assert not (tmp_path / "moved" / "manifest.json").exists()  # the locked step lost it


def test_giant_sparse_manifest_is_refused_unread(tmp_path: Path) -> None:
    """A sparse manifest larger than ``MAX_MANIFEST_BYTES`` is a CorruptCheckpointError before
    any of it is read (it is read whole otherwise), and restore falls back."""
    from ckpt import format as fmt
    from ckpt.errors import CorruptCheckpointError

    root = _run(tmp_path / "run")
    with open(root / "step-2" / "manifest.json", "r+b") as f:
        f.truncate(fmt.MAX_MANIFEST_BYTES + 4096)
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: manifest is .* limit"):
        ckpt.load(root / "step-2")
    with CheckpointManager(root) as m:
        assert m.restore()["step"] == 1
