"""Exceptions raised by ckpt. Every message names the directory, step or file at fault."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "DcpCheckpointError",
    "LockedError",
    "RemoteCheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed, found or restored."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: bad manifest, missing/short file or bad checksum."""


class LockedError(CheckpointError):
    """Another writer (manager or ``ckpt gc``) holds the directory's writer lock."""


class RemoteCheckpointError(CheckpointError):
    """A transfer to or from the remote tier failed: ``permanent`` (a missing or forbidden
    object, bad credentials) or transient errors that outlived their retries. ``url`` is the
    object's URL with credentials redacted, as in the message."""

    def __init__(self, message: str, url: str = "", *, permanent: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.permanent = permanent

    def __reduce__(self) -> tuple[Any, ...]:  # keeps url and permanent across processes
        return (type(self), (str(self), self.url), {"permanent": self.permanent})


class DcpCheckpointError(CheckpointError):
    """The step was written through ``ckpt.dcp``: load it with ``dcp.load`` and
    ``CkptStorageReader``, not with ``restore``/``ckpt.load`` (never a reason to fall back)."""
