"""``ShardFile``: one file of a shard being written, under a temporary name, with its CRC32C."""

from __future__ import annotations

import os
import uuid
from typing import Any

from feedpipe.datasets.shard_names import TMP_MARK
from feedpipe.format import FileInfo
from feedpipe.io.crc import crc32c, to_hex

__all__ = ["ShardFile"]


class ShardFile:
    """A file being written under a temp name, with its running CRC32C and size."""

    def __init__(self, directory: str, relpath: str) -> None:
        self.relpath = relpath
        self.final = os.path.join(directory, relpath)
        self.tmp = os.path.join(directory, f".{relpath}{TMP_MARK}{uuid.uuid4().hex[:8]}")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish()/abort()
        self.crc = 0
        self.size = 0

    def write(self, buf: Any) -> None:
        mv = memoryview(buf).cast("B")
        self.f.write(mv)
        self.crc = crc32c(mv, self.crc)
        self.size += mv.nbytes

    def finish(self) -> FileInfo:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.final)
        return FileInfo(self.relpath, self.size, to_hex(self.crc))

    def abort(self) -> None:
        self.f.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
