"""Whether a memory tier's directory is this user's own: the check before any read or write.

The tier lives in a directory every user of the node may write (``/dev/shm``) under a name
anyone can compute (``ckpt.tiers.memory_options.tier_dir``). Another user could create it first:
a directory of theirs holding a valid, CRC-checked step that ``restore()`` would load, or a
symlink to any directory, whose steps a save would write into and ``close()`` or ``ckpt gc``
would delete. So the tier is created private (mode ``0o700``), and before it is read, written or
freed it must be a real directory (no symlink), owned by this process's user and writable by
no one else, in a root that others cannot write or that has the sticky bit (as ``/dev/shm``: no
one may rename another user's entry there); otherwise ``CheckpointError`` names it, its owner
and mode, and nothing is touched.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpt.errors import CheckpointError

__all__ = ["check_tier", "make_tier"]


def _refuse(directory: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"memory tier {directory}: {why}; ckpt neither reads, writes nor deletes it (another "
        "user may have created it to feed or take this run's checkpoints): remove it, or give "
        "MemoryOptions(root=...) a directory of your own"
    )


def check_tier(directory: Path) -> bool:
    """Whether the tier ``directory`` exists (``False``: nothing there); ``CheckpointError``
    if something is there that is not a private directory of this user (module docstring)."""
    try:
        st, up = os.lstat(directory), os.stat(directory.parent)
    except FileNotFoundError:
        return False
    if up.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not up.st_mode & stat.S_ISVTX:
        raise _refuse(
            directory,
            f"its root {directory.parent} is writable by other users without the sticky bit "
            f"(mode {stat.S_IMODE(up.st_mode):o}): anyone may replace the tier there",
        )
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(directory, f"is a symlink (to {os.readlink(directory)!r})")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(directory, "is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(directory, f"is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(directory, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")
    return True


def make_tier(directory: Path) -> None:
    """Create the tier ``directory`` private to this user (mode ``0o700``) if it is missing,
    then check it (``check_tier``); a tier of this user's that others may read is made private."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    check_tier(directory)
    if stat.S_IMODE(os.lstat(directory).st_mode) != 0o700:
        os.chmod(directory, 0o700, follow_symlinks=False)
