"""``MemmapDataset``: a map-style torch dataset over a sharded memmap directory, with batched reads.

The format is described in :mod:`feedpipe.format`; :class:`MemmapWriter` writes it.

Batched reads (:meth:`MemmapDataset.read_batch`, ``__getitems__``) turn a batch of indices into
one vectorised gather with the GIL released. Fixed-size records are read one of two ways
(``read=`` on the dataset):

- ``"mmap"``: ``np.take`` from the mapped shards straight into the destination, with
  ``mode="clip"`` (indices are checked first; with ``mode="raise"`` numpy gathers into a
  temporary and copies it again, which is slower: the ``np.take alone`` rows of the datasets
  section of docs/benchmarks.md). A local dataset maps every shard into one reserved address
  range (:mod:`feedpipe.datasets._gather`), so a batch is one ``np.take`` however many shards it
  touches, and open descriptors do not grow with the number of shards. A remote dataset (shards
  leased from the cache one by one) and one with more shards than the map budget gather shard
  by shard, in file order, then scatter.
  A small batch (under 256 KiB) of a one-file local dataset, asked for by an ``int64``
  index array (what the loader passes) with no ``out``, is one ``take`` that allocates the
  batch and checks each index as it copies, as a hand-written ``np.take`` over a memmap
  does (no ``out``: no temporary); the guard's check runs first, as for every batch.
- ``"pread"``: ``os.preadv`` straight into the destination rows, in file order, adjacent records
  coalesced into one call, every byte count checked (a truncated shard raises).
- ``"auto"`` (default): ``"mmap"``, because it measured faster at every record size and thread
  count (``benchmarks/diagnostics/feed_probe.py --device cpu`` prints both): one ``os.preadv``
  per run of records from Python re-takes the GIL per call, which convoys across threads.
  ``"pread"`` stays available (it never maps the file, so it never faults on first touch).

A CUDA ``out`` skips the host gather: records go by DMA from the page cache to the GPU
(:mod:`feedpipe.device.dma`).

Variable-length records (the bytes layout) and typed columns (ragged arrays, ``str``, ``json``;
the ragged layout) are gathered from the mapped data file, one vectorised gather per column per
shard of the batch (:mod:`feedpipe.datasets.columns`); their descriptors are closed once mapped.

Integrity, for every layout and every process (workers included), in one place
(:mod:`feedpipe.datasets._shard_guard`): a shard file is served only if it has its indexed size
and is the file stat'ed when the dataset was opened, or its bytes match the index's CRC32C;
with ``verify="first-use"`` (the default) every file is also checked against its CRC32C once
before its first record is served (shared by forked workers); a file changed while open
(rewritten in place, truncated) is an error naming it. ``verify=True`` checks every file when
the dataset is opened; ``verify=False`` skips the first-use check, so a corrupted shard is then
read as it is (the cost: the datasets section of docs/benchmarks.md,
``benchmarks/verify_cost.py``).

Transforms (``transform=`` per sample, ``batch_transform=`` per batch) run where the read runs
(the loader's worker): the batch is still read in one gather, then split into samples for
``transform`` and collated as without one (ragged columns padded or nested, ``str``/``json``
as lists, the rest by ``default_collate``: :mod:`._ragged_batch`); ``batch_transform`` gets
the batch.

The dataset owns four objects, each with one concern: :class:`~._memmap_files.ShardSource`
(where the shard files are, local or through the remote cache, and what each must be),
:class:`~._memmap_open.ShardFiles` (this process's open files and maps, where a record is, in
which order to read a batch's shards), :class:`~._memmap_fixed.FixedRecords` (the gathers of
fixed-size records) and :class:`~._memmap_columns.ColumnReader` (bytes records, typed columns,
side fields). Each pickles without its open files, so a worker opens its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._gather import ShardSpace, indices_array
from feedpipe.datasets._memmap_columns import ColumnReader
from feedpipe.datasets._memmap_files import VERIFY_MODES, ShardSource, verify_files
from feedpipe.datasets._memmap_fixed import FixedRecords
from feedpipe.datasets._memmap_open import ShardFiles
from feedpipe.datasets._ragged_batch import collate_ragged
from feedpipe.datasets.columns import RAGGED_MODES, variable_columns
from feedpipe.datasets.writer import MemmapWriter

__all__ = ["MemmapDataset", "MemmapWriter", "verify_files"]

_READS = ("auto", "mmap", "pread")
_INT64 = np.dtype(np.int64)


def _check_options(
    read: str, verify: Any, ragged: str, transforms: dict[str, Callable[[Any], Any] | None]
) -> None:
    """Refuse a ``read``, ``verify`` or ``ragged`` mode or a transform the dataset cannot take."""
    if read not in _READS:
        raise ValueError(f"read must be one of {_READS}, got {read!r}")
    if not (isinstance(verify, bool) or (isinstance(verify, str) and verify in VERIFY_MODES)):
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if ragged not in RAGGED_MODES:
        raise ValueError(f"ragged must be one of {RAGGED_MODES}, got {ragged!r}")
    for what, fn in transforms.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{what} must be callable, got {type(fn).__name__}")


class MemmapDataset(torch.utils.data.Dataset[Any]):
    """Map-style dataset over a directory written by :class:`MemmapWriter`.

    ``ds[i]`` is a tensor (fixed layout), a 1-D uint8 tensor (bytes layout), a tensor of
    varying first dimension (ragged layout), or a dict ``{"data": ..., "<field>": ...}`` when
    the dataset has side fields (no ``"data"`` with ``records=False``); a ``str`` field is a
    ``str``, a ``json`` field the decoded value. ``verify``: ``"first-use"`` (default) checks
    each file's CRC32C once before its first record is served, ``True`` every file's on open,
    ``False`` none (a corrupted shard is then read silently; see the module docstring).
    ``read`` (``"auto"``, ``"mmap"`` or ``"pread"``) picks how batches of fixed-size
    records are read (see the module docstring).

    Batches of ragged columns (``ragged=``): ``"pad"`` (default) pads each to the longest
    record with ``pad_value`` (default 0) and adds an int64 ``NAME_lengths`` tensor (rows per
    record; the records column is ``data``); ``"nested"`` gives a jagged
    ``torch.nested`` tensor (``layout=torch.jagged``) instead, no lengths. ``str`` and ``json``
    fields come back as lists.

    ``transform`` (per sample: ``fn(sample) -> sample``) applies to ``ds[i]`` and to every
    sample of a batch, which is then collated as the batch without it; ``batch_transform``
    (``fn(batch) -> batch``) applies to what ``read_batch`` returns (after ``transform``), not
    to ``ds[i]``. Both run in the worker that reads; with process workers they must pickle.
    Pickles cheaply: files are reopened lazily in each process.

    A remote URL (``s3://...``) is read through a :class:`feedpipe.cache.ShardCache` in
    ``cache_dir`` (lazy mode). With ``cache_limit_bytes``, a shard is leased only while it is
    read, plus idle shards kept open up to a third of the limit; when a download waits for
    room, readers end their idle leases, so an epoch over more shards than the limit holds
    evicts shards instead of waiting: the one needed farthest in the future when the loader
    plans the reads (:meth:`plan_ahead`), else the least recently used.
    """

    #: ``read_batch`` takes numpy index arrays (:class:`feedpipe.protocols.IndexArrayDataset`).
    takes_index_arrays = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool | str = "first-use",
        read: str = "auto",
        ragged: str = "pad",
        pad_value: float = 0,
        transform: Callable[[Any], Any] | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        fns = {"transform": transform, "batch_transform": batch_transform}
        _check_options(read, verify, ragged, fns)
        self.read, self.ragged = read, ragged
        self.transform, self.batch_transform = transform, batch_transform
        source = self._source = ShardSource(
            path,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
            verify=verify,
        )
        self.path, self.storage_options = source.path, source.storage_options
        self._remote = source.remote
        self.cache_dir, self.cache_limit_bytes = source.cache_dir, cache_limit_bytes
        self._shown = source.shown
        self.index = index = source.index
        layout = index.layout
        self.kind, self.shape, self.dtype = layout.kind, layout.shape, np.dtype(layout.dtype)
        self.fields = dict(index.fields)
        self.classes: list[str] | None = index.extra.get("classes")
        self._record_bytes = layout.record_bytes
        counts = np.cumsum([s.records for s in index.shards], dtype=np.int64)
        starts = np.concatenate([[0], counts]).astype(np.int64)
        self._len = int(starts[-1])
        self._var_cols = variable_columns(layout, self.fields)
        self._files = ShardFiles(
            source, kind=self.kind, read=read, starts=starts, record_bytes=self._record_bytes
        )
        self._columns = ColumnReader(self._files, self.fields, self._var_cols, pad_value)
        self.pad_value = pad_value  # checked against the ragged columns
        self._plain = self.kind == "fixed" and not self.fields  # a batch is one gather
        self._fixed = FixedRecords(
            self._files,
            shape=self.shape,
            dtype=self.dtype,
            record_bytes=self._record_bytes,
            read=read,
        )

    @property
    def pad_value(self) -> Any:
        """What ragged columns are padded with (``pad_value=``); an assignment pads every later
        batch (this dataset's and a mix's) with the new value, checked against the columns."""
        return self._columns.pad_value

    @pad_value.setter
    def pad_value(self, value: Any) -> None:
        for col in self._var_cols.values():
            if col.kind == "ragged" and np.array(value).astype(col.dtype) != value:
                raise ValueError(f"pad_value {value!r} does not fit column {col.name!r}")
        self._columns.pad_value = value

    # ------------------------------------------------------------------ indexing
    def __len__(self) -> int:
        return self._len

    # ------------------------------------------ access plan (feedpipe.protocols.AccessPlanDataset)
    def plan_horizon(self) -> int:
        """Samples ahead of its reads this dataset wants to know: some only for a remote dataset
        behind a bounded cache, whose eviction then follows the plan (Belady)."""
        limit = self.cache_limit_bytes
        if not self._source.planned or limit is None:
            return 0
        from feedpipe.remote.plan import horizon_samples

        total = sum(s.files["data"].bytes for s in self.index.shards)
        return horizon_samples(limit, total, self._len)

    def plan_start(self) -> None:
        """A new pass begins: forget the planned reads."""
        if self._source.planned:
            self._source.cache().plan.clear()

    def plan_ahead(self, indices: Sequence[int] | np.ndarray) -> None:
        """A batch ``read_batch`` will read later, after those planned before it."""
        if not self._source.planned:
            return
        from feedpipe.remote.plan import batch_key

        try:
            idx = self._normalize(indices)
        except (IndexError, TypeError, ValueError):
            return  # not planned: read_batch raises for it, in the worker, naming the batch
        shards = np.unique(self._files.locate(idx)[0]) if len(idx) else ()
        data = [self.index.shards[int(s)].files["data"].path for s in shards]
        self._source.cache().plan.add(batch_key(idx), data)

    def _plan_started(self, idx: np.ndarray) -> None:
        """This thread starts reading ``idx``: a planned read leaves the plan's future."""
        if not self._remote:
            return
        cache = self._source.made_cache
        if cache is not None and cache.plan:
            from feedpipe.remote.plan import batch_key

            cache.plan.start(batch_key(idx))

    def _normalize(self, indices: Any) -> np.ndarray:
        return indices_array(indices, self._len, self._out_of_range)

    def _out_of_range(self, i: int) -> str:
        return f"index {i} is out of range for {self._shown} (length {self._len})"

    def __getitem__(self, index: int) -> Any:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            if isinstance(index, torch.Tensor) and index.ndim == 0:
                index = int(index)
            else:
                raise TypeError(f"index must be an int, got {type(index).__name__}")
        i = int(index)
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} is out of range for {self._shown} (length {self._len})")
        i %= self._len if self._len else 1
        sample = self._getitem(i)
        return sample if self.transform is None else self.transform(sample)

    def _getitem(self, i: int) -> Any:
        if self._var_cols or self.kind == "none":
            return self._samples(np.array([i], np.int64))[0]
        sid, local = (int(v[0]) for v in self._files.locate(np.array([i])))
        self._files.order([sid])
        if self.kind == "fixed":
            data = self._fixed.one(i, sid, local)
        else:
            data = self._columns.one_record(sid, local)
        if not self.fields:
            return data
        sample = {"data": data}
        for name in self.fields:
            sample[name] = torch.from_numpy(np.array(self._columns.column(name)[i]))
        return sample

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """torch's per-batch hook: one batched gather, split into per-sample views (each
        through ``transform``; ``batch_transform`` is for whole batches: not applied here)."""
        samples = self._samples(self._normalize(indices))
        if self.transform is None:
            return samples
        return [self.transform(s) for s in samples]

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._len):
            yield self[i]

    # ------------------------------------------------------------------ batched reads
    def read_batch(
        self, indices: Sequence[int] | np.ndarray | torch.Tensor, out: Any = None
    ) -> Any:
        """Return what ``default_collate([ds[i] for i in indices])`` returns, in one gather.

        For the bytes layout, ``data`` is a list of uint8 tensors (views of one buffer).
        ``out`` (optional) has the structure of the result (a tensor, or a dict of tensors; for
        the bytes layout ``out["data"]`` is a flat uint8 tensor) with room for the batch; the
        records are written into it and views of it are returned. A CUDA ``out["data"]`` (fixed
        layout) is filled by DMA straight from the page cache, asynchronously on the current
        stream (:mod:`feedpipe.device.dma`: the shard maps are registered as page-locked).

        Ragged columns are padded or nested (``ragged=``), never written into ``out``; with
        ``transform``, samples are transformed and collated (``out`` is not used); then
        ``batch_transform`` (see the class docstring).
        """
        plain = self._plain and self.transform is None and self.batch_transform is None
        if plain and out is None and (fresh := self._fresh(indices)) is not None:
            return fresh
        idx = self._normalize(indices)
        self._plan_started(idx)
        if plain:
            return self._fixed.gather(idx, out.get("data") if isinstance(out, dict) else out)
        if self.transform is not None:
            batch = self._transformed(idx)
        else:
            batch = self._read(idx, out, self.ragged)
        return batch if self.batch_transform is None else self.batch_transform(batch)

    def _fresh(self, indices: Any) -> torch.Tensor | None:
        """A small batch of a one-file dataset by one bounds-checked take, for an ``int64``
        index array (what the loader passes): :meth:`FixedRecords.fresh`; else None."""
        if type(indices) is not np.ndarray or indices.dtype is not _INT64 or indices.ndim != 1:
            return None
        try:
            return self._fixed.fresh(indices)
        except IndexError:
            return None  # out of range: _normalize raises it again, naming the dataset

    def _read(self, idx: np.ndarray, out: Any, mode: str) -> Any:
        """The batch before any transform; ragged columns as ``mode`` (pad, nested, list)."""
        data = self._records(idx, out.get("data") if isinstance(out, dict) else out, mode)
        if not self.fields:
            return data["data"] if self.kind == "ragged" and mode == "nested" else data
        result: dict[str, Any] = {}
        if isinstance(data, dict):
            result.update(data)
        elif self.kind != "none":
            result["data"] = data
        for name in self.fields:
            target = out.get(name) if isinstance(out, dict) else None
            result.update(self._columns.read_field(name, idx, target, mode))
        return result

    def _records(self, idx: np.ndarray, out: Any, mode: str) -> Any:
        """The records column of a batch, as its layout reads it (None: the ``none`` layout)."""
        if self.kind == "fixed":
            return self._fixed.gather(idx, out)
        if self.kind == "bytes":
            return self._columns.read_bytes(idx, out)
        if self.kind == "ragged":
            return self._columns.read_variable(self._var_cols["data"], idx, mode)
        return None

    def read_span(self, name: str, shard: int, start: int, out: np.ndarray) -> None:
        """Read ``out.nbytes`` bytes of column ``name``'s data file in ``shard`` (``"data"``: the
        records) from byte ``start`` into ``out`` (contiguous, writable): one copy from the
        checked map; bytes beyond the file are a :class:`DatasetError`.
        :class:`feedpipe.TokenWindows` reads with it."""
        self._columns.read_span(name, shard, start, out)

    # ------------------------------------------------------------------ transforms
    def _samples(self, idx: np.ndarray) -> list[Any]:
        """The samples ``ds[i]`` (before ``transform``) of a batch, read in one gather."""
        batch = self._read(idx, None, "list")
        if not self.fields:
            return list(batch) if self.kind == "fixed" else batch  # type: ignore[no-any-return]
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

    def record_space(self) -> ShardSpace | None:
        """The one-range map a batch is gathered from in one ``np.take``, when it is (local fixed
        records, no side fields, no transform, ``read`` not ``"pread"``): a
        :class:`feedpipe.MixedDataset` of such members reads a batch in one gather over theirs."""
        if not self._plain or self.transform is not None or self.batch_transform is not None:
            return None
        return self._files.space()

    def column_reader(self) -> ColumnReader | None:
        """The reader of this dataset's columns when a batch is read without a transform (else
        None): a :class:`feedpipe.MixedDataset` of typed members reads straight into one batch."""
        plain = self.transform is None and self.batch_transform is None
        return self._columns if plain else None

    def per_sample_keys(self) -> frozenset[str] | None:
        """Keys of this dataset's batches that are per-sample lists (``str``, ``json``, bytes
        records), whatever their values; None with a ``batch_transform`` (it decides). A
        :class:`feedpipe.MixedDataset` merges its batches by them (never guessing)."""
        if self.batch_transform is not None:
            return None
        listed = {c.name for c in self._var_cols.values() if c.kind != "ragged"}
        return frozenset(listed | ({"data"} if self.kind == "bytes" else set()))

    # ------------------------------------------------------------------ device feed
    def dma_blocker(self) -> str | None:
        """Why :meth:`read_batch` cannot fill a CUDA ``out`` by DMA (None: it can)."""
        if self.kind != "fixed":
            return f"the {self.kind} layout (records of varying size, or none)"
        if self.transform is not None or self.batch_transform is not None:
            return "a transform (the batch is built on the host)"
        if self._source.remote:
            return "remote shards (read through the local cache)"
        if self.read == "pread":
            return "read='pread' (no map to register)"
        if self._record_bytes == 0:
            return "empty records"
        return None

    @property
    def record_bytes(self) -> int:
        """Bytes per record (fixed layout; 0 for the bytes layout)."""
        return int(self._record_bytes)

    def device_out(self, rows: int, device: torch.device) -> Any:
        """An ``out`` for :meth:`read_batch` whose records land on ``device`` by DMA (the device
        feed's direct path), allocated on the current stream; side fields stay on the host."""
        want = torch.from_numpy(np.empty(0, self.dtype)).dtype
        data = torch.empty((rows, *self.shape), dtype=want, device=device)
        return {"data": data} if self.fields else data

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close open files and maps, end cached shards' leases and stop the cache's prefetches
        (everything reopens on the next read)."""
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        self._files.close(wait)
        self._source.close(wait)

    def __del__(self) -> None:
        try:
            self._close(wait=False)  # never block the garbage collector on a download
        except Exception:
            pass

    def __repr__(self) -> str:
        layout = f"{self.kind} {self.shape} {self.dtype}" if self.kind != "bytes" else "bytes"
        return (
            f"MemmapDataset({self._shown!r}, {self._len} records, {layout}, "
            f"{len(self.index.shards)} shards, fields={list(self.fields)})"
        )

    # ------------------------------------------ handles of tests and benchmarks (private)
    def _shard_cache(self) -> Any:
        return self._source.cache()

    @property
    def _cache(self) -> Any:
        return self._source.made_cache

    @property
    def _verified(self) -> dict[str, Any]:
        return self._source.verified

    def _shard_space(self) -> Any:
        return self._files.space()

    def _open_files(self) -> Any:
        return self._files.files()

    def _column(self, name: str) -> np.ndarray:
        return self._columns.column(name)
