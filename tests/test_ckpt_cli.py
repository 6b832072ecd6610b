"""The ``ckpt ls|verify|gc DIR`` command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt import cli
from ckpt.manager import CheckpointManager
from ckpt.saving import commit


def _populate(root: Path) -> None:
    with CheckpointManager(root, keep_last=None) as m:
        for step in (10, 20, 30):
            m.save(step, {"w": torch.ones(1000) * step}).result()
    (root / "step-40.tmp-1-dead").mkdir()  # an interrupted save


def test_ls(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    assert cli.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "10" and "3.9 KiB" in lines[1]
    assert "committed, latest" in lines[3] and lines[3].split()[0] == "30"
    assert "leftover: step-40.tmp-1-dead" in lines[4]


def test_ls_tells_a_foreign_leftover_name_from_ckpt_s_own(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _populate(tmp_path)
    (tmp_path / "step-9.tmp-1-abcdef12").mkdir()
    (tmp_path / "step-9.tmp-1-abcdef12" / "mine.txt").write_text("mine")
    assert cli.main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "leftover: step-40.tmp-1-dead" in out
    assert "not written by ckpt, kept: step-9.tmp-1-abcdef12" in out


def test_verify_ok_and_single_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    assert cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK: ok (") == 3
    assert cli.main(["verify", str(tmp_path), "--step", "20"]) == 0
    assert capsys.readouterr().out.startswith("step 20: OK")
    assert cli.main(["verify", str(tmp_path), "--step", "99"]) == 1
    assert "does not exist" in capsys.readouterr().out


def test_gc(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1", "--dry-run"]) == 0
    assert "would delete step 10" in capsys.readouterr().out
    assert commit.steps(tmp_path) == [10, 20, 30]
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "removed leftover step-40.tmp-1-dead" in out and "deleted step 20" in out
    assert commit.steps(tmp_path) == [30] and commit.leftovers(tmp_path) == []


def test_gc_keeps_newest_valid(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _populate(tmp_path)
    (tmp_path / "step-30" / "data.bin").write_bytes(b"garbage")
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert "kept step 20 (newest valid checkpoint)" in capsys.readouterr().out
    assert commit.steps(tmp_path) == [20, 30]


def test_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["ls", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def _run_with_retention_held(root: Path) -> CheckpointManager:
    """Steps 1..8 saved by a manager whose policy is keep_last=2, keep_every=3 and the best
    loss (step 2); an evict guard holds its retention back, so every step is still there."""
    m = CheckpointManager(root, keep_last=2, keep_every=3, keep_best=("loss", 1, "min"))
    m.evict_guards.append(lambda step: False)
    for step in range(1, 9):
        m.save(step, {"w": torch.ones(10) * step}, metrics={"loss": abs(step - 2)}).result(30)
    m.close()
    return m


def _steps(root: Path) -> list[int]:
    return commit.steps(root)


def test_gc_without_flags_applies_the_policy_the_manager_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Issue 25 item 2: ``ckpt gc DIR`` kept the newest 3 (its own default) and deleted the best
    step and the keep_every steps; it now deletes exactly what the manager would."""
    import shutil

    _run_with_retention_held(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with CheckpointManager(
        tmp_path / "b", keep_last=2, keep_every=3, keep_best=("loss", 1, "min")
    ) as m:
        m.gc()  # what the manager itself deletes
    assert _steps(tmp_path / "b") == [2, 3, 6, 7, 8]
    assert cli.main(["gc", str(tmp_path / "a"), "--dry-run"]) == 0
    assert _steps(tmp_path / "a") == list(range(1, 9))
    assert cli.main(["gc", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "would delete step 1" in out and "deleted step 5" in out
    assert _steps(tmp_path / "a") == _steps(tmp_path / "b")


def test_gc_without_flags_or_recorded_policy_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _run_with_retention_held(tmp_path)
    (tmp_path / "retention.json").unlink()  # a directory of an earlier version
    assert cli.main(["gc", str(tmp_path)]) == 1
    assert "retention.json: no retention policy recorded" in capsys.readouterr().err
    assert _steps(tmp_path) == list(range(1, 9))
    assert cli.main(["gc", str(tmp_path), "--keep-last", "none", "--keep-every", "4"]) == 0
    assert _steps(tmp_path) == [4, 8]  # explicit flags still work


@pytest.mark.parametrize(
    ("target", "named"),
    [
        ("https://127.0.0.1:1/run", "https://127.0.0.1:1/run"),  # nothing listens: refused
        ("https://user:SECRET@127.0.0.1:1/run", "https://***@127.0.0.1:1/run"),
        ("{tmp}/missing", "{tmp}/missing: no such directory"),
        ("file://{tmp}/missing", "{tmp}/missing: no such directory"),
    ],
)
def test_ls_of_an_unreachable_or_missing_root_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, target: str, named: str
) -> None:
    """Issue 25 item 10: ``ckpt ls`` of an unreachable https URL exited 0 with an empty table."""
    assert cli.main(["ls", target.format(tmp=tmp_path)]) != 0
    err = capsys.readouterr().err
    assert named.format(tmp=tmp_path) in err and "SECRET" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("step", ["-1", "1.5", "x"])
def test_verify_step_that_means_nothing_is_an_argparse_error(
    tmp_path: Path, step: str, capsys: pytest.CaptureFixture
) -> None:
    """``--step -1`` looked for ``step--1`` and reported it missing (exit 1)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["verify", str(tmp_path), "--step", step])
    assert info.value.code == 2
    assert "argument --step: " in capsys.readouterr().err


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("command", "status"), [("ls", "fifo"), ("gc", "fifo"), ("gc", '{"steps": {"1": "done"}}')]
)
def test_a_hostile_upload_status_mirror_neither_hangs_nor_crashes(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: str, status: str
) -> None:
    """``upload-status.json`` as a FIFO hung ``ckpt ls`` and ``ckpt gc`` in ``open``; valid JSON
    whose step entry is not an object was an ``AttributeError`` traceback. Both now read as "no
    upload finished": gc keeps every step the remote guard would keep."""
    import json
    import os

    with CheckpointManager(tmp_path, keep_last=1) as m:
        m.evict_guards.append(lambda step: False)
        for step in (1, 2, 3):
            m.save(step, {"w": torch.ones(4) * step}).result(30)
    target = tmp_path / "upload-status.json"
    if status == "fifo":
        os.mkfifo(target)
    else:
        json.loads(status)
        target.write_text(status)
    assert cli.main([command, str(tmp_path)]) == 0
    if command == "gc":
        assert "kept step 1 (upload not finished)" in capsys.readouterr().out
    assert _steps(tmp_path) == [1, 2, 3]


def test_retention_never_deletes_the_step_latest_names(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Resuming from an earlier step (a loss spike) and saving step 5 after step 20 with
    ``keep_last=1``: retention deleted step 5 right after its commit (the handle said it was
    saved), leaving ``latest`` naming a step that no longer existed. The step ``latest`` names is
    kept, by the manager and by ``ckpt gc``."""
    with CheckpointManager(tmp_path, keep_last=1) as m:
        for step in (10, 20, 5):
            m.save(step, {"w": torch.ones(3) * step}).result(30)
    assert (tmp_path / "latest").read_text() == "step-5\n"
    assert _steps(tmp_path) == [5, 20]
    assert cli.main(["gc", str(tmp_path)]) == 0
    assert "kept step 5 (named by latest" in capsys.readouterr().out
    assert _steps(tmp_path) == [5, 20]


def test_gc_dry_run_writes_nothing_into_a_directory(tmp_path: Path) -> None:
    """``ckpt gc --dry-run`` on a directory that ckpt never claimed created ``.lock`` in it."""
    import os

    (tmp_path / "step-1.tmp-1-abcdef12").mkdir()  # a leftover's name: ckpt's, nothing to lose
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1", "--dry-run"]) == 0
    assert os.listdir(tmp_path) == ["step-1.tmp-1-abcdef12"]


def test_gc_of_a_malformed_marker_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A ``.ckpt-owner.json`` that is a directory or another tool's JSON was a ``ValueError``
    traceback out of ``ckpt gc``; it is an error line naming the marker, and nothing is
    deleted."""
    _populate(tmp_path)
    marker = tmp_path / ".ckpt-owner.json"
    marker.unlink()
    marker.mkdir()
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 1
    assert ".ckpt-owner.json: the ownership marker is not a regular file" in capsys.readouterr().err
    assert _steps(tmp_path) == [10, 20, 30]
