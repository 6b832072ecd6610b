"""The ``ckpt ls|verify|gc DIR`` command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import cli
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions, read_status
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


@pytest.mark.usefixtures("_keep_handlers")
@pytest.mark.parametrize("spec", ["loss:0:min", "loss:\u00b2:min", "loss:-1:max"])
def test_gc_bad_keep_best_names_the_flag(tmp_path, capsys, spec: str) -> None:  # type: ignore[no-untyped-def]
    """``--keep-best loss:0:min`` was refused as 'KeepBest.k ...', and a Unicode digit ('²',
    which ``str.isdigit`` accepts) as 'invalid literal for int()': neither named the flag."""
    from ckpt import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["gc", str(tmp_path), "--keep-best", spec])
    assert exited.value.code == 2
    assert "--keep-best" in capsys.readouterr().err


def test_cli_url_with_credentials_prints_one_redacted_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A URL whose credentials make the client raise a non-OSError (botocore's
    ParamValidationError) printed a traceback holding the secret."""
    for argv in (
        ["ls", "s3://AKIAEXAMPLE:TOPSECRET@bucket/run", "--endpoint-url", "http://127.0.0.1:9"],
        ["verify", "memory://user:TOPSECRET@host/none"],
        ["gc", "s3://user:TOPSECRET@bucket/run"],
        ["ls", "file://user:TOPSECRET@localhost/nonexistent"],
    ):
        rc = cli.main(argv)
        out = capsys.readouterr()
        text = out.out + out.err
        assert rc != 0, argv
        assert "TOPSECRET" not in text, (argv, text)
        assert "Traceback" not in text


def _populate_with_metadata(root: Path, steps: tuple[int, ...] = (10, 20, 30), **kw: Any) -> None:
    with CheckpointManager(root, keep_last=None, **kw) as m:
        for step in steps:
            m.save(step, {"w": torch.ones(1000) * step, "step": step}, metadata={"s": step})
        m.wait()


def _unrestorable(step_dir: Path) -> None:
    """Make a step whose manifest and data CRCs are valid but whose tree cannot be rebuilt."""
    body = fmt.read_manifest(step_dir)
    body["tree"] = {"t": "dict", "items": [["w", {"t": "tensor", "i": 99}]]}
    fmt.write_manifest(step_dir, body)


# ---- 4: gc uses the manager's retention rule, with the same guards ------------------------------
def test_gc_keep_last_counts_only_restorable_steps(tmp_path: Path, capsys: Any) -> None:
    _populate_with_metadata(tmp_path)
    _unrestorable(tmp_path / "step-30")
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept step 20 (newest valid checkpoint)" in out
    assert "kept step 30 (not restorable" in out and "deleted step 10" in out
    assert commit.steps(tmp_path) == [20, 30]


def test_manager_retention_counts_only_restorable_steps(tmp_path: Path) -> None:
    _populate_with_metadata(tmp_path)
    _unrestorable(tmp_path / "step-30")
    with CheckpointManager(tmp_path, keep_last=1) as m:
        assert m.gc() == [10]  # the same rule as `ckpt gc`: step 20 replaces the bad step 30
        assert m.steps() == [20, 30]


def test_gc_keeps_steps_whose_upload_is_pending(
    tmp_path: Path, s3_bucket: tuple[str, dict], capsys: Any
) -> None:
    pytest.importorskip("s3fs")
    bucket, opts = s3_bucket
    missing = RemoteOptions(f"s3://{bucket}-missing/run", storage_options=opts, deadline_s=2)
    with CheckpointManager(tmp_path, keep_last=None, remote=missing) as m:
        for step in (10, 20, 30):
            m.save(step, {"w": torch.ones(10) * step})
        with pytest.raises(CheckpointError, match="upload of step 10"):
            m.wait(uploads=True)
    assert {s: st["state"] for s, st in read_status(tmp_path).items()} == {
        10: "failed",
        20: "failed",
        30: "failed",
    }
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept step 10 (upload not finished)" in out and "deleted" not in out
    assert commit.steps(tmp_path) == [10, 20, 30]
    # once uploaded (a manager with the right bucket reconciles), gc may delete them
    good = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, deadline_s=10)
    with CheckpointManager(tmp_path, keep_last=None, remote=good) as m:
        m.wait(uploads=True)
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert commit.steps(tmp_path) == [30]
    status = json.loads((tmp_path / "upload-status.json").read_text())
    assert status["steps"]["30"]["state"] == "done"


# ---- 13: the CLI reads what ckpt writes ----------------------------------------------------
def test_ls_and_verify_a_single_checkpoint_directory(tmp_path: Path, capsys: Any) -> None:
    import ckpt

    one = ckpt.save(tmp_path / "model.ckpt", {"w": torch.ones(10)}, metadata={"epoch": 3})
    assert cli.main(["ls", str(one)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {one}" in out and '{"epoch": 3}' in out
    assert cli.main(["verify", str(one)]) == 0
    assert f"{one}: OK" in capsys.readouterr().out
    _unrestorable(one)
    assert cli.main(["verify", str(one)]) == 1
    assert f"{one}: FAILED" in capsys.readouterr().out


def test_ls_and_verify_a_lightning_checkpoint(tmp_path: Path, capsys: Any) -> None:
    lightning = pytest.importorskip("ckpt.integrations.lightning")
    io = lightning.CkptCheckpointIO(async_save=False)
    path = tmp_path / "epoch=0-step=100.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 100}, path)
    assert cli.main(["verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["ls", str(path)]) == 0
    assert "ckpt.integrations.lightning" in capsys.readouterr().out


def test_ls_shows_metadata_and_manager_metadata(tmp_path: Path, capsys: Any) -> None:
    _populate_with_metadata(tmp_path)
    with CheckpointManager(tmp_path) as m:
        assert m.metadata(20) == {"s": 20}
    assert cli.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[0] == "20" and lines[2].endswith('{"s": 20}')


def test_bad_steps_exit_nonzero_without_traceback(tmp_path: Path, capsys: Any) -> None:
    _populate_with_metadata(tmp_path)
    manifest = tmp_path / "step-20" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()  # a manifest replaced by a directory
    _unrestorable(tmp_path / "step-30")
    assert cli.main(["ls", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "BAD:" in out.out and "Traceback" not in out.out + out.err
    assert cli.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith("step 10: OK")
    assert lines[1].startswith("step 20: FAILED") and lines[2].startswith("step 30: FAILED")
    assert "Traceback" not in out.out + out.err


def test_read_only_directory_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    import os

    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    _populate_with_metadata(tmp_path / "run")
    (tmp_path / "run" / ".lock").unlink()
    (tmp_path / "run").chmod(0o555)
    try:
        assert cli.main(["ls", str(tmp_path / "run")]) == 0
        assert cli.main(["verify", str(tmp_path / "run")]) == 0
        assert cli.main(["gc", str(tmp_path / "run"), "--keep-last", "1"]) == 1
        err = capsys.readouterr().err
        assert "ckpt:" in err and "Permission denied" in err and "Traceback" not in err
    finally:
        (tmp_path / "run").chmod(0o755)


def test_ls_and_verify_a_remote_url(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, capsys: Any
) -> None:
    pytest.importorskip("s3fs")
    bucket, opts = s3_bucket
    remote = RemoteOptions(f"s3://{bucket}/run", storage_options=opts, deadline_s=10)
    _populate_with_metadata(tmp_path, (1, 2), remote=remote)
    url, endpoint = f"s3://{bucket}/run", ["--endpoint-url", s3_server]
    assert cli.main(["ls", url, *endpoint]) == 0
    out = capsys.readouterr().out
    assert f"committed ({url}/step-2)" in out and '{"s": 2}' in out
    assert cli.main(["verify", url, *endpoint]) == 0
    assert capsys.readouterr().out.count(": OK: ok (") == 2
    assert cli.main(["verify", f"{url}/step-1", *endpoint]) == 0  # one remote checkpoint
    assert f"{url}/step-1: OK" in capsys.readouterr().out
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.pipe_file(f"{bucket}/run/step-2/data.bin", b"garbage")
    assert cli.main(["verify", url, *endpoint]) == 1
    out = capsys.readouterr().out
    assert f"step 2: FAILED: {url}/step-2/data.bin" in out  # the URL, not s3:/... nor a temp dir
    assert cli.main(["verify", url, "--step", "7", *endpoint]) == 1
    assert f"{url}/step-7: no manifest" in capsys.readouterr().out


def test_os_errors_are_messages_not_tracebacks(tmp_path: Path, capsys: Any) -> None:
    _populate_with_metadata(tmp_path)
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()  # the writer lock cannot be opened
    assert cli.main(["gc", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ckpt: ") and ".lock" in err and "Traceback" not in err


def _gc_steps(root: Path, *flags: str) -> tuple[int, list[int]]:
    from ckpt import cli
    from ckpt.saving import commit

    rc = cli.main(["gc", str(root), *flags])
    return rc, sorted(commit.steps(root))


@pytest.fixture
def ten_steps(tmp_path: Path) -> Path:
    from ckpt import CheckpointManager

    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=None) as m:
        for step in range(0, 10):
            m.save(step, {"w": torch.full((2,), float(step))})
    return root


def test_gc_keep_last_none_turns_the_count_limit_off(
    ten_steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpt import _layout

    leftover = ten_steps / _layout.tmp_name(_layout.step_name(10), "x")
    leftover.mkdir()
    for flag in ("none", "NONE", " None "):
        assert _gc_steps(ten_steps, "--keep-last", flag) == (0, list(range(10)))
    assert not leftover.exists()  # leftovers still go
    out = capsys.readouterr().out
    assert "deleted" not in out and "removed leftover" in out
    # with another flag, that flag alone decides (plus the newest restorable step)
    assert _gc_steps(ten_steps, "--keep-last", "none", "--keep-every", "4") == (0, [0, 4, 8, 9])
    # without flags: the manager's recorded policy (keep_last=None keeps every step), never a
    # default of gc's own (issue 25 item 2; this asserted "the default is still 3")
    assert _gc_steps(ten_steps) == (0, [0, 4, 8, 9])
    assert _gc_steps(ten_steps, "--keep-last", "2") == (0, [8, 9])


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", "", "nan"])
def test_gc_keep_last_refuses_garbage(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpt import cli

    with pytest.raises(SystemExit) as err:
        cli.main(["gc", str(tmp_path), "--keep-last", bad])
    assert err.value.code == 2
    assert "--keep-last" in capsys.readouterr().err
