"""One-off helpers: ``ckpt.save(path, state)`` and ``ckpt.load(path)`` (synchronous, same format,
same commit protocol: a temporary sibling directory renamed into place)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpt import _layout, _owner
from ckpt import format as fmt
from ckpt._paths import local_path
from ckpt.errors import CheckpointError
from ckpt.restoring.reader import MapLocation, read_checkpoint
from ckpt.saving import commit
from ckpt.saving.flatten import Leaf, flatten
from ckpt.saving.plan import SavePlan
from ckpt.saving.pool import Buffer
from feedpipe.io.reaper import pid_alive

__all__ = ["load", "save"]

_REMOTE_HINT = "for remote storage use CheckpointManager('/local/dir', remote=URL)"


def save(
    path: str | os.PathLike[str], state: Any, *, metadata: dict[str, Any] | None = None
) -> Path:
    """Write ``state`` to the checkpoint directory ``path`` and return it once durable.

    An existing checkpoint (or an empty directory) at ``path`` is replaced; any other file or
    directory there is a ``CheckpointError`` and stays untouched. A crash at any instant leaves
    the old or the new checkpoint reachable at ``path`` (an atomic exchange where the filesystem
    has it; otherwise the next ``save``/``load`` of ``path`` puts the old copy back).
    """
    path = local_path(path, "ckpt.save", _REMOTE_HINT)
    path.parent.mkdir(parents=True, exist_ok=True)
    _settle(path)
    _check_replaceable(path)
    leaves: list[Leaf] = []
    tree = flatten(state, leaves)
    plan = SavePlan(leaves)  # the layout and the copies, as a manager's save plans them
    entries, nbytes = plan.entries, plan.nbytes
    buf = Buffer(nbytes, pin=False)
    plan.stage(leaves, buf)
    tmp = path.with_name(_layout.tmp_name(path.name))
    tmp.mkdir()
    try:
        rec = fmt.write_file(tmp / _layout.DATA_FILE, buf.view())
        body = fmt.new_manifest(
            step=None, nbytes=nbytes, tree=tree, entries=entries, files=[rec], metadata=metadata
        )
        fmt.write_manifest(tmp, body)
        commit.fsync_dir(tmp)
        retired = path.with_name(_layout.del_name(path.name))
        commit.replace_dir(tmp, path, retired)
    except BaseException:
        commit.remove_path(tmp)  # the new copy, or after the exchange the old one
        raise
    return path


def _check_replaceable(path: Path) -> None:
    """Refuse to replace anything at ``path`` but a checkpoint or an empty directory."""
    if os.path.islink(path):
        raise CheckpointError(f"{path}: is a symlink; ckpt.save never replaces one")
    if not os.path.lexists(path):
        return
    if _owner.is_ckpt_dir(path) and (commit.is_complete(path) or not os.listdir(path)):
        # a ckpt.save never leaves PATH holding data files without a manifest (it is complete
        # at every instant): such a directory (a user's data.bin) is not ckpt's to replace
        return
    raise CheckpointError(
        f"{path}: exists and is not a checkpoint directory that ckpt wrote; ckpt.save replaces "
        "only such a checkpoint or an empty directory (choose another path, or remove it "
        "yourself)"
    )


def _settle(path: Path, tmps: bool = True) -> None:
    """Recover from an earlier save of ``path`` that crashed: put a complete retired copy back
    when ``path`` is missing, delete retired copies once ``path`` is complete, and (``tmps``)
    delete the temporary directories of saves whose process is gone."""
    try:
        names = os.listdir(path.parent)
    except FileNotFoundError:
        return
    retired = [path.parent / n for n in names if _layout.is_retired(n, path.name)]
    if retired:
        commit.settle(path, retired)
    for n in names if tmps else ():
        pid = _layout.tmp_pid(n, path.name)
        tmp = path.parent / n
        if pid is not None and not pid_alive(pid) and _owner.is_ckpt_dir(tmp, scratch=True):
            commit.remove_path(tmp)  # a dead save's temp that holds only ckpt files


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    mmap: bool = False,
    verify: bool = True,
) -> Any:
    """Load the checkpoint directory ``path`` (verified unless ``verify=False``)."""
    path = local_path(path, "ckpt.load", _REMOTE_HINT)
    if not os.path.lexists(path):
        _settle(path, tmps=False)  # a save of ``path`` may have crashed between its two renames
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    state, _, _ = read_checkpoint(path, map_location=map_location, mmap=mmap, verify=verify)
    return state
