"""Attack: the thread workers' exit hook (feedpipe.loader.threads: every worker thread still
running is stopped and joined at interpreter exit) in a child forked (``os.fork``, a child that
then exits the ordinary way and so runs ``atexit``) while a worker thread of the parent held
the hook's lock: the child's exit must not wait for a thread that does not exist there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import os, select, sys, threading, warnings
import numpy as np
import feedpipe
from feedpipe.loader import threads

root = sys.argv[1]
with feedpipe.MemmapWriter(root, shape=(4,), dtype="int32") as w:
    w.append_batch(np.arange(64 * 4, dtype=np.int32).reshape(64, 4))
ds = feedpipe.MemmapDataset(root)
loader = feedpipe.DataLoader(ds, batch_size=8, num_workers=2, worker_type="thread")
assert sum(len(b) for b in loader) == 64  # thread workers ran: the exit hook is in place
got, release = threading.Event(), threading.Event()

def hold():  # a worker thread ending (or starting) at the fork holds this lock
    with threads._RUNNING_LOCK:
        got.set()
        release.wait(60)

threading.Thread(target=hold, daemon=True).start()
assert got.wait(30)
warnings.simplefilter("ignore", DeprecationWarning)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child ends the ordinary way: its atexit hooks run
release.set()
fd = os.pidfd_open(pid)
if not select.select([fd], [], [], 30)[0]:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("hang")
else:
    _, status = os.waitpid(pid, 0)
    print("exit", os.waitstatus_to_exitcode(status))
"""


def test_forked_child_exits_while_a_parent_worker_thread_held_the_exit_hooks_lock(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "ds")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exit 0", f"the child's exit: {out.stdout!r} {out.stderr[-2000:]}"
