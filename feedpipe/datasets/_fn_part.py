"""One part of ``convert(fn, ...)``: ``fn`` run over the part's inputs, its records written by a
:class:`PartWriter` whose layout and columns are those of the part's first record, and the
part's shards handed to the sink as they close (:func:`write_part`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from feedpipe.datasets._convert_sink import Sink
from feedpipe.datasets._fn_board import post
from feedpipe.datasets._fn_records import NO_DATA, conform, records_of, split_record
from feedpipe.datasets._fn_task import Task, fn_name, short
from feedpipe.datasets._part_pool import report
from feedpipe.datasets.convert_sources import infer_column, is_variable
from feedpipe.datasets.writer import MemmapWriter
from feedpipe.errors import DatasetError
from feedpipe.format import Index, Layout

__all__ = ["SHARDS_PER_PART", "PartWriter", "write_part"]

SHARDS_PER_PART = 100_000  # shard ids of part p: p * SHARDS_PER_PART + k
_FLUSH = 256  # records buffered per append_batch


def write_part(fn: Callable[[Any], Any], task: Task, sink: Sink, shard_bytes: int) -> Any:
    """Run ``fn`` over one part's inputs, write its shards, hand them to the sink; the part's
    index as JSON (None: no records)."""
    scratch = tempfile.mkdtemp(prefix=f"feedpipe-part-{task.part:05d}-")
    try:
        out = PartWriter(os.path.join(scratch, "part"), task.part, shard_bytes, sink)
        try:
            for j, item in enumerate(task.items):
                post(task.first + j)
                _convert_input(fn, item, f"input {task.first + j} ({short(item)})", out)
                report(1)
            index = out.close()
        except BaseException:
            out.abort()
            raise
        sink.put_part(task.part, out.path, index)
        return None if index is None else index.to_json()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _convert_input(fn: Callable[[Any], Any], item: Any, where: str, out: PartWriter) -> None:
    try:
        for r, record in enumerate(records_of(fn(item))):
            out.add(record, f"record {r}")
    except DatasetError as exc:
        raise DatasetError(f"{fn_name(fn)} on {where}: {exc}") from None
    except (Exception, SystemExit) as exc:  # sys.exit() in fn: not ours to obey
        raise DatasetError(f"{fn_name(fn)} failed on {where}: {type(exc).__name__}: {exc}") from exc


def records_layout(data: Any, has_fields: bool, where: str) -> tuple[Any, str]:
    """``(shape, dtype)`` of a writer for records like ``data`` (the part's first record's)."""
    if data is NO_DATA:
        if not has_fields:
            raise DatasetError(f"{where} is an empty dict: nothing to store")
        return (), "uint8"
    if isinstance(data, list):
        spec = infer_column(data, f"{where}: the records")
        if not isinstance(spec, tuple):
            raise DatasetError(
                f"{where}: the records are a list of non-numbers; the records column "
                "holds arrays or bytes (use another key to store a json field)"
            )
        return spec[1], spec[0]
    if isinstance(data, np.ndarray):
        return tuple(data.shape), str(data.dtype)
    return None, "uint8"


def _ragged(lay: Layout, data: Any, where: str) -> Any:
    return conform(data, (lay.dtype, (None, *lay.shape)), f"{where}: the records")


def _fixed(lay: Layout, data: Any, where: str) -> Any:
    if isinstance(data, np.ndarray) and data.shape == lay.shape and str(data.dtype) == lay.dtype:
        return data
    got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else "bytes"
    raise DatasetError(f"a record of {got}; the first was {lay.dtype} {lay.shape}")


def _bytes(lay: Layout, data: Any, where: str) -> Any:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else "a list"
    raise DatasetError(f"an array record ({got}); the first was bytes")


# a record's data checked against the layout of the part's first record, by layout kind
_DATA_CHECKS: dict[str, Callable[[Layout, Any, str], Any]] = {
    "ragged": _ragged,
    "fixed": _fixed,
    "bytes": _bytes,
}


class PartWriter:
    """One part's records into a MemmapWriter whose layout is that of the first record."""

    def __init__(self, path: str, part: int, shard_bytes: int, sink: Sink) -> None:
        self.path, self.part, self.shard_bytes, self.sink = path, part, shard_bytes, sink
        self.shipped = 0  # shards already handed to the sink
        self.writer: MemmapWriter | None = None
        self.closed = False
        self.datas: list[Any] = []
        self.cols: dict[str, list[Any]] = {}
        self.specs: dict[str, Any] = {}
        self.count = 0  # records buffered

    def add(self, record: Any, where: str = "a record") -> None:
        """Buffer one record (flushed every few hundred); ``where`` names it in an error."""
        data, fields = split_record(record)
        writer = self.writer or self._open(data, fields, where)
        lay = writer.layout
        if (lay.kind == "none") != (data is NO_DATA):
            raise DatasetError(f"{where}: a 'data' key only in some records")
        check = _DATA_CHECKS.get(lay.kind)
        data = check(lay, data, where) if check is not None else data
        if set(fields) != set(self.cols):
            raise DatasetError(
                f"{where}: side fields {sorted(fields)}, earlier records {sorted(self.cols)}"
            )
        if data is not NO_DATA:
            self.datas.append(data)
        for k, v in fields.items():
            self.cols[k].append(conform(v, self.specs[k], f"{where}: field {k!r}"))
        self.count += 1
        if self.count >= _FLUSH:
            self.flush()

    def _open(self, data: Any, fields: dict[str, Any], where: str) -> MemmapWriter:
        """The writer, its layout and columns decided by the first record."""
        self.specs = {k: infer_column(v, f"{where}: field {k!r}") for k, v in fields.items()}
        shape, dtype = records_layout(data, bool(fields), where)
        try:
            self.writer = MemmapWriter(
                self.path,
                shape=shape,
                dtype=dtype,
                records=data is not NO_DATA,
                fields=self.specs,
                shard_bytes=self.shard_bytes,
                first_shard=self.part * SHARDS_PER_PART,
            )
        except ValueError as exc:
            raise DatasetError(f"{where}: {exc}") from None
        self.cols = {k: [] for k in fields}
        return self.writer

    def flush(self) -> None:
        """Write the buffered records; hand the shards closed meanwhile to the sink."""
        if self.writer is None or not self.count:
            return
        datas = self.datas
        cols = {k: v if is_variable(self.specs[k]) else np.stack(v) for k, v in self.cols.items()}
        self.datas, self.cols, self.count = [], {k: [] for k in self.cols}, 0
        if self.writer.layout.kind == "fixed":  # add() checked every record
            self.writer.append_batch(np.stack(datas), **cols)
        elif self.writer.layout.kind == "none":
            self.writer.append_batch(None, **cols)
        else:
            self.writer.append_batch(datas, **cols)
        done = self.writer.shards  # closed shards go now, not when the part ends
        if len(done) > self.shipped:
            rels = [f.path for shard in done[self.shipped :] for f in shard.files.values()]
            self.sink.put_files(self.path, rels)
            self.shipped = len(done)

    def abort(self) -> None:
        if self.writer is not None and not self.closed:
            self.writer.abort()

    def close(self) -> Index | None:
        """The part's index (None: it had no records)."""
        if self.writer is None:
            return None
        self.flush()
        self.closed = True
        index = self.writer.close()
        if len(index.shards) >= SHARDS_PER_PART:
            raise DatasetError(
                f"part {self.part} wrote {len(index.shards)} shards; use a smaller "
                "inputs_per_part or a larger shard_bytes"
            )
        return index
