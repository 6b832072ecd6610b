"""The columns of a :class:`~feedpipe.MemmapDataset` other than fixed-size records.

:class:`ColumnReader` reads, through the dataset's :class:`~._memmap_open.ShardFiles`: the
records of the bytes layout (one gather per shard of a batch), the variable-length columns of
:mod:`feedpipe.datasets.columns` (ragged arrays, ``str``, ``json``; one gather per column per
shard of a batch from their mapped data files), fixed-size side fields (read whole once and kept
in memory) and byte spans of a column (``read_span``, for :class:`feedpipe.TokenWindows`).
Offsets are read whole and checked once per shard. Its caches stay behind when it is pickled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from feedpipe.datasets._memmap_open import ShardFiles
from feedpipe.datasets.columns import Column, assemble, check_offsets, gather, read_variable
from feedpipe.errors import DatasetError
from feedpipe.format import FieldSpec

__all__ = ["ColumnReader", "check_out"]


class ColumnReader:
    """Reads of every column but the fixed-size records (see the module docstring):
    ``fields`` are the dataset's side fields, ``variable`` its variable-length columns by batch
    key (``data`` for ragged records), ``pad_value`` pads ragged columns."""

    def __init__(
        self,
        files: ShardFiles,
        fields: dict[str, FieldSpec],
        variable: dict[str, Column],
        pad_value: Any,
    ) -> None:
        self.files, self.fields, self.variable = files, fields, variable
        self.pad_value = pad_value
        self._offsets: dict[tuple[str, int], np.ndarray] = {}  # (role, shard): checked offsets
        self._columns: dict[str, np.ndarray] = {}  # side fields read whole

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_offsets": {}, "_columns": {}}

    # ------------------------------------------------------------------ side fields
    def check_column(self, name: str) -> None:
        """Raise if a file of side field ``name`` changed since it was read (before every use
        of :meth:`column`'s values: ``ShardFiles.check_whole``)."""
        self.files.check_whole(f"field.{name}")

    def column(self, name: str, check: bool = True) -> np.ndarray:
        """A side field for all records, concatenated over shards (small; kept in memory;
        ``check``: :meth:`check_column` first; each file is checked when read in any case)."""
        if check:
            self.check_column(name)
        col = self._columns.get(name)
        if col is None:
            spec = self.fields[name]
            parts = []
            source = self.files.source
            for sid in range(len(source.index.shards)):
                raw = source.read_whole(sid, f"field.{name}", self.files.release_idle)
                parts.append(np.frombuffer(raw, dtype=spec.dtype).reshape(-1, *spec.shape))
            col = np.concatenate(parts) if parts else np.empty((0, *spec.shape), spec.dtype)
            self._columns[name] = col
        return col

    def read_field(self, name: str, idx: np.ndarray, out: Any, mode: str) -> dict[str, Any]:
        """Side field ``name`` of a batch, as batch keys (a ragged column adds its lengths);
        a fixed-size field goes into ``out`` when given (a CPU tensor with room)."""
        col = self.variable.get(name)
        if col is not None:
            got = self.read_variable(col, idx, mode)
            return got if isinstance(got, dict) else {name: got}
        values = self.column(name)
        if out is None:
            return {name: torch.from_numpy(values[idx])}
        spec = self.fields[name]
        view = check_out(out, len(idx), spec.shape, np.dtype(spec.dtype), name)
        np.take(values, idx, axis=0, out=view.numpy(), mode="clip")
        return {name: view}

    # ------------------------------------------------------------------ variable-length
    def offsets(self, sid: int, col: Column | None = None) -> np.ndarray:
        """Shard ``sid``'s checked offsets of ``col`` (None: the bytes layout's records)."""
        role = "offsets" if col is None else col.offsets_role
        self.files.check_whole(role, [sid])  # kept in memory, checked before every use
        off = self._offsets.get((role, sid))
        if off is None:
            source = self.files.source
            shard = source.index.shards[sid]
            raw = source.read_whole(sid, role, self.files.release_idle)
            where = source.local_path(sid, role)
            if col is None:
                off = _records_offsets(raw, shard.records, shard.files["data"].bytes, sid, where)
            else:
                data_bytes = shard.files[col.data_role].bytes
                off = check_offsets(raw, shard.records, data_bytes, col.row_bytes, where)
            self._offsets[(role, sid)] = off
        return off

    def read_variable(self, col: Column, idx: np.ndarray, mode: str) -> Any:
        """One typed variable-length column of a batch (see ``assemble``)."""
        files = self.files
        sid, local = files.locate(idx)
        order = files.order(np.unique(sid).tolist()) if len(idx) else []
        values, lengths = read_variable(
            sid,
            local,
            lambda s: self.offsets(s, col),
            lambda s: files.mapped(col.data_role, s),
            order,
        )

        def where(j: int) -> str:
            s = int(sid[j])
            path = files.source.local_path(s, col.data_role)
            return f"{path}: record {int(local[j])} (shard {s})"

        return assemble(col, values, lengths, mode, pad_value=self.pad_value, where=where)

    def read_bytes(self, idx: np.ndarray, out: Any) -> list[torch.Tensor]:
        """Records of the bytes layout: views of one uint8 buffer (``out`` when given)."""
        files = self.files
        sid, local = files.locate(idx)
        starts = np.empty(len(idx), np.int64)
        lengths = np.empty(len(idx), np.int64)
        for s in np.unique(sid).tolist():
            pos = np.flatnonzero(sid == s)
            off = self.offsets(s)
            starts[pos] = off[local[pos]]
            lengths[pos] = off[local[pos] + 1] - off[local[pos]]
        buf = _bytes_out(out, int(lengths.sum()))
        flat = buf.numpy()
        dest = np.cumsum(lengths) - lengths
        for s in files.order(np.unique(sid).tolist()):  # one gather from each shard's map
            pos = np.flatnonzero(sid == s)
            with files.mapped("data", s) as data:  # checked like every read (_shard_guard)
                gather(data, starts[pos], lengths[pos], flat, dest[pos])
        return list(torch.split(buf, lengths.tolist()))

    def one_record(self, sid: int, local: int) -> torch.Tensor:
        """Record ``local`` of shard ``sid`` of the bytes layout (a copy)."""
        off = self.offsets(sid)
        a, b = int(off[local]), int(off[local + 1])
        with self.files.mapped("data", sid) as flat:  # checked like every read (_shard_guard)
            return torch.from_numpy(flat[a:b].copy())

    def read_span(self, name: str, shard: int, start: int, out: np.ndarray) -> None:
        """``out.nbytes`` bytes of column ``name``'s data file (``"data"``: the records) in
        ``shard`` from byte ``start`` into ``out`` (see ``MemmapDataset.read_span``)."""
        role = "data" if name == "data" else f"field.{name}"
        nbytes = out.nbytes
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("read_span: out must be a contiguous, writable array")
        with self.files.mapped(role, shard) as flat:  # checked like every read (_shard_guard)
            if start < 0 or start + nbytes > len(flat):
                raise DatasetError(
                    f"{self.files.source.local_path(shard, role)}: {nbytes} bytes at offset "
                    f"{start} lie beyond the file's {len(flat)} bytes"
                )
            out.reshape(-1).view(np.uint8)[:] = flat[start : start + nbytes]


def _records_offsets(raw: bytes, records: int, data_bytes: int, sid: int, where: str) -> np.ndarray:
    """The bytes layout's offsets of one shard, checked."""
    off = np.frombuffer(raw, dtype="<u8").astype(np.int64)
    if len(off) != records + 1 or off[0] != 0 or off[-1] != data_bytes or np.any(np.diff(off) < 0):
        raise DatasetError(
            f"{where}: shard {sid} offsets are corrupt (first {off[0]}, last {off[-1]}, "
            f"data file {data_bytes} bytes)"
        )
    return off


def _bytes_out(out: Any, total: int) -> torch.Tensor:
    """Where a batch of ``total`` record bytes goes: ``out`` (checked) or a new buffer."""
    if out is None:
        return torch.empty(total, dtype=torch.uint8)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.ndim != 1:
        raise ValueError("out['data'] for the bytes layout must be a 1-D uint8 tensor")
    if out.numel() < total or not out.is_contiguous():
        raise ValueError(f"out['data'] holds {out.numel()} bytes; the batch needs {total}")
    return out[:total]


def check_out(
    out: Any, n: int, shape: tuple[int, ...], dtype: np.dtype[Any], name: str
) -> torch.Tensor:
    """The first ``n`` rows of ``out[name]``, checked: a contiguous CPU tensor of ``dtype``
    with rows of ``shape``."""
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        raise ValueError(f"out[{name!r}] must be a CPU tensor")
    want = torch.from_numpy(np.empty(0, dtype)).dtype
    if out.dtype != want or tuple(out.shape[1:]) != tuple(shape) or out.shape[0] < n:
        raise ValueError(
            f"out[{name!r}] is {out.dtype} {tuple(out.shape)}; need {want} with at least "
            f"{n} rows of shape {tuple(shape)}"
        )
    view = out[:n]
    if not view.is_contiguous():
        raise ValueError(f"out[{name!r}] must be contiguous")
    return view
