"""ckpt deletes or overwrites only what it wrote (``ckpt._owner``, issue 25 item 1).

One matrix: every path that deletes or overwrites (a manager's first save, its leftover cleanup,
its retention, ``ckpt gc`` and its ``--dry-run`` on an unclaimed and on a claimed directory,
``ckpt.save(PATH)``, a DCP save without a manager) x every foreign layout (a torchtitan/DCP step,
a DeepSpeed ``latest``, user folders named ``step-7`` and ``step-1.tmp-...``/``step-2.del-...``,
a ``step-5`` with another tool's ``manifest.json``, a symlink ``step-3`` pointing outside). The
foreign files survive byte for byte, and the error (or the warning, or gc's output) names them.
The remote tier's retention gets the layouts a remote can hold.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import _owner
from ckpt.cli import main as cli
from ckpt.manager import CheckpointManager

STATE = {"w": torch.arange(8, dtype=torch.float32)}


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _dcp(root: Path, outside: Path) -> list[str]:
    (root / "step-100").mkdir()
    (root / "step-100" / ".metadata").write_bytes(b"torchtitan metadata \x00\x01")
    (root / "step-100" / "__0_0.distcp").write_bytes(os.urandom(256))
    return ["step-100"]


def _deepspeed(root: Path, outside: Path) -> list[str]:
    (root / "latest").write_bytes(b"global_step10")
    return ["latest"]


def _user_step(root: Path, outside: Path) -> list[str]:
    (root / "step-7").mkdir()
    (root / "step-7" / "mine.txt").write_bytes(b"my notes")
    return ["step-7"]


def _user_scratch(root: Path, outside: Path) -> list[str]:
    tmp, dead = f"step-1.tmp-{_dead_pid()}-abcdef12", "step-2.del-abcdef12"
    for name in (tmp, dead):
        (root / name).mkdir()
        (root / name / "mine.txt").write_bytes(b"mine: " + name.encode())
    return [tmp, dead]


def _other_manifest(root: Path, outside: Path) -> list[str]:
    (root / "step-5").mkdir()
    (root / "step-5" / "manifest.json").write_bytes(b'{"format": "other-tool", "files": []}')
    (root / "step-5" / "data.bin").write_bytes(b"their data")
    return ["step-5"]


def _symlink(root: Path, outside: Path) -> list[str]:
    (outside / "keep.txt").write_bytes(b"outside, never touched")
    (root / "step-3").symlink_to(outside, target_is_directory=True)
    return ["step-3"]


def _lock(root: Path, outside: Path) -> list[str]:
    (root / ".lock").write_bytes(b"another tool's lock: do not truncate\n")
    return [".lock"]


LAYOUTS: dict[str, Callable[[Path, Path], list[str]]] = {
    "dcp": _dcp,
    "deepspeed-latest": _deepspeed,
    "user-step": _user_step,
    "user-tmp-del": _user_scratch,
    "other-manifest": _other_manifest,
    "symlink": _symlink,
    "foreign-lock": _lock,
}


def _snapshot(root: Path, names: list[str], outside: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for top in [root / n for n in names] + [outside]:
        for path in [top, *sorted(top.rglob("*"))] if not top.is_symlink() else [top]:
            key = str(path)
            if path.is_symlink():
                out[key] = ("link", os.readlink(path))
            elif path.is_file():
                out[key] = path.read_bytes()
            else:
                out[key] = "dir"
    return out


def _save(m: CheckpointManager, step: int) -> None:
    m.save(step, STATE).result(30)


def _manager_first_save(root: Path, layout: Callable, outside: Path) -> tuple[list[str], str]:
    names = layout(root, outside)
    with pytest.raises(FileExistsError) as info:  # ForeignEntriesError
        CheckpointManager(root).save(1000, STATE)
    return names, str(info.value)


def _claimed(root: Path) -> None:
    with CheckpointManager(root, keep_last=1) as m:
        _save(m, 1000)


def _manager_cleanup(root: Path, layout: Callable, outside: Path) -> tuple[list[str], str]:
    _claimed(root)
    names = layout(root, outside)
    try:
        with CheckpointManager(root, keep_last=1) as m:
            _save(m, 1001)
    except Exception as exc:  # a foreign latest or symlink: refused, named
        return names, str(exc)
    return names, ""


def _manager_retention(root: Path, layout: Callable, outside: Path) -> tuple[list[str], str]:
    errors = []
    with CheckpointManager(root, keep_last=1) as m:
        _save(m, 1000)
        names = layout(root, outside)
        for step in (1001, 1002):
            try:
                _save(m, step)
            except Exception as exc:
                errors.append(str(exc))
        try:
            m.gc()
        except Exception as exc:
            errors.append(str(exc))
    return names, "\n".join(errors)


def _gc(claimed: bool, *flags: str) -> Callable:
    def run(root: Path, layout: Callable, outside: Path) -> tuple[list[str], str]:
        if claimed:
            _claimed(root)
        names = layout(root, outside)
        return names, f"rc={cli(['gc', str(root), '--keep-last', '1', *flags])}"

    return run


def _simple_save(root: Path, layout: Callable, outside: Path) -> tuple[list[str], str]:
    names = layout(root, outside)
    errors = []
    for name in names:  # replace the foreign entry itself, or the step its scratch name is of
        target = root / (name.partition(".")[0] or "step-1")
        try:
            ckpt.save(target, STATE)
        except Exception as exc:
            errors.append(str(exc))
        else:
            assert target.name != name  # saved beside a scratch name, which stays
            errors.append(f"saved beside {name}")
    return names, "\n".join(errors)


def _dcp_save(root: Path, layout: Callable, outside: Path) -> tuple[list[str], str]:
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import CkptStorageWriter

    names = layout(root, outside)
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is one
        dcp.save({"w": STATE["w"].clone()}, storage_writer=CkptStorageWriter(root, 1000),
                 no_dist=True)  # fmt: skip
    failures = getattr(info.value, "failures", {})  # DCP's CheckpointException, per rank
    return names, "\n".join([str(info.value), *(str(e) for e in failures.values())])


PATHS: dict[str, Callable] = {
    "manager-first-save": _manager_first_save,
    "manager-cleanup": _manager_cleanup,
    "manager-retention": _manager_retention,
    "gc": _gc(False),
    "gc-dry-run": _gc(False, "--dry-run"),
    "gc-claimed": _gc(True),
    "gc-claimed-dry-run": _gc(True, "--dry-run"),
    "ckpt.save": _simple_save,
    "dcp-save": _dcp_save,
}


# a running manager's retention lists only steps with a manifest: these it never looks at
# (and a manager holding the lock, or ckpt.save(PATH), never opens another .lock)
UNSEEN = {("manager-retention", lay) for lay in ("dcp", "user-step", "user-tmp-del")} | {
    ("manager-retention", "foreign-lock"),
    ("ckpt.save", "foreign-lock"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("path", list(PATHS))
def test_foreign_entries_survive_every_deleting_path(
    tmp_path: Path, path: str, layout: str, caplog: Any, capsys: Any
) -> None:
    root, outside = tmp_path / "run", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    made: list[str] = []

    def recording(r: Path, o: Path) -> list[str]:
        made.extend(LAYOUTS[layout](r, o))
        before.update(_snapshot(r, made, o))
        return made

    before: dict[str, Any] = {}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        names, said = PATHS[path](root, recording, outside)
    out = capsys.readouterr()
    assert _snapshot(root, names, outside) == before  # byte for byte, links unchanged
    told = "\n".join([said, caplog.text, out.out, out.err])
    for name in names if (path, layout) not in UNSEEN else ():
        assert name in told, f"{path} x {layout}: {name} not named in:\n{told}"
    if path in ("gc", "gc-dry-run"):  # an unclaimed directory with foreign entries: refused
        assert said == "rc=1" and "not written by ckpt" in out.out
        assert not (root / ".ckpt-owner.json").exists()
        assert ".lock" in names or not (root / ".lock").exists()  # nothing written


def test_a_root_of_an_earlier_version_is_adopted_silently(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2) as m:
        for step in (1, 2):
            _save(m, step)
    for name in (".ckpt-owner.json", "retention.json"):  # what an earlier version never wrote
        (tmp_path / name).unlink()
    (tmp_path / "step-3.tmp-1-abcdef12").mkdir()  # its leftover: only ckpt files (none yet)
    assert _owner.foreign(tmp_path) == []
    with CheckpointManager(tmp_path, keep_last=2) as m:
        _save(m, 3)
    assert (tmp_path / ".ckpt-owner.json").is_file()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2", "step-3"]


def test_remote_retention_deletes_only_ckpt_prefixes(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    import s3fs

    from ckpt.remote import RemoteOptions

    bucket, opts = s3_bucket
    fs = s3fs.S3FileSystem(**opts)
    theirs = {
        f"{bucket}/run/step-100/.metadata": b"torchtitan",  # a DCP step: no manifest
        f"{bucket}/run/step-7/mine.txt": b"my notes",  # a user's prefix
        f"{bucket}/run/step-5/manifest.json": b'{"format": "other"}',  # another tool's manifest
        f"{bucket}/run/step-5/data.bin": b"their data",
    }
    for key, data in theirs.items():
        fs.pipe_file(key, data)
    remote = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, grace_s=0.0)
    with CheckpointManager(tmp_path, keep_last=1, remote=remote, keep_last_remote=1) as m:
        for step in (1000, 1001):
            _save(m, step)
            m.wait(uploads=True)
    fs.invalidate_cache()
    assert {k: fs.cat_file(k) for k in theirs} == theirs
    assert not fs.exists(f"{bucket}/run/step-1000/manifest.json")  # its own retention still ran
    assert fs.exists(f"{bucket}/run/step-1001/manifest.json")


def test_the_upload_status_mirror_is_never_written_into_a_foreign_directory(tmp_path: Path) -> None:
    """The remote tier wrote ``upload-status.json`` from its thread, over whatever held the name,
    before the first save claimed the directory."""
    import uuid

    from ckpt.remote import RemoteOptions

    (tmp_path / "upload-status.json").write_bytes(b"another tool's status")
    (tmp_path / "notes.txt").write_bytes(b"mine")
    m = CheckpointManager(tmp_path, remote=RemoteOptions(f"memory://{uuid.uuid4().hex}/run"))
    try:
        with pytest.raises(FileExistsError, match=r"notes\.txt"):
            m.save(1, STATE)
        m.wait(uploads=True)  # the tier's first reconcile (and its status write) has run
    finally:
        m.close()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "upload-status.json"]
    assert (tmp_path / "upload-status.json").read_bytes() == b"another tool's status"


def test_an_upload_never_overwrites_another_tool_s_remote_step(tmp_path: Path) -> None:
    import uuid

    import fsspec

    from ckpt.errors import CheckpointError
    from ckpt.remote import RemoteOptions

    url = f"memory://{uuid.uuid4().hex}/run"
    fs = fsspec.filesystem("memory")
    theirs = b'{"format": "other-tool"}'
    fs.pipe_file(f"{url}/step-1/manifest.json", theirs)
    with (
        pytest.raises(CheckpointError, match=r"step-1/manifest\.json: was not written by ckpt"),
        CheckpointManager(tmp_path, remote=RemoteOptions(url, deadline_s=5)) as m,
    ):
        _save(m, 1)
        m.wait(uploads=True)
    assert fs.cat_file(f"{url}/step-1/manifest.json") == theirs


@pytest.mark.parametrize("name", ["retention.json", "upload-status.json", ".ckpt-owner.json"])
def test_json_nested_too_deeply_under_a_ckpt_name_is_refused_by_name(
    tmp_path: Path, name: str
) -> None:
    """A JSON file nested past the parser's recursion limit under one of ckpt's names was a
    ``RecursionError`` traceback from every claim, ``ckpt ls``/``gc`` and ``foreign``; it is
    another tool's file (or a malformed marker), named."""
    (tmp_path / name).write_text("[" * 100_000 + "]" * 100_000)
    if name.startswith(".ckpt"):
        with pytest.raises(ValueError, match=r"\.ckpt-owner\.json: .*nested too deeply"):
            _owner.owned(tmp_path)
        return
    assert _owner.foreign(tmp_path) == [name]
    with pytest.raises(FileExistsError, match=name.replace(".", r"\.")):
        _owner.claim_root(tmp_path)


def test_ckpt_save_never_replaces_a_user_folder_of_a_data_bin(tmp_path: Path) -> None:
    """``ckpt.save(PATH)`` replaced a folder holding only the user's ``data.bin`` (a data file's
    name, no manifest): ckpt.save never leaves PATH without its manifest, so that folder is not
    ckpt's. An empty folder and an earlier checkpoint are still replaced."""
    from ckpt.errors import CheckpointError

    theirs = tmp_path / "weights"
    theirs.mkdir()
    (theirs / "data.bin").write_bytes(b"the user's weights")
    with pytest.raises(CheckpointError, match=r"weights: exists and is not a checkpoint"):
        ckpt.save(theirs, {"w": torch.ones(2)})
    assert os.listdir(theirs) == ["data.bin"]
    assert (theirs / "data.bin").read_bytes() == b"the user's weights"
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # an empty folder, then the checkpoint written there
        ckpt.save(tmp_path / "empty", {"w": torch.ones(2)})
    assert torch.equal(ckpt.load(tmp_path / "empty")["w"], torch.ones(2))


def test_the_upload_status_mirror_never_writes_through_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status mirror's temporary name (pid and thread id: predictable) was opened with
    ``write_text``, following a symlink planted there and overwriting its target outside."""
    import uuid

    from ckpt import _layout
    from ckpt.remote import RemoteOptions

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"someone else's file")
    root = tmp_path / "run"
    name = ".upload-status.json.tmp-1-1"
    monkeypatch.setattr(_layout, "status_tmp_name", lambda: name)
    _owner.claim_root(root)
    (root / name).symlink_to(outside)  # planted in ckpt's directory: not ckpt's entry
    with CheckpointManager(root, remote=RemoteOptions(f"memory://{uuid.uuid4().hex}/run")) as m:
        _save(m, 1)
        m.wait(uploads=True)
    assert outside.read_bytes() == b"someone else's file"
    assert (root / name).is_symlink()  # not ckpt's: left where it is
