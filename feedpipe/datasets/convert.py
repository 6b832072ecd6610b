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
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from feedpipe.datasets._convert_work import WorkFolder
from feedpipe.datasets._part_pool import drain, pool_context, report, set_queue, worker_count
from feedpipe.datasets._publish import check_remote_destination, publish
from feedpipe.datasets.columns import parse_field
from feedpipe.datasets.convert_result import ConvertResult
from feedpipe.datasets.convert_sources import Source, infer_column, is_variable, make_source
from feedpipe.datasets.destination import check_convert_destination, replace_dataset
from feedpipe.datasets.writer import DEFAULT_SHARD_BYTES, MemmapWriter
from feedpipe.errors import DatasetError
from feedpipe.format import Layout, check_dtype, check_field_names, check_shape
from feedpipe.io.cliargs import add_storage_arguments, byte_size, positive_int, storage_options
from feedpipe.io.progress import progress
from feedpipe.io.remote import is_url, local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["ConvertResult", "add_arguments", "convert", "infer_column", "plan_parts", "run"]

_CHUNK = 512  # records read and appended at a time


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
    options = ConvertOptions(
        kind, data_key, shard_bytes, workers, overwrite, progress_bar, dict(storage_options or {})
    )
    return ConvertJob(source, os.fspath(dest).rstrip("/"), options).run()


@dataclass(frozen=True)
class ConvertOptions:
    """How to convert, as :func:`convert` was called (``workers`` None: up to 4, one per CPU)."""

    kind: str = "auto"
    data_key: str | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    workers: int | None = None
    overwrite: bool = False
    progress_bar: bool | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        worker_count(self.workers, "workers")  # a bad count fails before any work

    @property
    def processes(self) -> int:
        """The worker processes to use."""
        return worker_count(self.workers, "workers")


class ConvertJob:
    """One conversion of ``source`` into a dataset at ``dest``: a remote ``dest`` is converted
    into a local temporary folder and then published (index last); a local one is built in
    its work folder (:class:`~feedpipe.datasets._convert_work.WorkFolder`) from parts written
    in parallel, then renamed into place."""

    def __init__(self, source: Any, dest: str, options: ConvertOptions) -> None:
        self.source, self.dest, self.options = source, dest, options
        self.start = time.monotonic()

    def run(self) -> ConvertResult:
        if _remote.is_remote(self.dest):
            return self._run_remote()
        return self._run_local(self._local_dest())

    def _run_remote(self) -> ConvertResult:
        opts = self.options
        check_remote_destination(self.dest, opts.storage_options, overwrite=opts.overwrite)
        with tempfile.TemporaryDirectory(prefix="feedpipe-convert-") as tmp:
            local_opts = replace(opts, overwrite=False)
            local = ConvertJob(self.source, os.path.join(tmp, "dataset"), local_opts).run()
            publish(local.path, self.dest, opts.storage_options, overwrite=opts.overwrite)
        return replace(local, path=self.dest, seconds=time.monotonic() - self.start)

    def _local_dest(self) -> str:
        dest = local_file_path(self.dest)
        if not dest or dest == ".":
            raise DatasetError(f"{dest!r}: not a usable destination (name a new folder)")
        _check_not_a_source(self.source, dest)
        check_convert_destination(dest, overwrite=self.options.overwrite)
        return dest

    def _run_local(self, dest: str) -> ConvertResult:
        opts = self.options
        src = make_source(self.source, opts.kind, opts.data_key, opts.storage_options)
        _check_layout(src)
        parts = Parts(src, plan_parts(src, opts.shard_bytes), opts.shard_bytes)
        work = WorkFolder(dest + ".partial", parts.count)
        done = work.open(parts.plan())
        todo = [k for k in range(parts.count) if k not in set(done)]
        bar = progress(
            src.est_bytes, f"convert {os.path.basename(dest)}", enabled=opts.progress_bar
        )
        for k in done:
            bar.update(parts.est_bytes(k))
        try:
            if todo:
                parts.run(work.parts, todo, opts.processes, bar)
        finally:
            bar.close()
        index = work.merge(src.extra)
        replace_dataset(work.path, dest, overwrite=opts.overwrite)  # only our dataset is replaced
        return ConvertResult.of(dest, index, time.monotonic() - self.start, len(done))


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


class Parts:
    """The parts of one conversion: record ranges of ``src`` cut at ``bounds``, each written as
    a small dataset, in this process or in a pool of worker processes."""

    def __init__(self, src: Source, bounds: list[int], shard_bytes: int) -> None:
        self.src, self.bounds, self.shard_bytes = src, bounds, shard_bytes
        self.count = len(bounds) - 1

    def plan(self) -> dict[str, Any]:
        """What the work folder's plan records: the conversion is resumed only if it matches."""
        return {
            "fingerprint": self.src.fingerprint(),
            "bounds": self.bounds,
            "shard_bytes": self.shard_bytes,
        }

    def est_bytes(self, k: int) -> int:
        """The estimated bytes of part ``k`` (its share of the progress bar)."""
        return self.src.est_bytes * (self.bounds[k + 1] - self.bounds[k]) // max(self.src.length, 1)

    def run(self, paths: list[str], todo: list[int], workers: int, bar: Any) -> None:
        """Write the parts ``todo`` into ``paths``; a worker's error is re-raised here."""
        args = [
            (self.src, paths[k], self.bounds[k], self.bounds[k + 1], self.shard_bytes) for k in todo
        ]
        if workers == 1 or len(todo) == 1:
            set_queue(None)
            for k, a in zip(todo, args, strict=True):
                _write_part(*a)
                bar.update(self.est_bytes(k))
            return
        ctx = pool_context()
        queue = ctx.Queue()
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=set_queue, initargs=(queue,)
        ) as pool:
            pending: set[Future[int]] = {pool.submit(_write_part, *a) for a in args}
            try:
                while pending:
                    finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    drain(queue, bar)
                    for fut in finished:
                        fut.result()  # re-raises a worker's error
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
            drain(queue, bar)


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
            report(src.est_bytes * (hi - lo) // max(src.length, 1))
    return b - a


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
