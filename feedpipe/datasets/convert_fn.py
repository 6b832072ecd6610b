"""``feedpipe.convert(fn, inputs, output=...)``: run your function over inputs, in parallel.

``fn(item)`` is called once per item of ``inputs`` in a process pool; it returns or yields the
records of that item (none, to filter it out). A record is an array or tensor (the fixed layout:
every record the same shape and dtype), bytes (the bytes layout), a list of numbers (the ragged
layout), a dict with any identifier keys (``"data"``, when present, holds the records; the
others are side fields; without it the dataset has no records column), or a tuple
``(data, label)`` / ``(data, field1, field2, ...)``, as ``feedpipe.convert`` takes from a torch
dataset. Columns are typed as there (``infer_column``): ``str`` a ``"str"`` column, a dict a
``"json"`` column, bytes and lists of numbers ragged arrays, arrays and numbers fixed. Each part
decides its columns from its first record and checks every record against them (a mismatch is a
``DatasetError`` naming the input, the record and the field); the parts must then agree.

Determinism: the inputs are split into parts of ``inputs_per_part`` consecutive items, a number
that never depends on ``num_workers``. Each part is written by one worker, as its own shards
(shard ids ``part * 100000 + k``, rolled over at ``shard_bytes``), and the index lists the parts
in input order. So the output, bytes and index, is the same whatever the worker count.

Commit order: shard files are written locally under temporary names; each is moved (local
output) or uploaded (``s3://...``, any fsspec URL) by its worker as soon as its shard is closed;
when the part ends, its manifest is written under ``.feedpipe-convert/`` at the destination.
``index.json`` is written last, after every part; then the state folder goes. A rerun after a
crash finds the manifests and converts only the parts that have none: the same output as an
uninterrupted run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import math
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from numbers import Number
from typing import Any

import numpy as np

from feedpipe.datasets._convert_sink import Sink
from feedpipe.datasets.columns import encode
from feedpipe.datasets.convert_result import ConvertResult
from feedpipe.datasets.convert_sources import infer_column, is_variable
from feedpipe.datasets.format import Index
from feedpipe.datasets.writer import DEFAULT_SHARD_BYTES, MemmapWriter
from feedpipe.errors import DatasetError
from feedpipe.io.progress import progress
from feedpipe.io.reaper import die_with_parent, end_processes, pid_alive
from feedpipe.io.remote import redact

__all__ = ["convert_fn", "load_function"]

SHARDS_PER_PART = 100_000  # shard ids of part p: p * SHARDS_PER_PART + k
_MAX_PARTS = 256  # default inputs_per_part: at most this many parts
_FLUSH = 256  # records buffered per append_batch
_QUEUE: Any = None  # a worker's progress queue
_POOL_END_S = 2.0  # how long a broken pool's error waits for the pool to end its workers
_SEAT: Any = None  # a pool worker's (board, index) where it posts its current input number


@dataclass(frozen=True)
class _Task:
    part: int
    first: int  # index of the part's first input
    items: list[Any]


def load_function(spec: str) -> Callable[..., Any]:
    """The function named ``package.module:function`` (or ``package.module.function``)."""
    module, sep, name = spec.partition(":")
    if not sep:
        module, _, name = spec.rpartition(".")
    if not module or not name:
        raise ValueError(f"--fn {spec!r}: expected package.module:function")
    try:
        obj: Any = importlib.import_module(module)
    except (ImportError, TypeError) as exc:  # TypeError: a relative name (".mod")
        raise ValueError(f"--fn {spec!r}: cannot import {module!r}: {exc}") from None
    for attr in name.split("."):
        obj = getattr(obj, attr, None)
        if obj is None:
            raise ValueError(f"--fn {spec!r}: {module!r} has no {name!r}")
    if not callable(obj):
        raise ValueError(f"--fn {spec!r}: {name!r} is not callable")
    return obj  # type: ignore[no-any-return]


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function under ``functools.partial`` layers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _fn_name(fn: Callable[..., Any]) -> str:
    inner = _unwrap(fn)
    name = type(inner).__name__
    name = f"{getattr(inner, '__module__', '?')}:{getattr(inner, '__qualname__', name)}"
    return name if inner is fn else f"partial({name})"


def _fingerprint(fn: Callable[..., Any], items: list[Any]) -> str:
    h = hashlib.blake2b(digest_size=16)
    inner = _unwrap(fn)
    code = getattr(inner, "__code__", None) or getattr(type(inner).__call__, "__code__", None)
    h.update(_fn_name(fn).encode())
    if code is not None:
        h.update(code.co_code)
        h.update(repr(code.co_consts).encode())
    try:  # a partial's arguments, a callable object's attributes (a function: its name only)
        h.update(pickle.dumps(fn, protocol=4))
    except Exception:  # in-process (num_workers=1) functions need not pickle
        pass
    try:
        h.update(pickle.dumps(items, protocol=4))
    except Exception as exc:
        raise DatasetError(f"inputs must be picklable (workers get them): {exc}") from None
    return h.hexdigest()


def convert_fn(
    fn: Callable[[Any], Any],
    inputs: Iterable[Any],
    output: str | os.PathLike[str],
    *,
    num_workers: int | None = None,
    inputs_per_part: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress_bar: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ConvertResult:
    """Run ``fn`` over ``inputs`` in ``num_workers`` processes into a dataset at ``output``.

    Args:
        fn: called as ``fn(item)``; returns or yields records (see the module docstring).
            With more than one worker it is pickled (a module-level function, or a
            ``functools.partial`` of one).
        inputs: the items (paths, URLs, ids...); picklable.
        output: a new or empty local folder, or an fsspec URL (``s3://bucket/ds``).
        num_workers: processes (default: up to 4, one per CPU). Changes speed only.
        inputs_per_part: consecutive inputs per part (default: enough for at most 256 parts).
            Parts are the unit of parallelism and of resume; each has its own shards.
        shard_bytes: a shard is closed before its data file would exceed this.
        overwrite: replace a feedpipe dataset already at ``output``.
        progress_bar: a tqdm bar with ETA (default: when stderr is a terminal).
        storage_options: fsspec options for a remote ``output``.
    """
    start = time.monotonic()
    items = list(inputs)
    if not items:
        raise DatasetError("convert(fn, inputs): inputs is empty")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    per = max(1, math.ceil(len(items) / _MAX_PARTS)) if inputs_per_part is None else inputs_per_part
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:  # 0: not "the default"
        raise ValueError(f"inputs_per_part must be >= 1, got {per}")
    tasks = [_Task(k, lo, items[lo : lo + per]) for k, lo in enumerate(range(0, len(items), per))]
    workers = max(1, num_workers if num_workers is not None else min(4, os.cpu_count() or 1))
    if workers > 1 and len(tasks) > 1:
        _check_picklable(fn)
    sink = Sink(os.fspath(output), storage_options)
    plan = {
        "version": 1,
        "fn": _fn_name(fn),
        "fingerprint": _fingerprint(fn, items),
        "inputs": len(items),
        "inputs_per_part": per,
        "shard_bytes": int(shard_bytes),
    }
    finished = None if overwrite else sink.converted(plan)
    if finished is not None:  # killed after the final rename, before the state was removed
        return ConvertResult(
            sink.output,
            finished.num_records,
            finished.total_bytes,
            len(finished.shards),
            time.monotonic() - start,
            len(tasks),
        )
    done = sink.start(plan, overwrite=overwrite)
    todo = [t for t in tasks if t.part not in done]
    name = os.path.basename(sink.output.rstrip("/")) or sink.output
    bar = progress(len(items), f"convert {name}", unit="input", enabled=progress_bar)
    bar.update(sum(len(t.items) for t in tasks if t.part in done))
    try:
        results = dict(done)
        results.update(_run(fn, todo, sink, int(shard_bytes), workers, bar))
    finally:
        bar.close()
    index = _merge(tasks, results, _fn_name(fn))
    sink.finish(index, overwrite=overwrite)
    return ConvertResult(
        sink.output,
        index.num_records,
        index.total_bytes,
        len(index.shards),
        time.monotonic() - start,
        len(done),
    )


def _check_picklable(fn: Callable[..., Any]) -> None:
    """Refuse, before anything is written, a function the worker processes cannot receive."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"convert(fn, ...): {_fn_name(fn)} cannot be sent to worker processes ({exc}); pass "
            "a module-level function (or a functools.partial of one), or num_workers=1"
        ) from None


# ---------------------------------------------------------------------- the workers
def _init_worker(q: Any, board: Any = None, seats: Any = None) -> None:
    """A pool worker's start: its progress queue, and a seat on the board (see
    :class:`_Board`) where it posts the input it is converting."""
    global _QUEUE, _SEAT
    die_with_parent()  # an owner killed outright (OOM) must not leave its workers converting
    _QUEUE = q
    if board is not None:
        with seats.get_lock():
            seat = seats.value
            seats.value += 1
        board[2 * seat] = os.getpid()
        _SEAT = (board, 2 * seat + 1)


class _Board:
    """Which input each pool worker is converting: one ``(pid, input number)`` pair per worker
    in shared memory, written with no system call and no wait (a worker killed at any instant
    leaves its last input there), read by the parent to name the input when a worker dies."""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.board = ctx.Array("q", [-1] * (2 * workers), lock=False)
        self.seats = ctx.Value("i", 0)

    def initargs(self, q: Any) -> tuple[Any, ...]:
        return (q, self.board, self.seats)

    def error(
        self, fn: Callable[[Any], Any], tasks: Sequence[_Task], procs: Sequence[Any] = ()
    ) -> DatasetError:
        """The error for a pool broken by a worker that died (killed, out of memory, a crash
        in native code): it names the function and the input(s) that worker was on.

        The pool ends its other workers with SIGTERM once one dies: those (``procs`` tells
        their exit codes, after a bounded wait for them to end) are not named when another
        worker died otherwise."""
        end = time.monotonic() + _POOL_END_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        codes = {p.pid: p.exitcode for p in procs}
        posted = {int(self.board[i]): int(self.board[i + 1]) for i in range(0, len(self.board), 2)}
        dead = {pid: n for pid, n in posted.items() if pid > 0 and n >= 0 and not pid_alive(pid)}
        ended = (None, -signal.SIGTERM)  # the pool's own SIGTERM, or unknown
        numbers = [n for pid, n in dead.items() if codes.get(pid) not in ended] or list(
            dead.values()
        )
        if not numbers:  # every worker still alive or idle: name what was in flight
            numbers = [n for pid, n in posted.items() if pid > 0 and n >= 0]
        shown = [_input(tasks, n) for n in sorted(numbers)] or ["an unknown input"]
        return DatasetError(
            f"{_fn_name(fn)}: a worker process died (killed, out of memory or crashed) while "
            f"converting {' or '.join(shown)}; nothing was published"
        )


def _input(tasks: Sequence[_Task], number: int) -> str:
    for t in tasks:
        if t.first <= number < t.first + len(t.items):
            return f"input {number} ({_short(t.items[number - t.first])})"
    return f"input {number}"


def _records(produced: Any) -> Iterable[Any]:
    if produced is None:
        return ()
    single = (Mapping, tuple, bytes, bytearray, memoryview, np.ndarray, np.generic, Number)
    if isinstance(produced, single) or hasattr(produced, "numpy"):
        return (produced,)
    if isinstance(produced, str):
        raise DatasetError("a str record cannot be stored (encode it to bytes)")
    return produced  # type: ignore[no-any-return]


_NO_DATA: Any = object()  # a dict record without "data": the dataset has no records column


def _split(record: Any) -> tuple[Any, dict[str, Any]]:
    """(data, side fields) of one record."""
    if isinstance(record, Mapping):
        for k in record:
            if not isinstance(k, str) or not k.isidentifier():
                raise DatasetError(f"key {k!r} cannot name a field (a Python identifier)")
        data = _plain(record["data"]) if "data" in record else _NO_DATA
        return data, {k: _value(v, k) for k, v in record.items() if k != "data"}
    if isinstance(record, tuple):
        names = ["label"] if len(record) == 2 else [f"field{j}" for j in range(1, len(record))]
        rest = {n: _value(v, n) for n, v in zip(names, record[1:], strict=True)}
        return _plain(record[0]), rest
    return _plain(record), {}


def _plain(value: Any) -> Any:
    """A records value: an array, bytes, or a list of numbers (ragged)."""
    if isinstance(value, str):
        raise DatasetError(
            "a str record cannot be stored as the records (encode it to bytes, or return it "
            "in a dict under a key other than 'data': a str column)"
        )
    if value is None:
        raise DatasetError("a None record cannot be stored (to filter an input out, yield nothing)")
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    if isinstance(value, (bytes, bytearray, memoryview, list)):
        return value
    return np.asarray(value)


def _value(value: Any, name: str) -> Any:
    """A side-field value as ``infer_column`` types it (str, dict, list and bytes kept)."""
    if value is None:
        raise DatasetError(f"field {name!r} is None: a column cannot hold a missing value")
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    if isinstance(value, (str, dict, list, bytes, bytearray, memoryview)):
        return value
    return np.asarray(value)


def _spec_text(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    return f"{spec[0]} {list(spec[1])}".replace("None", "n")


def _conform(value: Any, spec: Any, what: str) -> Any:
    """``value`` as stored in a column of ``spec`` (the first record's), else ``DatasetError``."""
    got = infer_column(value, what)
    if spec in ("str", "json") and (got == spec or (spec == "json" and isinstance(value, list))):
        encode(spec, "uint8", (), value, what)  # refused here, naming the input, not at flush
        return value
    if got == spec:
        return value
    if isinstance(spec, tuple) and isinstance(got, tuple) and isinstance(value, (list, np.ndarray)):
        if is_variable(spec):  # a list or an array of any length, its rows the first's
            empty = len(value) == 0
            if empty or (got[1][1:] == spec[1][1:] and np.can_cast(got[0], spec[0])):
                return np.asarray(value, dtype=spec[0]).reshape(-1, *spec[1][1:])
        elif got[1] == spec[1] and np.can_cast(got[0], spec[0]):  # e.g. np.int32 in int64
            return np.asarray(value, dtype=spec[0])
    hint = ""
    if isinstance(spec, tuple) and isinstance(got, tuple) and not is_variable(spec):
        hint = " (for a variable-length column, make the first record's value a list)"
    raise DatasetError(
        f"{what} is {_spec_text(got)}; the first record's was {_spec_text(spec)}{hint}"
    )


class _PartWriter:
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
        data, fields = _split(record)
        if self.writer is None:
            self.specs = {k: infer_column(v, f"{where}: field {k!r}") for k, v in fields.items()}
            shape: tuple[Any, ...] | None
            if data is _NO_DATA:
                if not fields:
                    raise DatasetError(f"{where} is an empty dict: nothing to store")
                shape, dtype = (), "uint8"
            elif isinstance(data, list):
                spec = infer_column(data, f"{where}: the records")
                if not isinstance(spec, tuple):
                    raise DatasetError(
                        f"{where}: the records are a list of non-numbers; the records column "
                        "holds arrays or bytes (use another key to store a json field)"
                    )
                dtype, shape = spec
            else:
                fixed = isinstance(data, np.ndarray)
                shape = tuple(data.shape) if fixed else None
                dtype = str(data.dtype) if fixed else "uint8"
            try:
                self.writer = MemmapWriter(
                    self.path,
                    shape=shape,
                    dtype=dtype,
                    records=data is not _NO_DATA,
                    fields=self.specs,
                    shard_bytes=self.shard_bytes,
                    first_shard=self.part * SHARDS_PER_PART,
                )
            except ValueError as exc:
                raise DatasetError(f"{where}: {exc}") from None
            self.cols = {k: [] for k in fields}
        lay = self.writer.layout
        if (lay.kind == "none") != (data is _NO_DATA):
            raise DatasetError(f"{where}: a 'data' key only in some records")
        if lay.kind == "ragged":
            data = _conform(data, (lay.dtype, (None, *lay.shape)), f"{where}: the records")
        if lay.kind == "fixed" and not (
            isinstance(data, np.ndarray)
            and data.shape == lay.shape
            and str(data.dtype) == lay.dtype
        ):
            got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else "bytes"
            raise DatasetError(f"a record of {got}; the first was {lay.dtype} {lay.shape}")
        if lay.kind == "bytes" and not isinstance(data, (bytes, bytearray, memoryview)):
            got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else "a list"
            raise DatasetError(f"an array record ({got}); the first was bytes")
        if set(fields) != set(self.cols):
            raise DatasetError(
                f"{where}: side fields {sorted(fields)}, earlier records {sorted(self.cols)}"
            )
        if data is not _NO_DATA:
            self.datas.append(data)
        for k, v in fields.items():
            self.cols[k].append(_conform(v, self.specs[k], f"{where}: field {k!r}"))
        self.count += 1
        if self.count >= _FLUSH:
            self.flush()

    def flush(self) -> None:
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


def _write_part(fn: Callable[[Any], Any], task: _Task, sink: Sink, shard_bytes: int) -> Any:
    """Run ``fn`` over one part's inputs, write its shards, hand them to the sink."""
    scratch = tempfile.mkdtemp(prefix=f"feedpipe-part-{task.part:05d}-")
    try:
        out = _PartWriter(os.path.join(scratch, "part"), task.part, shard_bytes, sink)
        try:
            for j, item in enumerate(task.items):
                where = f"input {task.first + j} ({_short(item)})"
                if _SEAT is not None:
                    _SEAT[0][_SEAT[1]] = task.first + j
                try:
                    for r, record in enumerate(_records(fn(item))):
                        out.add(record, f"record {r}")
                except DatasetError as exc:
                    raise DatasetError(f"{_fn_name(fn)} on {where}: {exc}") from None
                except (Exception, SystemExit) as exc:  # sys.exit() in fn: not ours to obey
                    raise DatasetError(
                        f"{_fn_name(fn)} failed on {where}: {type(exc).__name__}: {exc}"
                    ) from exc
                if _QUEUE is not None:
                    _QUEUE.put(1)
            index = out.close()
        except BaseException:
            out.abort()
            raise
        sink.put_part(task.part, out.path, index)
        return None if index is None else index.to_json()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _short(item: Any) -> str:
    """An input as an error shows it: redacted whole, then cut (a cut first could leave a
    URL's password without the "@" that marks it)."""
    text = redact(repr(item))
    return text if len(text) <= 80 else text[:77] + "..."


def _run(  # noqa: PLR0917
    fn: Callable[[Any], Any],
    todo: Sequence[_Task],
    sink: Sink,
    shard_bytes: int,
    workers: int,
    bar: Any,
) -> dict[int, Index | None]:
    results: dict[int, Index | None] = {}
    if not todo:
        return results
    if workers == 1 or len(todo) == 1:
        global _QUEUE
        _QUEUE = None
        for t in todo:
            results[t.part] = _as_index(_write_part(fn, t, sink, shard_bytes))
            bar.update(len(t.items))
        return results
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    q = ctx.Queue()
    board = _Board(ctx, min(workers, len(todo)))
    before = {p.pid for p in mp.active_children()}
    pool = ProcessPoolExecutor(
        min(workers, len(todo)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=board.initargs(q),
    )
    procs: list[Any] = []
    try:
        futures: dict[Future[Any], _Task] = {
            pool.submit(_write_part, fn, t, sink, shard_bytes): t for t in todo
        }
        # the pool starts its processes at the first submit: those new since `before`
        procs = [p for p in mp.active_children() if p.pid not in before]
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(q, bar)
            for fut in finished:
                try:
                    results[futures[fut].part] = _as_index(fut.result())
                except BrokenProcessPool:  # not a bare error: name the function and input
                    raise board.error(fn, todo, procs) from None
    except BaseException:
        # a failed part (or Ctrl-C) while others run: the pool's own shutdown would wait for
        # every running fn, forever for one that hangs; end them within the reaper's bound
        pool.shutdown(wait=False, cancel_futures=True)
        end_processes(procs, "convert(fn) worker")
        raise
    pool.shutdown(wait=True)
    _drain(q, bar)
    return results


def _as_index(doc: Any) -> Index | None:
    return None if doc is None else Index.from_json(doc, "part manifest")


def _drain(q: Any, bar: Any) -> None:
    while True:
        try:
            bar.update(q.get_nowait())
        except queue_mod.Empty:
            return


# ---------------------------------------------------------------------- the index
def _merge(tasks: Sequence[_Task], results: Mapping[int, Index | None], fn: str) -> Index:
    """The parts' shards in input order; every part must have the same layout and fields."""
    first: tuple[_Task, Index] | None = None
    shards = []
    for t in tasks:
        idx = results[t.part]
        if idx is None:
            continue
        if first is None:
            first = (t, idx)
        elif (idx.layout, idx.fields) != (first[1].layout, first[1].fields):
            raise DatasetError(
                f"{fn}: inputs {t.first}.. give records of {_describe(idx)}, but inputs "
                f"{first[0].first}.. gave {_describe(first[1])}: every record needs the same "
                "layout and side fields"
            )
        want = range(t.part * SHARDS_PER_PART, (t.part + 1) * SHARDS_PER_PART)
        for shard in idx.shards:
            for info in shard.files.values():
                sid = info.path.split(".", 1)[0].removeprefix("shard-")
                if not sid.isdigit() or int(sid) not in want:
                    raise DatasetError(f"part {t.part}: manifest lists a foreign file {info.path}")
        shards.extend(idx.shards)
    if first is None:
        raise DatasetError(f"{fn} produced no records from any input")
    extra = {"source": {"kind": "fn", "fn": fn, "inputs": sum(len(t.items) for t in tasks)}}
    return Index(first[1].layout, dict(first[1].fields), shards, extra)


def _describe(idx: Index) -> str:
    lay = idx.layout
    data = {"bytes": "bytes", "none": "no records"}.get(lay.kind, f"{lay.dtype} {list(lay.shape)}")
    if lay.kind == "ragged":
        data += " (ragged)"
    fields = ", ".join(
        f"{n}: {f.kind if f.kind in ('str', 'json') else f'{f.dtype} {list(f.shape)}'}"
        + (" (ragged)" if f.kind == "ragged" else "")
        for n, f in idx.fields.items()
    )
    return f"{data}" + (f" with {fields}" if fields else "")
