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

import hashlib
import importlib
import math
import os
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from feedpipe.datasets._convert_sink import Sink
from feedpipe.datasets._fn_part import SHARDS_PER_PART
from feedpipe.datasets._fn_pool import PartRunner
from feedpipe.datasets._fn_task import Task, fn_name, unwrap
from feedpipe.datasets._part_pool import worker_count
from feedpipe.datasets.convert_result import ConvertResult
from feedpipe.datasets.writer import DEFAULT_SHARD_BYTES
from feedpipe.errors import DatasetError
from feedpipe.format import Index
from feedpipe.io.progress import progress

__all__ = ["FnJob", "convert_fn", "load_function"]

_MAX_PARTS = 256  # default inputs_per_part: at most this many parts


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


def _fingerprint(fn: Callable[..., Any], items: list[Any]) -> str:
    h = hashlib.blake2b(digest_size=16)
    inner = unwrap(fn)
    code = getattr(inner, "__code__", None) or getattr(type(inner).__call__, "__code__", None)
    h.update(fn_name(fn).encode())
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
        num_workers: processes (default: up to 4, one per CPU; 0 or 1: in this process).
            Changes speed only.
        inputs_per_part: consecutive inputs per part (default: enough for at most 256 parts).
            Parts are the unit of parallelism and of resume; each has its own shards.
        shard_bytes: a shard is closed before its data file would exceed this.
        overwrite: replace a feedpipe dataset already at ``output``.
        progress_bar: a tqdm bar with ETA (default: when stderr is a terminal).
        storage_options: fsspec options for a remote ``output``.
    """
    start = time.monotonic()
    job = FnJob(fn, list(inputs), inputs_per_part, shard_bytes, num_workers)
    return job.run(Sink(os.fspath(output), storage_options), overwrite, progress_bar, start)


class FnJob:
    """One ``convert(fn, ...)``: its inputs cut into parts, resolved once; :meth:`run` writes
    the parts missing at the sink (those of an interrupted run of the same :meth:`plan` are
    kept) and then the index."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        items: list[Any],
        inputs_per_part: int | None,
        shard_bytes: int,
        num_workers: int | None,
    ) -> None:
        if not items:
            raise DatasetError("convert(fn, inputs): inputs is empty")
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        per = (
            max(1, math.ceil(len(items) / _MAX_PARTS))
            if inputs_per_part is None
            else inputs_per_part
        )
        if isinstance(per, bool) or not isinstance(per, int) or per < 1:  # 0: not "the default"
            raise ValueError(f"inputs_per_part must be >= 1, got {per}")
        self.fn, self.items, self.shard_bytes = fn, items, int(shard_bytes)
        self.tasks = [
            Task(k, lo, items[lo : lo + per]) for k, lo in enumerate(range(0, len(items), per))
        ]
        self.workers = worker_count(num_workers)
        self.per = per
        if self.workers > 1 and len(self.tasks) > 1:
            _check_picklable(fn)

    def plan(self) -> dict[str, Any]:
        """What a resumed run must match: the function, its inputs and how they are cut."""
        return {
            "version": 1,
            "fn": fn_name(self.fn),
            "fingerprint": _fingerprint(self.fn, self.items),
            "inputs": len(self.items),
            "inputs_per_part": self.per,
            "shard_bytes": self.shard_bytes,
        }

    def run(
        self, sink: Sink, overwrite: bool, progress_bar: bool | None, start: float
    ) -> ConvertResult:
        plan = self.plan()
        finished = None if overwrite else sink.converted(plan)
        if finished is not None:  # killed after the final rename, before the state was removed
            return ConvertResult.of(
                sink.output, finished, time.monotonic() - start, len(self.tasks)
            )
        done = sink.start(plan, overwrite=overwrite)
        todo = [t for t in self.tasks if t.part not in done]
        name = os.path.basename(sink.output.rstrip("/")) or sink.output
        bar = progress(len(self.items), f"convert {name}", unit="input", enabled=progress_bar)
        bar.update(sum(len(t.items) for t in self.tasks if t.part in done))
        try:
            results = dict(done)
            results.update(PartRunner(self.fn, sink, self.shard_bytes, self.workers).run(todo, bar))
        finally:
            bar.close()
        index = _merge(self.tasks, results, fn_name(self.fn))
        sink.finish(index, overwrite=overwrite)
        return ConvertResult.of(sink.output, index, time.monotonic() - start, len(done))


def _check_picklable(fn: Callable[..., Any]) -> None:
    """Refuse, before anything is written, a function the worker processes cannot receive."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"convert(fn, ...): {fn_name(fn)} cannot be sent to worker processes ({exc}); pass "
            "a module-level function (or a functools.partial of one), or num_workers=1"
        ) from None


# ---------------------------------------------------------------------- the index
def _merge(tasks: Sequence[Task], results: Mapping[int, Index | None], fn: str) -> Index:
    """The parts' shards in input order; every part must have the same layout and fields."""
    first: tuple[Task, Index] | None = None
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
