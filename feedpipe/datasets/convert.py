"""``feedpipe convert``: build a memmap dataset from images, ``.npy``/``.npz``, Zarr or torch.

Sources:

- an image folder (one sub-directory per class, like torchvision's ImageFolder): the bytes layout
  holding each encoded file as is, a ``label`` field, and the class names under ``"classes"``;
- ``.npy`` files (concatenated along the first axis) or one ``.npz`` (aligned arrays; ``data_key``
  is the records, the others become side fields);
- a Zarr v3 array, or a group (``data_key`` plus aligned side fields);
- WebDataset ``.tar`` shards, local or remote (``feedpipe.datasets.tar_source``);
- Parquet files (a file, a folder or a glob) and Hugging Face ``datasets.Dataset`` objects
  (Python API), read as Arrow tables (``feedpipe.datasets.tables``; extras ``parquet``/``hf``);
- any indexable torch dataset (Python API): samples are arrays/tensors, bytes, ``(x, y, ...)``
  tuples (``label`` and ``field1``... side fields) or dicts with any keys (``"data"``, when
  present, is the records column; without it every key is a field and there is no records
  column). Each value's column type comes from record 0 (:func:`infer_column`): an array or
  tensor is fixed-size, a list of numbers a ragged array, ``str`` a string column, a ``dict``
  a JSON column, ``bytes`` the bytes layout (records) or a ragged uint8 array (a field).
  What cannot be stored is refused before anything is written, naming the record and field;
  a later record that does not fit its column fails the conversion naming it, and no
  dataset appears.

The records are split into parts written in parallel, each a small dataset in
``DEST.partial/part-NNNNN``. A part is complete once its own index exists, so an interrupted run
resumes where it stopped (complete parts are kept). At the end the parts' shard files are
hard-linked into place, the final ``index.json`` is written last and ``DEST.partial`` is renamed
to ``DEST``: an interrupted conversion never looks complete. The parts, and so the shards, depend
only on the source and ``shard_bytes`` (:func:`plan_parts`), never on ``workers``: the worker
count changes the speed, not one byte of the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from feedpipe.datasets._publish import check_remote_destination, publish
from feedpipe.datasets.columns import parse_field
from feedpipe.datasets.convert_sources import Source, infer_column, is_variable, make_source
from feedpipe.datasets.destination import check_convert_destination, replace_dataset
from feedpipe.datasets.format import (
    FileInfo,
    Index,
    Layout,
    Shard,
    check_dtype,
    check_field_names,
    check_shape,
    read_index,
    write_index,
)
from feedpipe.datasets.writer import DEFAULT_SHARD_BYTES, MemmapWriter, shard_name
from feedpipe.errors import DatasetError
from feedpipe.io.cliargs import add_storage_arguments, byte_size, positive_int, storage_options
from feedpipe.io.progress import progress
from feedpipe.io.remote import is_url, local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["ConvertResult", "add_arguments", "convert", "infer_column", "plan_parts", "run"]

_CHUNK = 512  # records read and appended at a time
_PLAN = "plan.json"


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion produced."""

    path: str
    records: int
    bytes: int
    shards: int
    seconds: float
    resumed_parts: int

    def summary(self) -> str:
        mib = self.bytes / (1 << 20)
        rate = mib / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"{self.path}: {self.records} records, {mib:.1f} MiB in {self.shards} shards, "
            f"{self.seconds:.1f} s ({rate:.0f} MiB/s)"
            + (f", {self.resumed_parts} parts resumed" if self.resumed_parts else "")
        )


# ---------------------------------------------------------------------- parts
_QUEUE: Any = None


def _init_worker(queue: Any) -> None:
    global _QUEUE
    _QUEUE = queue


def _write_part(src: Source, part_dir: str, a: int, b: int, shard_bytes: int) -> int:
    """Write records ``a..b-1`` as a small dataset in ``part_dir``; return records written."""
    if os.path.exists(part_dir):
        shutil.rmtree(part_dir)  # an incomplete part from an interrupted run
    with MemmapWriter(
        part_dir,
        shape=src.shape,
        dtype=src.dtype,
        fields=src.fields,
        shard_bytes=shard_bytes,
        records=src.records,
        first_record=a,
    ) as w:
        for lo in range(a, b, _CHUNK):
            hi = min(b, lo + _CHUNK)
            try:
                records, fields = src.read(lo, hi)
                w.append_batch(records, **fields)
            except DatasetError as exc:  # the part's temp folder means nothing to the user
                why = str(exc).removeprefix(f"{part_dir}: ")
                raise DatasetError(f"converting records {lo}..{hi - 1}: {why}") from None
            if _QUEUE is not None:
                _QUEUE.put(src.est_bytes * (hi - lo) // max(src.length, 1))
    return b - a


def _part_complete(part_dir: str) -> bool:
    try:
        read_index(part_dir)
    except DatasetError:
        return False
    return True


def _merge(work: str, parts: list[str], extra: dict[str, Any]) -> Index:
    """Hard-link the parts' shard files into ``work`` with global shard numbers; write the index."""
    shards: list[Shard] = []
    layout, fields = None, None
    for part in parts:
        idx = read_index(part)
        layout, fields = idx.layout, idx.fields
        for shard in idx.shards:
            sid = len(shards)
            files = {}
            for role, info in shard.files.items():
                suffix = info.path.split(".", 1)[1]
                rel = shard_name(sid, suffix)
                dst = os.path.join(work, rel)
                if os.path.exists(dst):
                    os.unlink(dst)
                os.link(os.path.join(part, info.path), dst)
                files[role] = FileInfo(rel, info.bytes, info.crc32c)
            shards.append(Shard(shard.records, files))
    assert layout is not None and fields is not None
    index = Index(layout, fields, shards, extra)
    write_index(work, index)
    return index


def convert(
    source: Any,
    dest: Any = None,
    *,
    kind: str = "auto",
    data_key: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int | None = None,
    overwrite: bool = False,
    progress_bar: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **fn_options: Any,
) -> ConvertResult:
    """Convert ``source`` into a memmap dataset at ``dest`` (see the module docstring).

    ``convert(fn, inputs, output=..., num_workers=...)`` with a function first runs ``fn`` over
    ``inputs`` in parallel instead (:func:`feedpipe.datasets.convert_fn.convert_fn`).
    """
    if callable(source) and not hasattr(source, "__getitem__"):
        from feedpipe.datasets.convert_fn import convert_fn

        if workers is not None:
            fn_options.setdefault("num_workers", workers)
        return convert_fn(
            source,
            dest,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            progress_bar=progress_bar,
            storage_options=storage_options,
            **fn_options,
        )
    if fn_options:
        raise TypeError(f"convert() got unexpected keyword arguments {sorted(fn_options)}")
    if dest is None:
        raise TypeError("convert() missing the destination argument 'dest'")
    start = time.monotonic()
    dest = os.fspath(dest).rstrip("/")
    options = dict(storage_options or {})
    if _remote.is_remote(dest):  # convert into a local temp folder, then publish (index last)
        check_remote_destination(dest, options, overwrite=overwrite)
        with tempfile.TemporaryDirectory(prefix="feedpipe-convert-") as tmp:
            local = convert(
                source,
                os.path.join(tmp, "dataset"),
                kind=kind,
                data_key=data_key,
                shard_bytes=shard_bytes,
                workers=workers,
                progress_bar=progress_bar,
                storage_options=options,
            )
            publish(local.path, dest, options, overwrite=overwrite)
        return dataclasses.replace(local, path=dest, seconds=time.monotonic() - start)
    dest = local_file_path(dest)
    if not dest or dest == ".":
        raise DatasetError(f"{dest!r}: not a usable destination (name a new folder)")
    _check_not_a_source(source, dest)
    check_convert_destination(dest, overwrite=overwrite)
    src = make_source(source, kind, data_key, options)
    _check_layout(src)
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    n = src.length
    bounds = plan_parts(src, shard_bytes)
    nparts = len(bounds) - 1
    work = dest + ".partial"
    plan = {"fingerprint": src.fingerprint(), "bounds": bounds, "shard_bytes": shard_bytes}
    plan = json.loads(json.dumps(plan))
    plan_path = os.path.join(work, _PLAN)
    old_plan = _read_plan(work, plan_path)
    if old_plan != plan and os.path.exists(work):
        shutil.rmtree(work)  # a different conversion of ours was interrupted here: start over
    os.makedirs(work, exist_ok=True)
    if old_plan != plan:
        with open(plan_path + ".tmp", "w") as f:
            json.dump(plan, f)
        os.replace(plan_path + ".tmp", plan_path)
    parts = [os.path.join(work, f"part-{k:05d}") for k in range(nparts)]
    done = [k for k in range(nparts) if _part_complete(parts[k])]
    todo = [k for k in range(nparts) if k not in set(done)]
    bar = progress(src.est_bytes, f"convert {os.path.basename(dest)}", enabled=progress_bar)
    for k in done:
        bar.update(src.est_bytes * (bounds[k + 1] - bounds[k]) // max(n, 1))
    try:
        if todo:
            _run_parts(src, parts, bounds, todo, shard_bytes, workers, bar)
    finally:
        bar.close()
    index = _merge(work, parts, src.extra)
    for part in parts:
        shutil.rmtree(part)
    os.unlink(plan_path)
    replace_dataset(work, dest, overwrite=overwrite)  # re-checked: only our dataset is replaced
    return ConvertResult(
        dest,
        index.num_records,
        index.total_bytes,
        len(index.shards),
        time.monotonic() - start,
        len(done),
    )


def plan_parts(src: Source, shard_bytes: int) -> list[int]:
    """Part boundaries (record numbers) from the source and ``shard_bytes`` alone, never from
    the worker count: fixed-size records fill each part up to one shard exactly; other
    layouts split the estimated bytes into parts of about one shard."""
    n = src.length
    fixed = src.records and src.shape is not None and None not in src.shape
    if fixed and not any(is_variable(f) for f in src.fields.values()):
        dims = [int(d) for d in src.shape or () if d is not None]
        per = math.prod(dims) * np.dtype(src.dtype).itemsize  # the shard limit counts the data
        per_part = max(1, shard_bytes // per) if per else max(n, 1)
        nparts = max(1, math.ceil(n / per_part))
        return [min(n, k * per_part) for k in range(nparts)] + [n]
    nparts = max(1, min(n, math.ceil(src.est_bytes / shard_bytes)))
    return [n * k // nparts for k in range(nparts + 1)]


def _read_plan(work: str, plan_path: str) -> Any:
    """The plan of an interrupted conversion in ``work``; refuse a ``work`` that is not ours."""
    if not os.path.lexists(work):
        return None
    if os.path.islink(work) or not os.path.isdir(work):
        raise DatasetError(f"{work}: exists and is not a feedpipe conversion folder; move it away")
    try:
        with open(plan_path) as f:
            return json.load(f)
    except FileNotFoundError:
        if os.listdir(work):
            raise DatasetError(
                f"{work}: exists and is not a feedpipe conversion folder (no {_PLAN}); move it away"
            ) from None
        return None
    except (ValueError, RecursionError):
        return {}  # our plan, damaged: start over


def _check_not_a_source(source: Any, dest: str) -> None:
    """``dest`` must not be, hold, or lie inside a source path: sources are never touched."""
    if not isinstance(source, (str, os.PathLike, list, tuple)):
        return
    d = os.path.realpath(dest)
    for item in source if isinstance(source, (list, tuple)) else [source]:
        if not isinstance(item, (str, os.PathLike)):
            return  # a list of samples, not of paths
        p = os.fspath(item)
        if is_url(p):
            continue
        r = os.path.realpath(p)
        if d == r or d.startswith(r.rstrip("/") + "/") or r.startswith(d.rstrip("/") + "/"):
            raise DatasetError(
                f"{dest}: the destination overlaps the source {p} (did you forget DEST?)"
            )


def _check_layout(src: Source) -> None:
    """Refuse, before writing anything, records or fields that could not be read back."""
    try:
        if src.records and src.shape is not None:
            dt = check_dtype(src.dtype, "records")
            dims = src.shape[1:] if src.shape and src.shape[0] is None else src.shape
            check_shape(list(dims), np.dtype(dt).itemsize, "records")
        specs = {name: parse_field(name, spec) for name, spec in src.fields.items()}
        for name in specs:
            if name == "data" or not name.isidentifier():
                raise ValueError(f"invalid side-field name {name!r}")
        if src.records:
            kind = "bytes" if src.shape is None else "ragged" if None in src.shape else "fixed"
            check_field_names(Layout(kind), specs)
        elif not specs:
            raise ValueError("the samples hold no values")
    except ValueError as exc:
        raise DatasetError(f"{_describe(src)}: {exc}") from None


def _describe(src: Source) -> str:
    where = src.extra.get("source", {})
    paths = where.get("paths")
    return str(
        where.get("path") or (", ".join(paths) if paths else "") or where.get("type") or src.kind
    )


def _run_parts(  # noqa: PLR0917
    src: Source,
    parts: list[str],
    bounds: list[int],
    todo: list[int],
    shard_bytes: int,
    workers: int,
    bar: Any,
) -> None:
    if workers == 1 or len(todo) == 1:
        global _QUEUE
        _QUEUE = None
        for k in todo:
            _write_part(src, parts[k], bounds[k], bounds[k + 1], shard_bytes)
            bar.update(src.est_bytes * (bounds[k + 1] - bounds[k]) // max(src.length, 1))
        return
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    queue = ctx.Queue()
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)
    ) as pool:
        pending: set[Future[int]] = {
            pool.submit(_write_part, src, parts[k], bounds[k], bounds[k + 1], shard_bytes)
            for k in todo
        }
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(queue, bar)
                for fut in finished:
                    fut.result()  # re-raises a worker's error
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        _drain(queue, bar)


def _drain(queue: Any, bar: Any) -> None:
    import queue as queue_mod

    while True:
        try:
            bar.update(queue.get_nowait())
        except queue_mod.Empty:
            return


# ---------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        nargs="+",
        help="image folder, .npy files, one .npz, a Zarr array/group, Parquet files "
        "(files, a folder or a glob) or WebDataset .tar shards",
    )
    parser.add_argument("dest", help="output dataset folder (new or empty), or an fsspec URL")
    parser.add_argument(
        "--kind", default="auto", choices=["auto", "images", "npy", "zarr", "parquet", "tar"]
    )
    parser.add_argument(
        "--data-key", default=None, help="records array in a .npz or Zarr group, or column"
    )
    parser.add_argument("--shard-size", default="256MiB", type=byte_size, help="e.g. 256MiB")
    parser.add_argument("--workers", type=positive_int, default=None, help="parallel processes")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset (datasets only)"
    )
    add_storage_arguments(parser, endpoint_help="S3-compatible endpoint for DEST")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--fn",
        default=None,
        metavar="MODULE:FUNCTION",
        help="run this function (package.module:function) over the SOURCE items in parallel; "
        "it returns or yields records (docs/guides/parallel-convert.md)",
    )
    parser.add_argument(
        "--inputs-per-part", type=positive_int, default=None, help="with --fn: inputs per part"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``feedpipe convert``; errors go to the CLI's one handler (one redacted line)."""
    options = storage_options(args) or None
    bar = False if args.no_progress else None
    fn = getattr(args, "fn", None)
    if fn:
        from feedpipe.datasets.convert_fn import convert_fn, load_function

        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # --fn mod:func finds ./mod.py, as python -m does
        try:  # a function's import or signature problem is the user's input too
            result = convert_fn(
                load_function(fn),
                args.source,
                args.dest,
                num_workers=args.workers,
                inputs_per_part=args.inputs_per_part,
                shard_bytes=args.shard_size,
                overwrite=args.overwrite,
                progress_bar=bar,
                storage_options=options,
            )
        except ValueError as exc:
            raise DatasetError(str(exc)) from None
    else:
        result = convert(
            args.source if len(args.source) > 1 else args.source[0],
            args.dest,
            kind=args.kind,
            data_key=args.data_key,
            shard_bytes=args.shard_size,
            workers=args.workers,
            overwrite=args.overwrite,
            progress_bar=bar,
            storage_options=options,
        )
    print(result.summary())
    return 0
