"""The shared I/O layer: CRC32C, remote access (resolve, retry, classify, redact), temp names,
directory fsync, atomic writes and exact reads, boolean environment variables.

Standard library, fsspec and crc32c only: no torch, no numpy, nothing else from feedpipe. It is
the only part of feedpipe that ckpt imports.
"""

from __future__ import annotations

from feedpipe.io.crc import crc32c, crc32c_file, to_hex
from feedpipe.io.env import env_flag
from feedpipe.io.fsutil import atomic_write, fsync_dir, read_exactly, readinto_exactly
from feedpipe.io.ownership import ForeignEntriesError, claim, owns
from feedpipe.io.remote import (
    DEFAULT_POLICY,
    TEMP_PREFIX,
    CancelledError,
    RemoteIOError,
    RetryPolicy,
    call,
    classify,
    is_remote,
    is_s3_url,
    is_temp,
    is_url,
    join,
    local_file_path,
    redact,
    resolve,
    temp_name,
    temp_target,
    within,
)

__all__ = [
    "DEFAULT_POLICY",
    "TEMP_PREFIX",
    "CancelledError",
    "ForeignEntriesError",
    "RemoteIOError",
    "RetryPolicy",
    "atomic_write",
    "call",
    "claim",
    "classify",
    "crc32c",
    "crc32c_file",
    "env_flag",
    "fsync_dir",
    "is_remote",
    "is_s3_url",
    "is_temp",
    "is_url",
    "join",
    "local_file_path",
    "owns",
    "read_exactly",
    "readinto_exactly",
    "redact",
    "resolve",
    "temp_name",
    "temp_target",
    "to_hex",
    "within",
]
