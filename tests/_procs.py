"""Processes and /dev/shm entries a test leaves behind (a /proc walk; psutil is not a test
dependency), used by tests/conftest.py's leftover check and by the hung-worker tests; and the
child-process harness of the kill tests: ``child_env``, ``python_child`` (a child that is
SIGKILLed and reaped on the way out), ``read_marker``, ``stop``, ``run_python``, ``run_cli``,
``key_lines``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "HELPERS",
    "alive",
    "child_env",
    "descendants",
    "describe",
    "key_lines",
    "proc_listing",
    "python_child",
    "read_marker",
    "run_cli",
    "run_python",
    "shm_entries",
    "stop",
    "wait_gone",
]

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# multiprocessing's own helper processes live as long as the process that started them
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# /dev/shm names of ours that carry the creating pid: feedpipe-<kind>-<pid>-..., torch_<pid>_...
_SHM_PID = re.compile(r"^(?:feedpipe-[a-z]+-|torch_)(\d+)[-_]")


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[1]), fields[0]


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def proc_listing() -> frozenset[str]:
    """The pids in /proc (cheap: a changed listing is what makes a full walk worth it)."""
    try:
        return frozenset(os.listdir("/proc"))
    except OSError:
        return frozenset()


def descendants(root: int | None = None, helpers: bool = False) -> dict[int, str]:
    """``{pid: state}`` of the live processes descended from ``root`` (default: this one);
    zombies included (state ``Z``), multiprocessing's helpers left out unless ``helpers`` (not
    the workers a forkserver forks, though they carry its command line)."""
    if not sys.platform.startswith("linux"):
        return {}
    root = os.getpid() if root is None else root
    parent: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parent[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in parent.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = parent[pid][1]
        todo.extend(children.get(pid, []))
    if not helpers:  # a helper's forked child (a forkserver's worker) shares its command line
        is_helper = {p: any(h in cmdline(p) for h in HELPERS) for p in out}
        for pid in [p for p, h in is_helper.items() if h and not is_helper.get(parent[p][0])]:
            del out[pid]
    return out


def alive(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that still exist and are not zombies."""
    out = []
    for pid in pids:
        st = _stat(pid)
        if st is not None and st[1] != "Z":
            out.append(pid)
    return out


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``pids`` to end; those still alive (not zombies)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def describe(pid: int) -> str:
    return f"pid {pid} ({cmdline(pid)[:120] or '?'})"


def shm_entries(pids: Iterable[int]) -> set[str]:
    """/dev/shm entries of ours created by one of ``pids`` (the pid is in their name)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return set()
    pids = set(pids)
    out = set()
    for name in names:
        m = _SHM_PID.match(name)
        if m and int(m.group(1)) in pids:
            out.add(name)
    return out


# --------------------------------------------------------------------- the kill harness
def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child interpreter, plus ``extra``: the parent's PYTHONPATH first
    (``PYTHONPATH=/other/checkout`` runs that code in the children too), then this checkout and
    tests/ (the tests' helper modules)."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT), str(TESTS)) if p
    )
    return env


@contextmanager
def python_child(
    *args: str, code: str | None = None, env: dict[str, str] | None = None, **popen: Any
) -> Iterator[subprocess.Popen[Any]]:
    """A child interpreter running ``code`` (``python -c code *args``) or a script
    (``python *args``), stdout piped as text unless ``popen`` says otherwise. On the way out a
    child still running is SIGKILLed; it is always reaped and its pipes closed (unread: a
    grandchild holding one open must not hold the test)."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("text", True)
    cmd = [sys.executable, *(["-c", code] if code is not None else []), *args]
    proc = subprocess.Popen(cmd, env=child_env() if env is None else env, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def read_marker(proc: subprocess.Popen[Any], marker: str) -> str:
    """The child's next line of stdout, which must start with ``marker`` (the child says it
    reached the point the test waits for)."""
    assert proc.stdout is not None, "start the child with stdout=subprocess.PIPE"
    line = str(proc.stdout.readline())
    assert line.startswith(marker), f"waited for {marker!r}, the child said {line!r}"
    return line


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL, timeout: float = 30) -> int:
    """Send ``sig`` to the child and wait for it; its exit status (``-sig`` when killed)."""
    proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def run_python(
    script: str | Path, *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a script file in a child interpreter (``child_env`` unless ``env``), capturing its
    output as text; its exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env() if env is None else env,
    )


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m feedpipe.cli *args`` in ``cwd`` (the environment plus ``env``), output
    captured as text, two minutes at most; its exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, "-m", "feedpipe.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def key_lines(stdout: str) -> dict[str, str]:
    """A child's report lines ``KEY rest of line`` as ``{KEY: rest}`` (the last of a key wins)."""
    return {k: v for k, _, v in (line.partition(" ") for line in stdout.splitlines())}
