"""Exceptions raised by ckpt. Every message names the directory, step or file at fault."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpointError", "DcpCheckpointError", "LockedError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed, found or restored."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: bad manifest, missing/short file or bad checksum."""


class LockedError(CheckpointError):
    """Another writer (manager or ``ckpt gc``) holds the directory's writer lock."""


class DcpCheckpointError(CheckpointError):
    """The step was written through ``ckpt.dcp``: load it with ``dcp.load`` and
    ``CkptStorageReader``, not with ``restore``/``ckpt.load`` (never a reason to fall back)."""
