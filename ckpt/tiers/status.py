"""Upload status: one ``UploadStatus`` per step, the tier's ``RemoteStats``, and their mirror
``DIR/upload-status.json`` (``StatusMirror`` writes it, ``read_status`` reads it for ``ckpt ls``
and ``ckpt gc``). The mirror is informational: failing to write it never fails an upload, and it
is never written into a directory that is not ckpt's, nor over another tool's file."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpt import _layout, _owner
from ckpt.errors import CheckpointError
from ckpt.format import open_regular
from ckpt.saving import commit

__all__ = ["STATUS_FILE", "RemoteStats", "StatusMirror", "UploadStatus", "read_status"]

log = logging.getLogger("ckpt")

STATUS_FILE = _layout.STATUS_FILE


@dataclass
class UploadStatus:
    """One step's upload: ``state`` is pending, uploading, done or failed (with ``reason``)."""

    step: int
    state: str = "pending"
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class RemoteStats:
    """Upload counters and per-step status (``manager.stats.remote``)."""

    uploads: dict[int, UploadStatus] = field(default_factory=dict)
    uploaded_bytes: int = 0
    upload_s: float = 0.0
    failed: int = 0
    remote_evicted: list[int] = field(default_factory=list)
    partial_removed: list[int] = field(default_factory=list)


def read_status(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The upload status mirrored in ``DIR/upload-status.json`` (empty if none). Only a regular
    file is read (never a symlink; a FIFO never blocks); what is not ckpt's status (not JSON,
    nested too deeply, a step's entry that is not an object) reads as no upload finished."""
    path = Path(directory) / STATUS_FILE
    try:
        fd = open_regular(path)
    except (OSError, CheckpointError):
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read())
        return {int(k): v for k, v in doc.get("steps", {}).items() if isinstance(v, dict)}
    except (OSError, ValueError, RecursionError, AttributeError, TypeError):
        return {}


class StatusMirror:
    """Writes the upload status of ``directory`` to ``DIR/upload-status.json`` (atomically,
    through a temporary file that is never a symlink or a FIFO)."""

    def __init__(self, directory: Path, url: str) -> None:
        self.directory, self.url = directory, url
        self.target = directory / STATUS_FILE

    def _may_write(self) -> bool:
        """Never into a directory that is not ckpt's yet, nor over another tool's file."""
        try:
            return _owner.owned(self.directory) and not (
                os.path.lexists(self.target) and not _owner.is_ours(self.target)
            )
        except ValueError:  # a malformed marker: the writer refuses it (ckpt._owner)
            return False

    def write(self, uploads: Mapping[int, UploadStatus]) -> None:
        """Mirror ``uploads`` (a snapshot taken under the caller's lock)."""
        doc = {
            "url": self.url,
            "updated": time.time(),
            "steps": {str(s): asdict(st) for s, st in sorted(uploads.items())},
        }
        if not self._may_write():
            return
        tmp = self.directory / _layout.status_tmp_name()
        if self._write_tmp(tmp, json.dumps(doc)):
            try:
                os.replace(tmp, self.target)
            except OSError as exc:
                log.warning("ckpt: cannot write %s: %s", self.target, exc)
                commit.remove_path(tmp)

    def _write_tmp(self, tmp: Path, text: str) -> bool:
        """Write ``text`` to ``tmp``; ``False`` (logged) if it could not be written."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:  # never through a symlink planted under the temp's name, never blocked by a FIFO
            fd = os.open(tmp, flags, 0o644)
        except OSError as exc:
            log.warning("ckpt: cannot write %s (leaving %s alone): %s", self.target, tmp, exc)
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("ckpt: cannot write %s: %s is not a regular file", self.target, tmp)
                return False
            with os.fdopen(os.dup(fd), "w") as f:
                f.write(text)
        except OSError as exc:  # the status mirror is informational; never fail an upload for it
            log.warning("ckpt: cannot write %s: %s", self.target, exc)
            commit.remove_path(tmp)
            return False
        finally:
            os.close(fd)
        return True
