"""Processes and /dev/shm entries a test leaves behind (a /proc walk; psutil is not a test
dependency). Used by tests/conftest.py's leftover check and by the hung-worker tests."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "HELPERS",
    "alive",
    "descendants",
    "describe",
    "proc_listing",
    "shm_entries",
    "wait_gone",
]

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
