"""Typed columns and transforms of a :class:`~feedpipe.MemmapDataset` (a mixin).

The variable-length columns of :mod:`feedpipe.datasets.columns` (ragged arrays, ``str``,
``json``) are read from their mapped data files, one gather per column per shard of a batch;
each role's files are kept open per process like the records' (:mod:`._memmap_open`). The
transforms split a batch read in one gather into samples, transform them and collate them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from feedpipe.datasets._memmap_open import OpenShards
from feedpipe.datasets._ragged_batch import collate_ragged
from feedpipe.datasets.columns import Column, assemble, check_offsets, read_variable
from feedpipe.datasets.format import Index
from feedpipe.errors import DatasetError

__all__ = ["TypedColumns"]


class TypedColumns:
    """Reads of typed variable-length columns, ``read_span`` and the transforms."""

    index: Index
    cache_limit_bytes: int | None
    pad_value: Any
    transform: Callable[[Any], Any] | None
    fields: dict[str, Any]
    kind: str
    _remote: bool
    _len: int
    _open_lock: threading.RLock
    _role_files: dict[str, OpenShards]
    _col_offsets: dict[tuple[str, int], np.ndarray]
    _var_cols: dict[str, Column]
    ragged: str

    if TYPE_CHECKING:

        def _open_files(self) -> OpenShards: ...
        def _open_data(self, sid: int, role: str = "data") -> tuple[int, Any]: ...
        def _role_opener(self, role: str) -> OpenShards: ...
        def _read_whole(self, sid: int, role: str) -> bytes: ...
        def _local_path(self, shard_id: int, role: str) -> str: ...
        def _locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
        def _plan(self, shards: list[int]) -> list[int]: ...
        def _read(self, idx: np.ndarray, out: Any, mode: str) -> Any: ...

    def _open_role_files(self, role: str) -> OpenShards:
        """This process's open files of one role (``data``, or a variable-length field's)."""
        if role == "data":
            return self._open_files()
        self._open_files()  # resets the roles' files after a fork or unpickling
        files = self._role_files.get(role)
        if files is None:
            with self._open_lock:
                files = self._role_files.get(role)
                if files is None:
                    files = self._role_files[role] = self._role_opener(role)
        return files

    @contextlib.contextmanager
    def _mapped(self, role: str, sid: int) -> Iterator[np.ndarray]:
        """Shard ``sid``'s ``role`` file mapped read-only (flat uint8), open inside the block."""
        files = self._open_role_files(role)
        with files.use(sid) as shard:  # checked before every use (_shard_guard)
            yield files.rows(shard, 0)

    def _offsets_col(self, col: Column, sid: int) -> np.ndarray:
        """Shard ``sid``'s checked offsets of a typed variable-length column (cached)."""
        off = self._col_offsets.get((col.name, sid))
        if off is None:
            shard = self.index.shards[sid]
            raw = self._read_whole(sid, col.offsets_role)
            where = self._local_path(sid, col.offsets_role)
            data_bytes = shard.files[col.data_role].bytes
            off = check_offsets(raw, shard.records, data_bytes, col.row_bytes, where)
            self._col_offsets[(col.name, sid)] = off
        return off

    def _read_var(self, col: Column, idx: np.ndarray, mode: str) -> Any:
        """One typed variable-length column of a batch (see ``assemble``)."""
        sid, local = self._locate(idx)
        order = self._plan(np.unique(sid).tolist()) if len(idx) else []
        values, lengths = read_variable(
            sid,
            local,
            lambda s: self._offsets_col(col, s),
            lambda s: self._mapped(col.data_role, s),
            order,
        )

        def where(j: int) -> str:
            s = int(sid[j])
            return f"{self._local_path(s, col.data_role)}: record {int(local[j])} (shard {s})"

        return assemble(col, values, lengths, mode, pad_value=self.pad_value, where=where)

    def read_span(self, name: str, shard: int, start: int, out: np.ndarray) -> None:
        """Read ``out.nbytes`` bytes of column ``name``'s data file in ``shard`` (``"data"``: the
        records) from byte ``start`` into ``out`` (contiguous, writable): one copy from the
        checked map; bytes beyond the file are a :class:`DatasetError`.
        :class:`feedpipe.TokenWindows` reads with it."""
        role = "data" if name == "data" else f"field.{name}"
        nbytes = out.nbytes
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("read_span: out must be a contiguous, writable array")
        with self._mapped(role, shard) as flat:  # checked like every read (_shard_guard)
            if start < 0 or start + nbytes > len(flat):
                raise DatasetError(
                    f"{self._local_path(shard, role)}: {nbytes} bytes at offset {start} lie "
                    f"beyond the file's {len(flat)} bytes"
                )
            out.reshape(-1).view(np.uint8)[:] = flat[start : start + nbytes]

    def _samples(self, idx: np.ndarray) -> list[Any]:
        """The samples ``ds[i]`` (before ``transform``) of a batch, read in one gather."""
        batch = self._read(idx, None, "list")
        if not self.fields:
            return list(batch) if self.kind == "fixed" else batch
        names = list(batch)
        return [{k: batch[k][j] for k in names} for j in range(len(idx))]

    def _transformed(self, idx: np.ndarray) -> Any:
        transform = self.transform
        assert transform is not None
        samples = [transform(s) for s in self._samples(idx)]
        if samples:
            return self._collate(samples)
        if self._len == 0:
            return []
        return self._collate([], transform(self._samples(np.zeros(1, np.int64))[0]))

    def _collate(self, samples: list[Any], example: Any = None) -> Any:
        """Transformed samples as one batch: typed columns as the batch without a transform
        (``example``: a sample to shape the batch of no samples like)."""
        cols = self._var_cols.values()
        ragged = [c.name for c in cols if c.kind == "ragged"]
        listed = [c.name for c in cols if c.kind != "ragged"]
        return collate_ragged(samples, ragged, self.ragged, self.pad_value, listed, example=example)
