"""``WritingShard``: the shard a ``MemmapWriter`` is writing, the one owner of "the open shard".

A shard is open from its first record until it is finished or aborted, whatever the layout holds:
a records file, variable-length field files, or only fixed-size field columns (kept in memory
and written when the shard is finished). Its size, the bytes counted against the writer's
``shard_bytes``, is that of the files it streams (records, variable-length fields); a shard that
streams none (no records column, only fixed-size fields) counts its fixed-size columns instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from feedpipe.datasets._shard_file import ShardFile
from feedpipe.datasets.shard_names import shard_name
from feedpipe.format import VARIABLE_KINDS, FieldSpec, FileInfo, Layout, Shard

__all__ = ["WritingShard"]


class WritingShard:
    """One shard being written: its streamed files, offsets, fixed-size columns and records."""

    def __init__(
        self, directory: str, sid: int, layout: Layout, fields: Mapping[str, FieldSpec]
    ) -> None:
        self.directory, self.sid, self.layout = directory, sid, layout
        self.fields = dict(fields)
        var = [n for n, f in self.fields.items() if f.kind in VARIABLE_KINDS]
        self.data = ShardFile(directory, shard_name(sid, "data")) if layout.kind != "none" else None
        self.offsets = [0]
        self.columns: dict[str, list[np.ndarray]] = {
            n: [] for n, f in self.fields.items() if f.kind not in VARIABLE_KINDS
        }
        self.var_files = {n: ShardFile(directory, shard_name(sid, n)) for n in var}
        self.var_offsets = {n: [0] for n in var}
        self.records = 0
        self._streams = self.data is not None or bool(self.var_files)
        self._column_bytes = 0

    @property
    def size(self) -> int:
        """Bytes counted against the shard size (see the module docstring)."""
        if not self._streams:
            return self._column_bytes
        size = self.data.size if self.data is not None else 0
        return size + sum(f.size for f in self.var_files.values())

    def size_with(self, streamed: int, columns: int) -> int:
        """The size once records of ``streamed`` bytes of files and ``columns`` bytes of
        fixed-size columns are added."""
        return self.size + (streamed if self._streams else columns)

    def write(
        self, buf: Any, n: int, cols: Mapping[str, np.ndarray], var: Mapping[str, np.ndarray]
    ) -> None:
        """Add ``n`` records: their records bytes, fixed-size columns and (one record)
        variable-length field values."""
        if self.data is not None:
            self.data.write(buf)
            if self.layout.has_offsets:
                self.offsets.append(self.data.size)
        for name, value in var.items():
            f = self.var_files[name]
            f.write(value)
            self.var_offsets[name].append(f.size)
        for name, col in cols.items():
            self.columns[name].append(col)
            self._column_bytes += col.nbytes
        self.records += n

    def finish(self) -> Shard:
        """Complete every file of the shard (renamed into place); the shard as indexed."""
        files: dict[str, FileInfo] = {}
        if self.data is not None:
            files["data"] = self.data.finish()
        pending: list[tuple[str, str, np.ndarray]] = []
        if self.layout.has_offsets:
            pending.append(("offsets", "offsets", np.asarray(self.offsets, dtype="<u8")))
        for name, f in self.var_files.items():
            files[f"field.{name}"] = f.finish()
            offsets = np.asarray(self.var_offsets[name], dtype="<u8")
            pending.append((f"field.{name}.offsets", f"{name}.offsets", offsets))
        for name, parts in self.columns.items():
            spec = self.fields[name]
            col = np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)
            pending.append((f"field.{name}", name, col))
        for role, suffix, arr in pending:
            f = ShardFile(self.directory, shard_name(self.sid, suffix))
            try:
                f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
                files[role] = f.finish()
            except BaseException:
                f.abort()
                raise
        return Shard(self.records, files)

    def abort(self) -> None:
        """Discard the shard's streamed files (nothing of it is left)."""
        if self.data is not None:
            self.data.abort()
        for f in self.var_files.values():
            f.abort()
