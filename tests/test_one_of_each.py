"""One of each kind of helper (issue 17, docs/architecture.md "One of each"): a module-level
definition of these names (with or without a leading underscore) exists only in its home."""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

HOMES: dict[str, set[str]] = {
    "is_remote": {"feedpipe/io/remote.py"},
    "INDEX_NAME": {"feedpipe/format.py"},
    "scratch": {"feedpipe/datasets/_gather.py"},
    "inverse": {"feedpipe/datasets/_gather.py"},
    "ROW_COPY_MIN": {"feedpipe/datasets/_gather.py"},
    "progress": {"feedpipe/io/progress.py"},
    "NullBar": {"feedpipe/io/progress.py"},
    "atomic_write": {"feedpipe/io/fsutil.py"},
    # ckpt's adds only the fault-injection point of its crash tests (checked below)
    "fsync_dir": {"feedpipe/io/fsutil.py", "ckpt/saving/commit.py"},
    # issue 26, item 5
    "is_url": {"feedpipe/io/remote.py"},
    "is_s3_url": {"feedpipe/io/remote.py"},
    "read_exactly": {"feedpipe/io/fsutil.py"},
    "readinto_exactly": {"feedpipe/io/fsutil.py"},
    "add_storage_arguments": {"feedpipe/io/cliargs.py"},
    "storage_options": {"feedpipe/io/cliargs.py"},
    "env_flag": {"feedpipe/io/env.py"},
    "pid_alive": {"feedpipe/io/reaper.py"},
    "libcuda": {"feedpipe/io/cuda.py"},
    "format_bytes": {"feedpipe/io/cliargs.py"},
    "is_writer_file": {"feedpipe/io/destination.py"},
}

# issue 26, item 5: what each helper's body spells, found outside its home = a copy came back.
# (pattern, the home allowed to spell it)
SPELLINGS: dict[str, tuple[str, set[str]]] = {
    "URL detection": (r'"://"\s+(not\s+)?in\b', {"feedpipe/io/remote.py"}),
    "S3 URL detection": (r'"s3://",\s*"s3a://"', {"feedpipe/io/remote.py"}),
    "read exactly": (r"os\.preadv?\([^\n]*(\bgot\b|\+ len\(data\))", {"feedpipe/io/fsutil.py"}),
    "--endpoint-url": (r'"--endpoint-url"', {"feedpipe/io/cliargs.py"}),
    "endpoint storage option": (r'\{"endpoint_url":', {"feedpipe/io/cliargs.py"}),
    "boolean env words": (r'"false",\s*"no",\s*"off"', {"feedpipe/io/env.py"}),
    "env truthiness": (
        r"if\s+(not\s+)?os\.environ\.get\([^)]*\)\s*:|return\s+not\s+os\.environ\.get",
        set(),  # env_flag reads no variable by truthiness
    ),
    "pid alive": (r"os\.kill\([^,]+,\s*0\)", {"feedpipe/io/reaper.py"}),
    "libcuda loading": (r'CDLL\("libcuda', {"feedpipe/io/cuda.py"}),
    "byte formatting": (r'\("B",\s*"KiB"', {"feedpipe/io/cliargs.py"}),
}


def _definitions(path: Path) -> set[str]:
    """Module-level functions, classes and assigned names, leading underscores stripped."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n.lstrip("_") for n in names}


def test_each_helper_is_defined_only_in_its_home() -> None:
    found: dict[str, set[str]] = {name: set() for name in HOMES}
    for path in sorted([*ROOT.glob("feedpipe/**/*.py"), *ROOT.glob("ckpt/**/*.py")]):
        for name in _definitions(path) & set(HOMES):
            found[name].add(str(path.relative_to(ROOT)))
    assert found == HOMES


@pytest.mark.parametrize("what", sorted(SPELLINGS))
def test_each_helper_body_is_spelled_only_in_its_home(what: str) -> None:
    pattern, homes = SPELLINGS[what]
    found = {
        str(path.relative_to(ROOT))
        for path in sorted([*ROOT.glob("feedpipe/**/*.py"), *ROOT.glob("ckpt/**/*.py")])
        if re.search(pattern, path.read_text())
    }
    assert found <= homes, f"{what}: a copy outside {sorted(homes)}: {sorted(found - homes)}"
    assert found or not homes, f"{what}: the pattern no longer finds its home (update it too)"


def test_ckpt_fsync_dir_delegates_to_feedpipe_io() -> None:
    """ckpt's ``fsync_dir`` opens and syncs nothing itself: one error rule for both packages."""
    tree = ast.parse((ROOT / "ckpt" / "saving" / "commit.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fsync_dir"]
    calls = {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    assert "io_fsync_dir" in calls
    assert not {"os.open", "os.fsync", "os.close"} & calls


def test_gather_helpers() -> None:
    import threading

    from feedpipe.datasets._gather import inverse, scratch

    order = np.random.default_rng(0).permutation(50)
    inv = inverse(order)
    assert (inv[order] == np.arange(50)).all() and (order[inv] == np.arange(50)).all()
    tls = threading.local()
    a = scratch(tls, np.empty((4, 8), np.float32))
    b = scratch(tls, np.empty((2, 3), np.int64))  # smaller: the same memory, reshaped
    assert a.shape == (4, 8) and b.shape == (2, 3) and b.dtype == np.int64
    assert np.shares_memory(a, b)
    c = scratch(tls, np.empty((100, 8), np.uint8))  # larger: a new buffer
    assert c.shape == (100, 8) and not np.shares_memory(a, c)


# ------------------------------------------------------------------ issue 26, item 5 helpers


def test_url_helpers() -> None:
    from feedpipe.io import is_remote, is_s3_url, is_url

    assert is_url("s3://b/x") and is_url("file:///x") and not is_url("/data/x")
    assert is_s3_url("s3://b/x") and is_s3_url("s3a://b/x") and not is_s3_url("gs://b/x")
    assert is_remote("gs://b/x") and not is_remote("file:///x") and not is_remote("x")


def test_read_exactly_goes_on_after_short_reads_and_stops_at_the_end(tmp_path: Path) -> None:
    from feedpipe.io import read_exactly, readinto_exactly

    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_exactly(fd, 10, 5) == bytes(range(5, 15))
        assert read_exactly(fd, 10, 95) == bytes(range(95, 100))  # the end: fewer
        a, b = bytearray(3), bytearray(4)
        assert readinto_exactly(fd, [a, b], 10, 7) == 7
        assert bytes(a + b) == bytes(range(10, 17))
        c = np.zeros(8, np.uint8)
        assert readinto_exactly(fd, [c], 96, 8) == 4
        assert readinto_exactly(fd, [c], 0, 0) == 0
    finally:
        os.close(fd)


def test_read_exactly_joins_short_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A pread that returns fewer bytes than asked (a signal, a network filesystem) is not the
    end: the helpers ask again for the rest."""
    from feedpipe.io import fsutil

    path = tmp_path / "f"
    path.write_bytes(bytes(range(64)))
    real_pread, real_preadv = os.pread, os.preadv

    def pread(fd: int, n: int, off: int) -> bytes:
        return real_pread(fd, min(n, 3), off)

    def preadv(fd: int, bufs: list[bytearray | memoryview], off: int) -> int:
        return real_preadv(fd, [memoryview(bufs[0]).cast("B")[:3]], off)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fsutil.read_exactly(fd, 20, 1) == bytes(range(1, 21))
        out = bytearray(10)
        assert fsutil.readinto_exactly(fd, [out], 2, 10) == 10 and out == bytes(range(2, 12))
    finally:
        os.close(fd)


def test_storage_argument_group() -> None:
    from feedpipe.io.cliargs import add_storage_arguments, storage_options

    p = argparse.ArgumentParser()
    add_storage_arguments(p, anon=True)
    assert storage_options(p.parse_args([])) == {}
    args = p.parse_args(["--endpoint-url", "http://h:9000", "--anon"])
    assert storage_options(args) == {
        "client_kwargs": {"endpoint_url": "http://h:9000"},
        "anon": True,
    }
    q = argparse.ArgumentParser()
    add_storage_arguments(q)
    assert "--anon" not in q.format_help()


@pytest.mark.parametrize("word", ["0", "false", "No", " OFF ", ""])
def test_env_flag_false_words(word: str) -> None:
    from feedpipe.io.env import env_flag

    assert env_flag("X", environ={"X": word}) is False
    assert env_flag("X", True, environ={"X": word}) is False


@pytest.mark.parametrize("word", ["1", "true", "Yes", " on "])
def test_env_flag_true_words(word: str) -> None:
    from feedpipe.io.env import env_flag

    assert env_flag("X", environ={"X": word}) is True


def test_env_flag_unset_other_and_strict() -> None:
    from feedpipe.io.env import env_flag

    assert env_flag("X", environ={}) is False and env_flag("X", None, environ={}) is None
    assert env_flag("X", None, environ={"X": "auto"}) is None
    with pytest.raises(ValueError, match="X='': expected one of"):
        env_flag("X", True, strict=True, environ={"X": ""})


def test_feedpipe_debug_0_does_not_reraise(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FEEDPIPE_DEBUG=0`` is off (it used to turn debugging on: any non-empty value did)."""
    from feedpipe import cli

    monkeypatch.setenv("FEEDPIPE_DEBUG", "0")
    assert cli.main(["inspect", "/nonexistent/feedpipe-dataset"]) == 1
    monkeypatch.setenv("FEEDPIPE_DEBUG", "1")
    with pytest.raises(Exception):  # noqa: B017 - whatever inspect raises, re-raised
        cli.main(["inspect", "/nonexistent/feedpipe-dataset"])


def test_pid_alive() -> None:
    from feedpipe.io.reaper import pid_alive

    assert pid_alive(os.getpid()) and pid_alive(os.getpid(), same_user=True)
    assert not pid_alive(2**22 + 12345)  # above pid_max's default: no such process
    if os.getuid() != 0 and os.path.exists("/proc/1/stat"):
        assert pid_alive(1) and not pid_alive(1, same_user=True)  # init: another user's


def test_format_bytes() -> None:
    from feedpipe.io.cliargs import format_bytes

    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 40) == "3.0 TiB"
    assert format_bytes(3 << 40, "GiB") == "3072.0 GiB"


def test_libcuda_is_loaded_once_or_raises_oserror() -> None:
    from feedpipe.io.cuda import libcuda

    try:
        lib = libcuda()
    except OSError:
        return  # no driver here
    assert libcuda() is lib
