"""The record sources of ``feedpipe convert`` (see :mod:`feedpipe.datasets.convert`): an image
folder, ``.npy``/``.npz`` files, Zarr, an indexable torch dataset, and the choice among them and
the Parquet, Hugging Face and tar sources (``make_source``). A source is picklable: the parts of a
conversion read it in worker processes.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from feedpipe.datasets.record_source import Source
from feedpipe.datasets.tables import HFSource, ParquetSource, is_hf_dataset, parquet_paths
from feedpipe.datasets.tar_source import TarSource, is_tar_source, tar_shards
from feedpipe.errors import DatasetError
from feedpipe.format import (
    check_dtype,
)
from feedpipe.io.remote import is_url, local_file_path

__all__ = [
    "IMAGE_EXTENSIONS",
    "SOURCE_KINDS",
    "ArraySource",
    "ImageSource",
    "Source",
    "TorchSource",
    "ZarrSource",
    "detect_kind",
    "infer_column",
    "is_variable",
    "make_source",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageSource(Source):
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


class ArraySource(Source):
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


class ZarrSource(Source):
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


class TorchSource(Source):
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
                if not is_variable(spec):
                    _check_fixed(fields[k], spec, f"record {i}: field {k!r}")
                col.append(fields[k])
        out = {k: v if is_variable(self.fields[k]) else np.stack(v) for k, v in cols.items()}
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


def is_variable(spec: Any) -> bool:
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


def _all_paths(source: Any) -> bool:
    """Whether ``source`` is a path or a list of paths (not a list of samples)."""
    if isinstance(source, (str, os.PathLike)):
        return True
    return bool(source) and all(isinstance(p, (str, os.PathLike)) for p in source)


def _is_parquet(first: str) -> bool:
    return first.endswith(".parquet") or bool(
        os.path.isdir(first) and glob.glob(os.path.join(first, "*.parquet"))
    )


def _is_zarr(first: str) -> bool:
    return is_url(first) or os.path.exists(os.path.join(first, "zarr.json"))


# what a source path is, tried in this order (the first that holds decides)
_PATH_KINDS: tuple[tuple[Callable[[str], bool], str], ...] = (
    (is_tar_source, "tar"),
    (_is_parquet, "parquet"),
    (lambda first: first.endswith((".npy", ".npz")), "npy"),
    (_is_zarr, "zarr"),
)


def detect_kind(source: Any) -> str:
    """The kind of ``source`` for ``kind="auto"``: its first path's, else ``hf`` or ``torch``
    (a list of samples is an indexable dataset like any other)."""
    if not isinstance(source, (str, os.PathLike, list, tuple)) or not _all_paths(source):
        return "hf" if is_hf_dataset(source) else "torch"
    first = local_file_path(source[0] if isinstance(source, (list, tuple)) else source)
    for test, kind in _PATH_KINDS:
        if test(first):
            return kind
    if os.path.isdir(first) and glob.glob(os.path.join(glob.escape(first), "*.np[yz]")):
        raise DatasetError(
            f"{first}: a folder of .npy/.npz files; name the files in the order to "
            f"concatenate them (e.g. {os.path.join(first, '*.npy')})"
        )
    if os.path.isdir(first):
        return "images"
    if not os.path.lexists(first):
        raise DatasetError(f"{first}: source does not exist")
    raise DatasetError(f"{first}: cannot tell the source kind (pass kind=...)")


def _paths(source: Any) -> list[str]:
    items = source if isinstance(source, (list, tuple)) else [source]
    return [local_file_path(p) for p in items]


def _existing(source: Any) -> list[str]:
    paths = _paths(source)
    for p in paths:
        if not is_url(p) and not os.path.exists(p):
            raise DatasetError(f"{p}: source does not exist")
    return paths


def _one(kind: str, source: Any) -> str:
    paths = _existing(source)
    if len(paths) != 1:
        raise DatasetError(f"{kind} conversion takes one source path, got {len(paths)}")
    return paths[0]


SourceFactory = Callable[[Any, "str | None", Mapping[str, Any]], Source]

#: The source kinds ``convert`` takes, by name: ``factory(source, data_key, storage_options)``.
SOURCE_KINDS: dict[str, SourceFactory] = {
    "torch": lambda source, key, opts: TorchSource(source),
    "hf": lambda source, key, opts: HFSource(source, key),
    "parquet": lambda source, key, opts: ParquetSource(
        parquet_paths(_paths(source), opts), key, opts
    ),
    "tar": lambda source, key, opts: TarSource(tar_shards(_paths(source)), key, opts),
    "npy": lambda source, key, opts: ArraySource(_existing(source), key),
    "zarr": lambda source, key, opts: ZarrSource(_one("zarr", source), key, opts),
    "images": lambda source, key, opts: ImageSource(_one("images", source)),
}


def make_source(
    source: Any, kind: str, data_key: str | None, storage_options: Mapping[str, Any]
) -> Source:
    """The source of ``kind`` (``"auto"``: :func:`detect_kind`) over ``source``."""
    if kind == "auto":
        kind = detect_kind(source)
    factory = SOURCE_KINDS.get(kind)
    if factory is None:
        if _all_paths(source):
            _one(kind, source)  # a missing path is named first, as for any path kind
        raise ValueError(
            f"unknown kind {kind!r} (auto, images, npy, zarr, parquet, tar, hf, torch)"
        )
    return factory(source, data_key, storage_options)
