"""The feedpipe CLI prints no tracebacks, reads URLs where its help says so, draws no progress bar
into a pipe, never prints a secret of a URL, and refuses numbers that mean nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import run_cli as _cli

from feedpipe.datasets.writer import MemmapWriter
from feedpipe.io.progress import NullBar, progress


def _one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _dataset(root: Path, n: int = 64, shard_bytes: int = 1 << 20) -> Path:
    with MemmapWriter(root, shape=(4,), dtype="float32", shard_bytes=shard_bytes) as w:
        w.append_batch(np.arange(n * 4, dtype=np.float32).reshape(n, 4))
    return root


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from feedpipe.cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("command", ["inspect", "bench"])
def test_unknown_scheme_and_non_dataset_are_one_line_errors(
    tmp_path: Path,
    command: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    extra = ["--workers", "0", "--batches", "2"] if command == "bench" else []
    rc, _, err = _main(capsys, command, "s4://bucket/ds", *extra)
    _one_line(rc, err, "s4://bucket/ds", "'s4'")
    (tmp_path / "notes").mkdir()
    rc, _, err = _main(capsys, command, "notes", *extra)
    _one_line(rc, err, "notes", "not a feedpipe dataset")
    rc, _, err = _main(capsys, command, "missing", *extra)
    _one_line(rc, err, "missing")


def test_unknown_scheme_from_the_console_script(tmp_path: Path) -> None:
    _one_line_error(_cli("inspect", "s4://bucket/ds", cwd=tmp_path), "s4://bucket/ds")


def test_credentials_in_a_url_are_not_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _main(capsys, "inspect", "s4://user:hunter2secret@host/ds")
    _one_line(rc, err)
    assert "hunter2secret" not in out + err


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    import fcntl

    _dataset(tmp_path / "ds", n=200, shard_bytes=16)  # 200 shard rows: more than the pipe holds
    proc = subprocess.Popen(
        [sys.executable, "-m", "feedpipe.cli", "inspect", "ds", "--shards", "1000"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    fcntl.fcntl(proc.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ: a one-page pipe
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert first.startswith(b"dataset")
    assert "BrokenPipeError" not in err and "Traceback" not in err, err


def test_inspect_and_bench_read_s3_with_endpoint_url(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    import fsspec

    bucket, opts = s3_bucket
    local = _dataset(tmp_path / "ds")
    fs = fsspec.filesystem("s3", **opts)
    for f in sorted(local.iterdir(), key=lambda p: p.name == "index.json"):
        fs.put_file(str(f), f"{bucket}/ds/{f.name}")
    url, endpoint = f"s3://{bucket}/ds", opts["client_kwargs"]["endpoint_url"]
    rc, out, err = _main(capsys, "inspect", url, "--endpoint-url", endpoint, "--verify")
    assert rc == 0, err
    assert "records   64" in out and "verify: all 1 files match" in out
    before = set(os.listdir(tempfile.gettempdir()))
    args = ("--workers", "0,1", "--batches", "2", "--warmup", "1", "--batch-size", "8")
    rc, out, err = _main(capsys, "bench", url, "--endpoint-url", endpoint, *args)
    assert rc == 0, err
    assert "w=0" in out and "w=1" in out and err == ""
    after = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("feedpipe-bench-")}
    assert after <= before  # the temporary shard cache is gone


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    res = _cli(
        "bench",
        "--synthetic",
        "--workers",
        "0",
        "--batches",
        "3",
        "--warmup",
        "1",
        "--batch-size",
        "4",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == "", res.stderr  # no bar, no carriage returns
    np.save(tmp_path / "x.npy", np.zeros((8, 2), np.float32))
    res = _cli("convert", "x.npy", "out", "--workers", "1", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "MiB" in res.stdout and "MB/s" not in res.stdout
    res = _cli("stage", "out", "staged", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # stage's byte bar too
    assert "MiB/s" in res.stdout and "MB/s" not in res.stdout.replace("MiB/s", ""), res.stdout


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_helper_draws_only_on_a_terminal_in_binary_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(progress(10, "x"), NullBar)
    term = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = progress(8 << 20, "x")
    assert not isinstance(bar, NullBar)
    bar.update(3 << 20)
    bar.close()
    drawn = term.getvalue()
    assert "iB/s" in drawn and "MB/s" not in drawn and "kB/s" not in drawn, drawn
    assert isinstance(progress(10, "x", enabled=False), NullBar)


# ------------------------------------------------------------------ issue 25 item 16
_KEY, _SECRET = "AKIAKEYID12345678", "SUPERSECRETvalue42"


_URL = f"s3://{_KEY}:{_SECRET}@bucket/ds"


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", _URL],
        ["inspect", _URL, "--verify"],
        ["convert", "x.npy", _URL, "--no-progress"],
        ["convert", "x.npy", _URL, "--no-progress", "--fn", "json:loads"],
        ["stage", _URL, "dst", "--no-progress"],
        ["bench", _URL, "--workers", "0", "--batches", "2"],
        ["inspect", "ds", _URL],  # argparse's own error quotes the stray argument
        ["ckpt", "ls", _URL],
    ],
    ids=lambda a: "-".join(x for x in a if not x.startswith(("s3:", "--"))),
)
def test_no_command_prints_the_secret_of_a_url(
    tmp_path: Path,
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore quotes "KEY:SECRET@bucket" (no scheme) in its 'Invalid bucket name' message."""
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    if argv[0] == "ckpt":
        from ckpt.cli import main as ckpt_main

        run, argv = ckpt_main, argv[1:]
    else:
        from feedpipe.cli import main as run
    try:
        rc = run(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc != 0 and "Traceback" not in err, err
    for secret in (_KEY, _SECRET):
        assert secret not in out + err, out + err


# ------------------------------------------------------------------ issue 25 item 10
@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["convert", "x.npy", "out", "--workers", "0"], "--workers"),
        (["convert", "x.npy", "out", "--workers", "-1"], "--workers"),
        (["convert", "x.npy", "out", "--shard-size", "inf"], "--shard-size"),
        (["convert", "x.npy", "out", "--shard-size", "nan"], "--shard-size"),
        (["convert", "x.npy", "out", "--shard-size", "0"], "--shard-size"),
        (["convert", "x.npy", "out", "--shard-size", "lots"], "--shard-size"),
        (["convert", "x.npy", "out", "--fn", "m:f", "--inputs-per-part", "0"], "--inputs-per-part"),
        (["inspect", "ds", "--shards", "-1"], "--shards"),
        (["stage", "src", "dst", "--workers", "0"], "--workers"),
        (["bench", "--synthetic", "--batch-size", "0"], "--batch-size"),
        (["bench", "--synthetic", "--step-ms", "nan"], "--step-ms"),
        (["bench", "--synthetic", "--step-ms", "inf"], "--step-ms"),
        (["bench", "--synthetic", "--step-ms", "1e308"], "--step-ms"),
        (["bench", "--synthetic", "--step-ms", "-5"], "--step-ms"),
        (["bench", "--synthetic", "--sample-delay-ms", "inf"], "--sample-delay-ms"),
        (["bench", "--synthetic", "--sample-delay-ms", "nan"], "--sample-delay-ms"),
        (["bench", "--synthetic", "--batches", "-1"], "--batches"),
    ],
)
def test_numbers_that_mean_nothing_are_argparse_errors(
    tmp_path: Path,
    argv: list[str],
    option: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from feedpipe.cli import main

    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"error: argument {option}: " in err.strip().splitlines()[-1], err
    assert sorted(os.listdir(tmp_path)) == ["x.npy"]


def test_byte_sizes_in_every_unit() -> None:
    from feedpipe.io.cliargs import byte_size

    assert byte_size("256MiB") == 256 << 20
    assert byte_size("64k") == 64 << 10
    assert byte_size("1.5G") == 3 << 29
    assert byte_size("2TB") == 2 << 40
    assert byte_size("4096") == 4096


def test_bench_plot_checks_for_matplotlib_before_the_sweep(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 item 15: the check came after minutes of measuring."""
    from feedpipe.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = main(["bench", "--synthetic", "--workers", "0", "--batches", "2", "--plot", "p.png"])
    out, err = capsys.readouterr()
    _one_line(rc, err, "matplotlib", "feedpipe[bench]")
    assert out == ""  # no sweep, no table: the old check came after them


def test_an_existing_dataset_is_refused_naming_the_cli_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the CLI said "(pass overwrite=True)", the Python argument, where its flag is --overwrite
    import pickle

    import feedpipe
    from feedpipe.errors import DatasetError

    np.save(tmp_path / "a.npy", np.arange(8, dtype=np.int64))
    src, dest = str(tmp_path / "a.npy"), str(tmp_path / "out")
    assert _main(capsys, "convert", src, dest, "--no-progress")[0] == 0
    rc, _, err = _main(capsys, "convert", src, dest, "--no-progress")
    _one_line(rc, err, dest, "already exists", "--overwrite")
    assert "overwrite=True" not in err
    assert _main(capsys, "convert", src, dest, "--no-progress", "--overwrite")[0] == 0
    with pytest.raises(DatasetError, match=r"already exists here \(pass overwrite=True\)") as info:
        feedpipe.convert(src, dest, progress_bar=False)  # the Python API names its argument
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
