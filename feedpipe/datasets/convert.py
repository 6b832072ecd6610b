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
import glob
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from feedpipe.datasets._publish import check_remote_destination, publish
from feedpipe.datasets.columns import parse_field
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
from feedpipe.datasets.tables import HFSource, ParquetSource, is_hf_dataset, parquet_paths
from feedpipe.datasets.tar_source import TarSource, is_tar_source, tar_shards
from feedpipe.datasets.writer import (
    DEFAULT_SHARD_BYTES,
    MemmapWriter,
    check_destination,
    shard_name,
)
from feedpipe.errors import DatasetError
from feedpipe.io.progress import progress
from feedpipe.io.remote import local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["ConvertResult", "add_arguments", "convert", "infer_column", "plan_parts", "run"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
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


# ---------------------------------------------------------------------- sources
class _Source:
    """A picklable record source: layout, side fields, and records by range."""

    kind = ""
    shape: tuple[int | None, ...] | None = None  # None: bytes layout; (None, ...): ragged
    dtype = "uint8"
    records = True  # False: no records column (dict samples without "data")
    fields: dict[str, Any]
    extra: dict[str, Any]
    length = 0
    est_bytes = 0

    def fingerprint(self) -> Any:
        raise NotImplementedError

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        """Records ``a..b-1``: an array (fixed) or a list of bytes, plus side-field columns."""
        raise NotImplementedError


class _ImageSource(_Source):
    kind = "images"

    def __init__(self, root: str) -> None:
        classes = sorted(
            e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")
        )
        if not classes:
            raise DatasetError(f"{root}: no class sub-directories (expected ImageFolder layout)")
        self.files: list[str] = []
        labels: list[int] = []
        for label, name in enumerate(classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, name), followlinks=True):
                dirnames.sort()
                for fn in sorted(filenames):
                    if fn.lower().endswith(IMAGE_EXTENSIONS):
                        self.files.append(os.path.join(dirpath, fn))
                        labels.append(label)
        if not self.files:
            raise DatasetError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) found")
        self.root = root
        self.labels = np.asarray(labels, np.int64)
        self.fields = {"label": "int64"}
        self.extra = {"classes": classes, "source": {"kind": "images", "path": root}}
        self.length = len(self.files)
        self.est_bytes = sum(os.path.getsize(f) for f in self.files)

    def fingerprint(self) -> Any:
        return ["images", os.path.abspath(self.root), self.length, self.est_bytes]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        out = []
        for path in self.files[a:b]:
            with open(path, "rb") as f:
                data = f.read()
            if not data:
                raise DatasetError(f"{path}: image file is empty")
            out.append(data)
        return out, {"label": self.labels[a:b]}


class _ArraySource(_Source):
    """``.npy`` files (concatenated) or one ``.npz`` (``data_key`` + aligned side fields)."""

    kind = "npy"

    def __init__(self, paths: Sequence[str], data_key: str | None) -> None:
        self.paths = [os.fspath(p) for p in paths]
        self.data_key = data_key
        arrays = self._load()
        data = arrays["data"]
        self.shape, self.dtype = tuple(data[0].shape[1:]), str(data[0].dtype)
        for path, part in zip(self.paths, data, strict=False):
            if (
                part.ndim == 0
                or tuple(part.shape[1:]) != self.shape
                or str(part.dtype) != self.dtype
            ):
                raise DatasetError(
                    f"{path}: array {part.dtype} {part.shape} does not match the first file's "
                    f"records ({self.dtype} {self.shape})"
                )
        self.length = sum(len(p) for p in data)
        self.fields = {}
        for name, cols in arrays.items():
            if name == "data":
                continue
            col = cols[0]
            if len(col) != self.length:
                raise DatasetError(
                    f"{self.paths[0]}: array {name!r} has {len(col)} rows, data has {self.length}"
                )
            self.fields[name] = (str(col.dtype), tuple(col.shape[1:]))
        self.extra = {"source": {"kind": "npy", "paths": self.paths}}
        rows = math.prod(int(d) for d in self.shape if d is not None)
        self.est_bytes = self.length * rows * np.dtype(self.dtype).itemsize

    def _load(self) -> dict[str, list[np.ndarray]]:
        if len(self.paths) == 1 and self.paths[0].endswith(".npz"):
            path = self.paths[0]
            try:
                z = np.load(path, allow_pickle=False)
                keys = list(z.files)
                key = self.data_key or ("data" if "data" in keys else keys[0])
                if key not in keys:
                    raise DatasetError(f"{path}: no array {key!r} (has {keys})")
                return {"data": [z[key]], **{k: [z[k]] for k in keys if k != key}}
            except (ValueError, OSError, IndexError, EOFError) as exc:
                raise DatasetError(f"{path}: cannot read as .npz: {exc}") from None
        out = []
        for path in self.paths:
            if not path.endswith(".npy"):
                raise DatasetError(f"{path}: expected .npy files or one .npz file")
            try:
                out.append(np.load(path, mmap_mode="r", allow_pickle=False))
            except (ValueError, OSError, EOFError) as exc:
                raise DatasetError(f"{path}: cannot read as .npy: {exc}") from None
        return {"data": out}

    def fingerprint(self) -> Any:
        return [
            "npy",
            [[os.path.abspath(p), os.path.getsize(p)] for p in self.paths],
            self.data_key,
        ]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        arrays = self.__dict__.get("_arrays")
        if arrays is None:
            arrays = self.__dict__["_arrays"] = self._load()
        parts, start = [], 0
        for part in arrays["data"]:
            lo, hi = max(a - start, 0), min(b - start, len(part))
            if lo < hi:
                parts.append(np.asarray(part[lo:hi]))
            start += len(part)
        fields = {k: np.asarray(v[0][a:b]) for k, v in arrays.items() if k != "data"}
        return np.concatenate(parts) if len(parts) > 1 else parts[0], fields

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_arrays"}


class _ZarrSource(_Source):
    kind = "zarr"

    def __init__(self, path: str, data_key: str | None, storage_options: Mapping[str, Any]) -> None:
        from feedpipe.datasets.zarr import ZarrDataset

        self.ds = ZarrDataset(path, storage_options=dict(storage_options))
        names = self.ds.names
        self.key = (
            "" if not self.ds.is_group else (data_key or ("data" if "data" in names else names[0]))
        )
        if self.key not in names:
            raise DatasetError(f"{path}: no array {data_key!r} in the group (has {names})")
        self.shape = self.ds.shapes[self.key][1:]
        self.dtype = str(np.dtype(self.ds.dtype_of(self.key)))
        self.fields = {
            n: (str(self.ds.dtype_of(n)), self.ds.shapes[n][1:]) for n in names if n != self.key
        }
        self.length = len(self.ds)
        self.extra = {"source": {"kind": "zarr", "path": path}}
        self.est_bytes = self.length * int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize
        self.path = path

    def fingerprint(self) -> Any:
        return ["zarr", self.path, self.key, self.length, list(self.shape or ()), self.dtype]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, np.ndarray]]:
        batch = self.ds.read_batch(np.arange(a, b))
        if not self.ds.is_group:
            return batch.numpy(), {}
        data = batch.pop(self.key).numpy()
        return data, {k: v.numpy() for k, v in batch.items()}


class _TorchSource(_Source):
    kind = "torch"

    def __init__(self, dataset: Any) -> None:
        try:
            self.length = len(dataset)
        except TypeError:
            raise DatasetError(f"{type(dataset).__name__}: the dataset has no len()") from None
        if self.length == 0:
            raise DatasetError(f"{type(dataset).__name__}: the dataset is empty")
        self.dataset = dataset
        data, fields = self._split(dataset[0], 0)
        self.records = data is not _NO_DATA
        self.est_bytes = 0
        if not self.records:
            self.shape = ()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            self.shape = None
            self.est_bytes = memoryview(data).nbytes
        else:
            spec = infer_column(data, "record 0: the records ('data')")
            if not isinstance(spec, tuple):
                raise DatasetError(
                    f"record 0: the records ('data') are {type(data).__name__}; the records "
                    "column holds arrays or bytes (use another key to store a str/json field)"
                )
            self.dtype, self.shape = spec
            self.est_bytes = _value_bytes(data)
        self.fields = {}
        for k, v in fields.items():
            self.fields[k] = infer_column(v, f"record 0: field {k!r}")
            self.est_bytes += _value_bytes(v)
        self.est_bytes *= self.length
        self.extra = {"source": {"kind": "torch", "type": type(dataset).__qualname__}}
        classes = getattr(dataset, "classes", None)
        if isinstance(classes, list) and all(isinstance(c, str) for c in classes):
            self.extra["classes"] = classes

    def _split(self, sample: Any, i: int) -> tuple[Any, dict[str, Any]]:
        if isinstance(sample, Mapping):
            for k in sample:
                if not isinstance(k, str) or not k.isidentifier():
                    raise DatasetError(
                        f"record {i}: key {k!r} cannot name a field (a Python identifier)"
                    )
            rest = {k: _to_value(v) for k, v in sample.items() if k != "data"}
            return _to_value(sample["data"]) if "data" in sample else _NO_DATA, rest
        if isinstance(sample, (tuple, list)):
            names = ["label"] if len(sample) == 2 else [f"field{j}" for j in range(1, len(sample))]
            return _to_value(sample[0]), {
                n: _to_value(v) for n, v in zip(names, sample[1:], strict=True)
            }
        return _to_value(sample), {}

    def fingerprint(self) -> Any:
        return ["torch", type(self.dataset).__qualname__, self.length, self.shape, self.dtype]

    def read(self, a: int, b: int) -> tuple[Any, dict[str, Any]]:
        datas: list[Any] = []
        cols: dict[str, list[Any]] = {k: [] for k in self.fields}
        for i in range(a, b):
            data, fields = self._split(self.dataset[i], i)
            datas.append(data)
            if set(fields) != set(cols):
                raise DatasetError(
                    f"record {i}: fields {sorted(fields)}, record 0 had {sorted(cols)}"
                )
            for k, col in cols.items():
                spec = self.fields[k]
                if not _variable(spec):
                    _check_fixed(fields[k], spec, f"record {i}: field {k!r}")
                col.append(fields[k])
        out = {k: v if _variable(self.fields[k]) else np.stack(v) for k, v in cols.items()}
        if not self.records:
            return None, out
        if self.shape is None or None in self.shape:
            return datas, out
        spec = (self.dtype, self.shape)
        for j, d in enumerate(datas):
            _check_fixed(d, spec, f"record {a + j}")
        return np.stack(datas), out


_NO_DATA: Any = object()  # a dict sample without a "data" key


def infer_column(value: Any, where: str) -> Any:
    """The writer's field spec for a column whose record 0 holds ``value`` (see the module
    docstring); ``DatasetError`` naming ``where`` for a value no column can hold."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, dict):
        return "json"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ("uint8", (None,))
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError:  # nested lists of varying lengths: not an array
            arr = None
        if arr is not None and arr.size == 0 and arr.ndim == 1:
            return ("int64", (None,))  # no element to tell: token ids are the common case
        if arr is not None and arr.dtype.kind in "biuf" and arr.ndim >= 1:
            return (str(arr.dtype), (None, *arr.shape[1:]))
        return "json"
    if isinstance(value, np.ndarray):
        try:
            check_dtype(value.dtype, where)
        except ValueError as exc:
            raise DatasetError(str(exc)) from None
        return (str(value.dtype), tuple(value.shape))
    raise DatasetError(
        f"{where}: cannot store a {type(value).__name__} (arrays, tensors, numbers, str, "
        "bytes, lists and dicts of JSON values can be stored)"
    )


def _variable(spec: Any) -> bool:
    """Whether a writer field spec is a variable-length column (str, json, ragged)."""
    if isinstance(spec, str):
        return spec in ("str", "json")
    return isinstance(spec, tuple) and len(spec[1]) > 0 and spec[1][0] is None


def _value_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (bytes, bytearray, memoryview)):
        return memoryview(value).nbytes
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace"))
    if isinstance(value, list):
        return 8 * len(value)
    return 64


def _to_value(value: Any) -> Any:
    """A sample's value as the writer takes it: tensors and numbers as numpy arrays, the rest
    (bytes, str, lists, dicts) as is."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return np.asarray(value)
    return value


def _check_fixed(value: Any, spec: Any, where: str) -> None:
    dtype, shape = spec
    if (
        not isinstance(value, np.ndarray)
        or value.shape != tuple(shape)
        or str(value.dtype) != dtype
    ):
        got = (
            f"{value.dtype} {value.shape}"
            if isinstance(value, np.ndarray)
            else type(value).__name__
        )
        hint = " (variable-length arrays: return a list, e.g. .tolist())"
        raise DatasetError(
            f"{where}: expected {dtype} {tuple(shape)} like record 0, got {got}"
            + (hint if isinstance(value, np.ndarray) and value.ndim == len(shape) else "")
        )


def _make_source(
    source: Any, kind: str, data_key: str | None, storage_options: Mapping[str, Any]
) -> _Source:
    if kind == "auto":
        if not isinstance(source, (str, os.PathLike, list, tuple)):
            kind = "hf" if is_hf_dataset(source) else "torch"
        else:
            first = local_file_path(source[0] if isinstance(source, (list, tuple)) else source)
            if is_tar_source(first):
                kind = "tar"
            elif first.endswith(".parquet") or (
                os.path.isdir(first) and glob.glob(os.path.join(first, "*.parquet"))
            ):
                kind = "parquet"
            elif first.endswith((".npy", ".npz")):
                kind = "npy"
            elif "://" in first or os.path.exists(os.path.join(first, "zarr.json")):
                kind = "zarr"
            elif os.path.isdir(first):
                kind = "images"
            else:
                raise DatasetError(f"{first}: cannot tell the source kind (pass kind=...)")
    if kind == "torch":
        return _TorchSource(source)
    if kind == "hf":
        return HFSource(source, data_key)  # type: ignore[return-value]
    items = source if isinstance(source, (list, tuple)) else [source]
    paths = [local_file_path(p) for p in items]
    if kind == "parquet":
        return ParquetSource(  # type: ignore[return-value]
            parquet_paths(paths, storage_options), data_key, storage_options
        )
    if kind == "tar":
        return TarSource(tar_shards(paths), data_key, storage_options)  # type: ignore[return-value]
    for p in paths:
        if "://" not in p and not os.path.exists(p):
            raise DatasetError(f"{p}: source does not exist")
    if kind == "npy":
        return _ArraySource(paths, data_key)
    if len(paths) != 1:
        raise DatasetError(f"{kind} conversion takes one source path, got {len(paths)}")
    if kind == "zarr":
        return _ZarrSource(paths[0], data_key, storage_options)
    if kind == "images":
        return _ImageSource(paths[0])
    raise ValueError(f"unknown kind {kind!r} (auto, images, npy, zarr, parquet, tar, hf, torch)")


# ---------------------------------------------------------------------- parts
_QUEUE: Any = None


def _init_worker(queue: Any) -> None:
    global _QUEUE
    _QUEUE = queue


def _write_part(src: _Source, part_dir: str, a: int, b: int, shard_bytes: int) -> int:
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
    check_destination(dest, overwrite=overwrite)
    src = _make_source(source, kind, data_key, options)
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
    if check_destination(dest, overwrite=overwrite):  # re-checked: only our dataset is replaced
        old = f"{dest}.old-{os.getpid()}"
        os.replace(dest, old)
        os.replace(work, dest)
        shutil.rmtree(old)
    else:
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty
        os.replace(work, dest)
    return ConvertResult(
        dest,
        index.num_records,
        index.total_bytes,
        len(index.shards),
        time.monotonic() - start,
        len(done),
    )


def plan_parts(src: _Source, shard_bytes: int) -> list[int]:
    """Part boundaries (record numbers) from the source and ``shard_bytes`` alone, never from
    the worker count: fixed-size records fill each part up to one shard exactly; other
    layouts split the estimated bytes into parts of about one shard."""
    n = src.length
    fixed = src.records and src.shape is not None and None not in src.shape
    if fixed and not any(_variable(f) for f in src.fields.values()):
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
        p = os.fspath(item)
        if "://" in p:
            continue
        r = os.path.realpath(p)
        if d == r or d.startswith(r.rstrip("/") + "/") or r.startswith(d.rstrip("/") + "/"):
            raise DatasetError(
                f"{dest}: the destination overlaps the source {p} (did you forget DEST?)"
            )


def _check_layout(src: _Source) -> None:
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


def _describe(src: _Source) -> str:
    where = src.extra.get("source", {})
    paths = where.get("paths")
    return str(
        where.get("path") or (", ".join(paths) if paths else "") or where.get("type") or src.kind
    )


def _run_parts(  # noqa: PLR0917
    src: _Source,
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
def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in units else t) * mult)


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
    parser.add_argument("--shard-size", default="256MiB", type=_parse_size, help="e.g. 256MiB")
    parser.add_argument("--workers", type=int, default=None, help="parallel processes")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset (datasets only)"
    )
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for DEST")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--fn",
        default=None,
        metavar="MODULE:FUNCTION",
        help="run this function (package.module:function) over the SOURCE items in parallel; "
        "it returns or yields records (docs/guides/parallel-convert.md)",
    )
    parser.add_argument(
        "--inputs-per-part", type=int, default=None, help="with --fn: inputs per part"
    )


def run(args: argparse.Namespace) -> int:
    sources = args.source if len(args.source) > 1 else args.source[0]
    if getattr(args, "fn", None):
        from feedpipe.datasets.convert_fn import convert_fn, load_function

        try:
            result = convert_fn(
                load_function(args.fn),
                args.source,
                args.dest,
                num_workers=args.workers,
                inputs_per_part=args.inputs_per_part,
                shard_bytes=args.shard_size,
                overwrite=args.overwrite,
                progress_bar=False if args.no_progress else None,
                storage_options=(
                    {"client_kwargs": {"endpoint_url": args.endpoint_url}}
                    if args.endpoint_url
                    else None
                ),
            )
        except (DatasetError, ValueError) as exc:
            print(f"feedpipe convert: error: {exc}", file=sys.stderr)
            return 1
        print(result.summary())
        return 0
    try:
        result = convert(
            sources,
            args.dest,
            kind=args.kind,
            data_key=args.data_key,
            shard_bytes=args.shard_size,
            workers=args.workers,
            overwrite=args.overwrite,
            progress_bar=False if args.no_progress else None,
            storage_options=(
                {"client_kwargs": {"endpoint_url": args.endpoint_url}}
                if args.endpoint_url
                else None
            ),
        )
    except DatasetError as exc:
        print(f"feedpipe convert: error: {exc}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0
