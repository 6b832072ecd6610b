"""Exceptions raised by ckpt. Every message names the directory, step or file at fault."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpointError", "LockedError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed, found or restored."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: bad manifest, missing/short file or bad checksum."""


class LockedError(CheckpointError):
    """Another writer (manager or ``ckpt gc``) holds the directory's writer lock."""
