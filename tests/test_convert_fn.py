"""feedpipe.convert(fn, inputs, output=...): a user function over inputs in a process pool.

Deterministic output whatever the worker count, S3 output through the moto server, a real
SIGKILL in the middle of a run followed by a rerun with identical output, progress with an ETA,
the ``--fn package.module:function`` CLI, and errors that name the input.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import feedpipe
from feedpipe import MemmapDataset
from feedpipe.datasets._convert_sink import STATE_DIR
from feedpipe.datasets.convert_fn import load_function
from feedpipe.errors import DatasetError

sys.path.insert(0, str(Path(__file__).parent))
import _convert_fns as fns  # the worker functions live in an importable module
from _helpers import tree_bytes as _files
from _procs import key_lines, run_python

ROOT = Path(__file__).resolve().parent.parent


def _convert(fn: Any, out: Any, n: int = 60, **kw: Any) -> Any:
    kw.setdefault("progress_bar", False)
    kw.setdefault("inputs_per_part", 4)
    kw.setdefault("shard_bytes", 256)
    return feedpipe.convert(fn, list(range(n)), output=str(out), **kw)


def test_same_bytes_whatever_the_worker_count(tmp_path: Path) -> None:
    one = _convert(fns.tokens, tmp_path / "one", n=32, num_workers=1)
    three = _convert(fns.tokens, tmp_path / "three", n=32, num_workers=3)
    assert one.records == three.records == sum(i % 5 for i in range(32))
    assert one.shards == three.shards > 8  # several shards per part, several parts
    assert _files(tmp_path / "one") == _files(tmp_path / "three")  # index.json included
    ds = feedpipe.MemmapDataset(tmp_path / "three")
    want = [r for i in range(32) for r in fns.tokens(i)]
    assert len(ds) == len(want)
    for k in (0, 1, len(want) // 2, len(want) - 1):
        assert np.array_equal(ds[k]["data"].numpy(), want[k]["data"])
        assert int(ds[k]["doc"]) == want[k]["doc"]


def test_the_existing_call_forms_still_work(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.int32).reshape(6, 2))
    feedpipe.convert(str(tmp_path / "x.npy"), str(tmp_path / "npy"), progress_bar=False)
    assert len(feedpipe.MemmapDataset(tmp_path / "npy")) == 6
    with pytest.raises(TypeError, match="dest"):
        feedpipe.convert(str(tmp_path / "x.npy"))
    # bytes records, and a workers= spelling that maps to num_workers
    result = feedpipe.convert(fns.blobs, range(9), output=str(tmp_path / "b"), workers=2)
    ds = feedpipe.MemmapDataset(tmp_path / "b")
    assert result.records == len(ds) == 18
    assert bytes(ds[5].numpy()) == fns.blobs(2)[1]


def test_s3_output_is_the_local_bytes(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    bucket, opts = s3_bucket
    local = _convert(fns.tokens, tmp_path / "local", n=8, num_workers=1, shard_bytes=1024)
    url = f"s3://{bucket}/ds"
    remote = _convert(fns.tokens, url, n=8, num_workers=2, shard_bytes=1024, storage_options=opts)
    assert (remote.records, remote.shards) == (local.records, local.shards)
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/ds"))
    assert STATE_DIR not in names  # the conversion's state is gone once index.json is there
    want = _files(tmp_path / "local")
    assert names == sorted(want)
    for name, data in want.items():
        assert fs.cat_file(f"{bucket}/ds/{name}") == data, name
    ds = feedpipe.MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "cache")
    assert len(ds) == local.records


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.05)


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "feedpipe.cli", "convert", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the kill takes the workers too
    )


def test_sigkill_mid_run_then_rerun_gives_identical_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEEDPIPE_TEST_SLEEP", "0")
    dest = tmp_path / "ds"
    state = Path(f"{dest}.partial") / STATE_DIR
    items = [str(i) for i in range(80)]
    args = ["--fn", "_convert_fns:slow_tokens", *items, str(dest), "--workers", "2",
            "--inputs-per-part", "4", "--shard-size", "256", "--no-progress"]  # fmt: skip
    proc = _cli(args, {"FEEDPIPE_TEST_SLEEP": "0.05"})
    try:
        _wait_for(lambda: len(list(state.glob("part-*.json"))) >= 3, 30, "3 parts done")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    done = len(list(state.glob("part-*.json")))
    assert 3 <= done < 20, "killed too late to test anything"
    assert not (dest / "index.json").exists() and not dest.exists()
    rerun = _cli(args)  # the same command
    out, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err.decode()
    assert "parts resumed" in out.decode()
    clean = _convert(fns.slow_tokens, tmp_path / "clean", n=80, num_workers=1)
    assert clean.records == feedpipe.MemmapDataset(dest).__len__()
    assert _files(dest) == _files(tmp_path / "clean")
    assert not Path(f"{dest}.partial").exists()


@pytest.mark.slow
def test_sigkill_mid_upload_to_s3_then_rerun(
    tmp_path: Path, s3_server: str, s3_bucket: tuple[str, dict[str, Any]], monkeypatch: Any
) -> None:
    monkeypatch.setenv("FEEDPIPE_TEST_SLEEP", "0")
    bucket, opts = s3_bucket
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    url = f"s3://{bucket}/ds"
    items = [str(i) for i in range(48)]
    args = ["--fn", "_convert_fns:slow_tokens", *items, url, "--workers", "2",
            "--inputs-per-part", "4", "--shard-size", "256", "--no-progress",
            "--endpoint-url", s3_server]  # fmt: skip

    def manifests() -> int:
        fs.invalidate_cache()
        return len(fs.glob(f"{bucket}/ds/{STATE_DIR}/part-*.json"))

    proc = _cli(args, {"FEEDPIPE_TEST_SLEEP": "0.1"})
    try:
        _wait_for(lambda: manifests() >= 2, 40, "2 parts uploaded")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    fs.invalidate_cache()
    uploaded = [p for p in fs.ls(f"{bucket}/ds") if p.rsplit("/", 1)[1].startswith("shard-")]
    assert uploaded, "shards are uploaded as their part completes"
    assert not fs.exists(f"{bucket}/ds/index.json")  # index.json goes last
    rerun = _cli(args)
    out, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err.decode()
    assert "parts resumed" in out.decode()
    clean = _convert(fns.slow_tokens, tmp_path / "clean", n=len(items), num_workers=1)
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/ds"))
    want = _files(tmp_path / "clean")
    assert names == sorted(want)
    for name, data in want.items():
        assert fs.cat_file(f"{bucket}/ds/{name}") == data, name
    assert clean.records > 0


def test_progress_shows_inputs_and_eta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _convert(fns.tokens, tmp_path / "p", n=20, num_workers=1, progress_bar=True)
    err = capsys.readouterr().err
    assert "20/20" in err and "input" in err
    assert "<00:00" in err  # tqdm's elapsed<remaining: the ETA


def test_cli_takes_a_dotted_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from feedpipe.cli import main

    argv = ["convert", "--fn", "_convert_fns.blobs", "1", "2", "3", str(tmp_path / "d")]
    assert main([*argv, "--no-progress"]) == 0
    assert "6 records" in capsys.readouterr().out
    assert bytes(feedpipe.MemmapDataset(tmp_path / "d")[0].numpy()) == fns.blobs(1)[0]
    assert main(["convert", "--fn", "_convert_fns:nope", "1", str(tmp_path / "e")]) == 1
    assert "'_convert_fns' has no 'nope'" in capsys.readouterr().err
    assert main(["convert", "--fn", "no_such_module_x:f", "1", str(tmp_path / "e")]) == 1
    assert "cannot import 'no_such_module_x'" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_cli_fn_imports_a_module_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 item 15: as ``python -m`` does (the console script's sys.path lacks the cwd)."""
    from feedpipe.cli import main

    (tmp_path / "cwd_fns_25.py").write_text(
        "import numpy as np\n\ndef f(x):\n    return np.full(2, int(x), np.int64)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_fns_25", raising=False)
    assert main(["convert", "--fn", "cwd_fns_25:f", "1", "2", "3", "out", "--no-progress"]) == 0
    assert feedpipe.MemmapDataset(tmp_path / "out")[2].tolist() == [3, 3]
    sys.modules.pop("cwd_fns_25", None)


def test_a_failing_input_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"fails_on_13 failed on input 13 \(13\): ValueError"):
        _convert(fns.fails_on_13, tmp_path / "f", n=20, num_workers=2)
    assert not (tmp_path / "f").exists()


def test_a_worker_that_dies_is_named_with_its_function_and_input(tmp_path: Path) -> None:
    """Issue 25 item 15: not a bare BrokenProcessPool."""
    with pytest.raises(DatasetError, match=r"dies_on_7: a worker process died .*input 7 \(7\)"):
        _convert(fns.dies_on_7, tmp_path / "d", n=12, num_workers=2)
    assert not (tmp_path / "d").exists()


def test_a_dying_worker_is_named_alone_not_with_the_workers_the_pool_ended(
    tmp_path: Path,
) -> None:
    """The pool ends its other workers when one dies (SIGTERM): the error named their inputs
    too ("input 3 or input 0 or input 1"), as if they had died as well."""
    with pytest.raises(DatasetError) as info:
        _convert(fns.dies_on_3_others_slow, tmp_path / "d", n=4, num_workers=4, inputs_per_part=1)
    assert "converting input 3 (3); nothing" in str(info.value), info.value


def test_records_that_change_layout_are_refused_naming_the_inputs(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"inputs 8\.\. give records of float32 \[5\]"):
        _convert(fns.shape_changes, tmp_path / "s", n=12, num_workers=2)
    with pytest.raises(DatasetError, match=r"input 8 \(8\).*float32 \(4,\)"):  # in one part
        _convert(fns.shape_changes, tmp_path / "s2", n=12, num_workers=1, inputs_per_part=12)


def test_no_records_and_no_inputs_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="produced no records"):
        feedpipe.convert(fns.tokens, [0, 5, 10], output=str(tmp_path / "n"), progress_bar=False)
    with pytest.raises(DatasetError, match="inputs is empty"):
        feedpipe.convert(fns.tokens, [], output=str(tmp_path / "m"))


def test_a_foreign_folder_is_not_written_into(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(DatasetError, match="did not write"):
        _convert(fns.tokens, tmp_path / "mine", n=8)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def _failed_run(dest: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run whose function fails at input 8: parts 0 and 1 are committed, part 2 is not."""
    monkeypatch.setenv("FEEDPIPE_TEST_FAIL_AT", "8")
    with pytest.raises(DatasetError, match="input 8"):
        _convert(fns.fails_from_env, dest, n=16, num_workers=1)
    monkeypatch.delenv("FEEDPIPE_TEST_FAIL_AT")
    state = Path(f"{dest}.partial") / STATE_DIR
    assert sorted(p.name for p in state.glob("part-*.json")) == [
        "part-00000.json",
        "part-00001.json",
    ]
    return state


def test_rerun_after_a_failing_function_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failed_run(tmp_path / "ds", monkeypatch)
    result = _convert(fns.fails_from_env, tmp_path / "ds", n=16, num_workers=2)
    assert result.resumed_parts == 2
    _convert(fns.fails_from_env, tmp_path / "clean", n=16, num_workers=1)
    assert _files(tmp_path / "ds") == _files(tmp_path / "clean")


def test_hostile_or_damaged_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _failed_run(tmp_path / "ds", monkeypatch)
    (state / "part-00000.json").write_text("{not json")  # damaged: that part is redone
    doc = (state / "part-00001.json").read_text()
    # valid JSON and CRCs, but naming part 0's file as part 1's
    (state / "part-00001.json").write_text(doc.replace("shard-100000", "shard-00000"))
    with pytest.raises(DatasetError, match="part 1: manifest lists a foreign file shard-00000"):
        _convert(fns.fails_from_env, tmp_path / "ds", n=16, num_workers=1)
    assert not (tmp_path / "ds").exists()
    escape = doc.replace("shard-100000.data", "../../outside.data")
    (state / "part-00001.json").write_text(escape)  # refused by the index parser: redone
    result = _convert(fns.fails_from_env, tmp_path / "ds", n=16, num_workers=1)
    assert result.resumed_parts == 3  # 0, 2 and 3 from the refused run; part 1 again
    _convert(fns.fails_from_env, tmp_path / "clean", n=16, num_workers=1)
    assert _files(tmp_path / "ds") == _files(tmp_path / "clean")


def test_a_symlinked_partial_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", f"{tmp_path / 'ds'}.partial")
    with pytest.raises(DatasetError, match="symlink"):
        _convert(fns.tokens, tmp_path / "ds", n=8)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_an_existing_dataset_is_replaced_only_with_overwrite(tmp_path: Path) -> None:
    _convert(fns.blobs, tmp_path / "ds", n=6)
    with pytest.raises(DatasetError, match="already exists"):
        _convert(fns.tokens, tmp_path / "ds", n=6)
    assert len(feedpipe.MemmapDataset(tmp_path / "ds")) == 12  # untouched
    _convert(fns.tokens, tmp_path / "ds", n=6, overwrite=True)
    assert len(feedpipe.MemmapDataset(tmp_path / "ds")) == sum(i % 5 for i in range(6))


def test_another_plan_starts_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failed_run(tmp_path / "ds", monkeypatch)
    result = _convert(fns.fails_from_env, tmp_path / "ds", n=16, num_workers=1, inputs_per_part=8)
    assert result.resumed_parts == 0
    _convert(fns.fails_from_env, tmp_path / "clean", n=16, num_workers=1, inputs_per_part=8)
    assert _files(tmp_path / "ds") == _files(tmp_path / "clean")


_HUNG_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}]
import feedpipe
import _convert_fns as fns
from _procs import alive, descendants

try:
    feedpipe.convert(fns.hangs_on_0_fails_on_1, [0, 1], output={out!r}, num_workers=2,
                     inputs_per_part=1)
except Exception as exc:
    print("RAISED", type(exc).__name__, flush=True)
print("AFTER", *alive(descendants()), flush=True)
"""


def test_a_hung_fn_is_ended_when_another_input_fails(tmp_path: Path) -> None:
    """One worker hangs in fn, another fails: convert raises (it used to wait forever for the
    hung one), and no worker outlives it or the interpreter."""
    tests = str(Path(__file__).parent)
    script = tmp_path / "hung.py"
    script.write_text(_HUNG_SCRIPT.format(tests=tests, out=str(tmp_path / "out")))
    proc = run_python(script, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = key_lines(proc.stdout)
    assert "RAISED" in lines, proc.stdout + proc.stderr[-2000:]  # the failed input, named
    assert lines["AFTER"] == "", proc.stdout


def test_workers_end_when_only_the_owner_is_sigkilled(tmp_path: Path) -> None:
    """Found: the OOM killer takes the main process alone; its pool workers ran on as orphans
    (and could still be writing parts while the user reran the command)."""
    from _procs import alive, descendants, wait_gone

    dest = tmp_path / "ds"
    state = Path(f"{dest}.partial") / STATE_DIR
    items = [str(i) for i in range(400)]
    args = ["--fn", "_convert_fns:slow_tokens", *items, str(dest), "--workers", "2",
            "--inputs-per-part", "4", "--shard-size", "256", "--no-progress"]  # fmt: skip
    proc = _cli(args, {"FEEDPIPE_TEST_SLEEP": "0.05"})
    workers: list[int] = []
    try:
        _wait_for(lambda: len(list(state.glob("part-*.json"))) >= 1, 30, "a part done")
        workers = list(descendants(proc.pid))
        assert len(workers) == 2
        proc.kill()  # the main process only, not its group
        proc.wait(10)
        assert wait_gone(workers, 5.0) == []
    finally:
        for pid in alive(workers):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ====================================================================== convert(fn, ...)
def _scalar(item: int) -> Any:
    """A numpy scalar (0-d record) for even inputs, a Python int for odd ones."""
    return np.int64(item) if item % 2 == 0 else int(item)


def _yields_none(item: int) -> Any:
    yield np.zeros(2, np.int64)
    yield None


def _yields_str(item: int) -> Any:
    yield "text"


def _exits(item: int) -> Any:
    if item == 3:
        sys.exit(3)
    return np.zeros(2, np.int64)


def test_convert_unpicklable_fn_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A lambda or closure with worker processes failed inside the pool with "Can't pickle
    local object", after the output's state folder was created."""
    k = 3
    for fn in (lambda x: np.full(2, x), lambda x: np.full(2, k)):
        out = tmp_path / "ds"
        with pytest.raises(ValueError, match=r"cannot be sent to worker processes.*num_workers=1"):
            feedpipe.convert(fn, range(8), output=str(out), num_workers=2, inputs_per_part=2)
        assert not out.exists() and not Path(f"{out}.partial").exists()
    done = feedpipe.convert(  # in this process, a closure is fine
        lambda x: np.full(2, k), range(8), output=str(tmp_path / "one"), num_workers=1
    )
    assert done.records == 8


def test_convert_dotted_path_errors_are_value_errors() -> None:
    """A relative module name raised TypeError from importlib, not the documented ValueError."""
    for spec in (".:x", "..x", ".mod:f"):
        with pytest.raises(ValueError, match="cannot import"):
            load_function(spec)
    for spec in ("os:sep", "no_such_module_attackl:f", "os:path.no_such_attr"):
        with pytest.raises(ValueError, match=re.escape(spec)):
            load_function(spec)


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_records_scalars_none_str_and_exit(tmp_path: Path, workers: int) -> None:
    """A scalar record (numpy or Python) raised "object is not iterable"; a yielded None or str
    gave a dtype error naming a temporary folder; sys.exit() in fn ended the whole command."""
    kw: dict[str, Any] = {"num_workers": workers, "inputs_per_part": 2, "progress_bar": False}
    res = feedpipe.convert(_scalar, range(6), output=str(tmp_path / "s"), **kw)
    assert res.records == 6
    assert [int(x) for x in feedpipe.MemmapDataset(tmp_path / "s")] == list(range(6))
    for fn, match in (
        (_yields_none, r"_yields_none on input \d \(\d\): a None record"),
        (_yields_str, r"_yields_str on input \d \(\d\): a str record"),
        (_exits, r"_exits failed on input 3 \(3\): SystemExit: 3"),
    ):
        with pytest.raises(DatasetError, match=match):
            feedpipe.convert(fn, range(6), output=str(tmp_path / fn.__name__), **kw)


def _rows(item: int) -> list[np.ndarray]:
    return [np.full(4, item * 10 + j, np.int32) for j in range(item % 3)]


_CONVERT_KW: dict[str, Any] = {"inputs_per_part": 4, "shard_bytes": 64, "progress_bar": False}


def _convert_then_die_at_state_removal(dest: str) -> None:
    """In a forked child: convert, SIGKILLed just after the final rename (at the state's
    removal)."""
    from feedpipe.datasets import _convert_sink

    real = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(STATE_DIR):
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, *args, **kwargs)

    _convert_sink.shutil.rmtree = rmtree  # type: ignore[assignment]
    feedpipe.convert(_rows, range(16), output=dest, num_workers=1, **_CONVERT_KW)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_convert_killed_after_the_final_rename_reruns_to_the_same_bytes(tmp_path: Path) -> None:
    """SIGKILL between renaming ``OUTPUT.partial`` to ``OUTPUT`` and removing the state in it:
    the rerun of the same call said "a dataset already exists here" and the output kept a
    stray ``.feedpipe-convert/``. Now the rerun finishes it: the uninterrupted run's bytes."""
    import multiprocessing as mp

    dest = tmp_path / "ds"
    child = mp.get_context("fork").Process(
        target=_convert_then_die_at_state_removal, args=(str(dest),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert (dest / "index.json").exists() and (dest / STATE_DIR / "plan.json").exists()
    again = feedpipe.convert(_rows, range(16), output=str(dest), num_workers=1, **_CONVERT_KW)
    clean = feedpipe.convert(_rows, range(16), output=str(tmp_path / "clean"), **_CONVERT_KW)
    assert _tree(dest) == _tree(tmp_path / "clean")
    assert (again.records, again.shards, again.resumed_parts) == (clean.records, clean.shards, 4)
    with pytest.raises(DatasetError, match="already exists"):  # finished: a second rerun
        feedpipe.convert(_rows, range(16), output=str(dest), **_CONVERT_KW)
    other = feedpipe.convert(_rows, range(16), output=str(dest), overwrite=True, **_CONVERT_KW)
    assert other.resumed_parts == 0 and _tree(dest) == _tree(tmp_path / "clean")


@pytest.mark.parametrize("per", [0, -1, 2.5, True])
def test_convert_inputs_per_part_must_be_a_positive_int(tmp_path: Path, per: Any) -> None:
    """inputs_per_part=0 silently meant "the default"; 2.5 failed inside range()."""
    with pytest.raises(ValueError, match="inputs_per_part must be >= 1"):
        feedpipe.convert(_scalar, range(4), output=str(tmp_path / "x"), inputs_per_part=per)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


@pytest.mark.slow
def test_convert_sigkill_at_random_moments_then_rerun_gives_the_same_bytes(tmp_path: Path) -> None:
    """The real CLI process group SIGKILLed at seeded random moments of a run (parts, shard
    moves, manifests, index, rename, exit); the rerun of the same command gives the bytes of an
    uninterrupted run. A kill after the run finished leaves the finished dataset (a rerun then
    says it exists, as for any finished conversion)."""
    import random
    import subprocess
    import time

    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": f"{here.parent}{os.pathsep}{here}",
        "FEEDPIPE_TEST_SLEEP": "0",
    }
    items = [str(i) for i in range(24)]

    def cli(dest: Path) -> subprocess.Popen[bytes]:
        args = ["--fn", "_convert_fns:slow_tokens", *items, str(dest), "--workers", "2",
                "--inputs-per-part", "3", "--shard-size", "256", "--no-progress"]  # fmt: skip
        return subprocess.Popen(
            [sys.executable, "-m", "feedpipe.cli", "convert", *args], cwd=here.parent, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip

    t0 = time.monotonic()
    clean = cli(tmp_path / "clean")
    assert clean.wait(120) == 0
    took = time.monotonic() - t0
    want = _tree(tmp_path / "clean")
    rng = random.Random(20261201)
    for k in range(6):
        dest = tmp_path / f"d{k}"
        proc = cli(dest)
        time.sleep(rng.uniform(0.2, 1.0) * took)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        rerun = cli(dest)
        _out, err = rerun.communicate(timeout=120)
        if rerun.returncode != 0:  # only when the killed run had finished
            assert b"a dataset already exists here" in err, err.decode()
        assert _tree(dest) == want, f"kill {k}"
        assert not Path(f"{dest}.partial").exists()


def _rows_unless(marker: str, item: int) -> list[np.ndarray]:
    """``_rows``, failing on inputs >= 8 while the file ``marker`` exists."""
    if item >= 8 and os.path.exists(marker):
        raise RuntimeError("injected failure")
    return _rows(item)


@pytest.mark.slow
def test_convert_to_s3_failed_run_is_no_dataset_and_overwrite_leaves_nothing_stale(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """Through the S3 server: a run that fails half way leaves no index.json (no reader can
    open half a dataset); the rerun resumes to the local bytes; an overwrite by a conversion
    with fewer shards leaves none of the old ones behind."""
    import functools

    import s3fs

    bucket, opts = s3_bucket
    fs = s3fs.S3FileSystem(**opts)
    url = f"s3://{bucket}/ds"
    marker = tmp_path / "fail"
    marker.touch()
    fn = functools.partial(_rows_unless, str(marker))
    kw = {**_CONVERT_KW, "storage_options": opts, "num_workers": 2}
    with pytest.raises(DatasetError, match="injected failure"):
        feedpipe.convert(fn, range(16), output=url, **kw)
    fs.invalidate_cache()
    assert fs.ls(f"{bucket}/ds") and not fs.exists(f"{bucket}/ds/index.json")
    with pytest.raises((DatasetError, FileNotFoundError)):
        MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "c0")
    marker.unlink()
    resumed = feedpipe.convert(fn, range(16), output=url, **kw)
    assert resumed.resumed_parts == 2
    feedpipe.convert(fn, range(16), output=str(tmp_path / "clean"), **_CONVERT_KW)

    def remote_tree() -> dict[str, bytes]:
        fs.invalidate_cache()
        return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.ls(f"{bucket}/ds")}

    assert remote_tree() == _tree(tmp_path / "clean")
    with pytest.raises(DatasetError, match="exists"):
        feedpipe.convert(_rows, range(4), output=url, **kw)
    feedpipe.convert(_rows, range(4), output=url, overwrite=True, **kw)
    feedpipe.convert(_rows, range(4), output=str(tmp_path / "small"), **_CONVERT_KW)
    assert remote_tree() == _tree(tmp_path / "small")
    ds = MemmapDataset(url, storage_options=opts, cache_dir=tmp_path / "c1")
    assert [int(x[0]) for x in ds] == [int(r[0]) for i in range(4) for r in _rows(i)]


def _rows_times(k: int, item: int) -> list[np.ndarray]:
    return [r * k for r in _rows(item)]


def test_convert_rerun_with_other_partial_arguments_starts_over(tmp_path: Path) -> None:
    """The plan's fingerprint took a partial's name ("functools:partial") and no code or
    arguments: a run of partial(f, 1) interrupted, then partial(f, 2) (or of another function)
    "resumed" the parts of the first, a silently mixed dataset."""
    import functools

    marker = tmp_path / "fail"
    marker.touch()
    first = functools.partial(_rows_unless, str(marker))
    with pytest.raises(DatasetError, match="partial\\(test_convert_fn:_rows_unless\\)"):
        feedpipe.convert(first, range(16), output=str(tmp_path / "ds"), **_CONVERT_KW)
    second = functools.partial(_rows_times, 2)
    res = feedpipe.convert(second, range(16), output=str(tmp_path / "ds"), **_CONVERT_KW)
    assert res.resumed_parts == 0
    feedpipe.convert(second, range(16), output=str(tmp_path / "clean"), **_CONVERT_KW)
    assert _tree(tmp_path / "ds") == _tree(tmp_path / "clean")
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["source"]["fn"] == "partial(test_convert_fn:_rows_times)"
    marker.touch()  # the same partial, other arguments
    with pytest.raises(DatasetError):
        feedpipe.convert(functools.partial(_rows_unless, str(marker)), range(16),
                         output=str(tmp_path / "p"), **_CONVERT_KW)  # fmt: skip
    other = functools.partial(_rows_unless, str(tmp_path / "no-such-marker"))
    res = feedpipe.convert(other, range(16), output=str(tmp_path / "p"), **_CONVERT_KW)
    assert res.resumed_parts == 0


@pytest.mark.parametrize("bad", [-1, -4, 1.5, True, "2"])
def test_a_negative_worker_count_or_not_a_whole_number_is_refused(
    tmp_path: Path, bad: Any
) -> None:
    # num_workers=-1 was taken as 1 without a word (0 is torch's "in this process": see below)
    with pytest.raises(ValueError, match=rf"num_workers must be a whole number >= 0.*{bad!r}"):
        feedpipe.convert(fns.tokens, range(4), output=tmp_path / "a", num_workers=bad)
    with pytest.raises(ValueError, match=rf"num_workers must be a whole number >= 0.*{bad!r}"):
        feedpipe.convert(fns.tokens, range(4), output=tmp_path / "b", workers=bad)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    src = tmp_path / "x.npy"
    np.save(src, np.arange(4))
    with pytest.raises(ValueError, match=rf"workers must be a whole number >= 0.*{bad!r}"):
        feedpipe.convert(src, tmp_path / "c", workers=bad)
    assert not (tmp_path / "c").exists()


def test_zero_workers_converts_in_this_process(tmp_path: Path) -> None:
    """num_workers=0 is torch's idiom for "no worker processes": the same bytes as 1 worker."""
    a = feedpipe.convert(fns.tokens, range(4), output=tmp_path / "a", num_workers=0)
    b = feedpipe.convert(fns.tokens, range(4), output=tmp_path / "b", num_workers=1)
    assert a.records == b.records > 0
    for f in sorted(p.name for p in (tmp_path / "b").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
