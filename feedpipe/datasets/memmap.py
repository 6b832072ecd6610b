"""``MemmapDataset``: a map-style torch dataset over a sharded memmap directory, with batched reads.

The format is described in :mod:`feedpipe.datasets.format`; :class:`MemmapWriter` writes it.

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
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._gather import (
    ROW_COPY_MIN,
    ShardSpace,
    indices_array,
    inverse,
    scratch,
)
from feedpipe.datasets._memmap_columns import TypedColumns
from feedpipe.datasets._memmap_files import VERIFY_MODES, ShardFiles, verify_files
from feedpipe.datasets._memmap_open import OpenShard, OpenShards
from feedpipe.datasets.columns import RAGGED_MODES, gather, variable_columns
from feedpipe.datasets.format import INDEX_NAME, parse_index, read_index
from feedpipe.datasets.writer import MemmapWriter
from feedpipe.errors import DatasetError
from feedpipe.io.fsutil import readinto_exactly
from feedpipe.io.remote import local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["MemmapDataset", "MemmapWriter", "verify_files"]

_IOV_MAX = 1024
_READS = ("auto", "mmap", "pread")


class MemmapDataset(ShardFiles, TypedColumns, torch.utils.data.Dataset[Any]):
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
        if read not in _READS:
            raise ValueError(f"read must be one of {_READS}, got {read!r}")
        if not (isinstance(verify, bool) or (isinstance(verify, str) and verify in VERIFY_MODES)):
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if ragged not in RAGGED_MODES:
            raise ValueError(f"ragged must be one of {RAGGED_MODES}, got {ragged!r}")
        for fn, what in ((transform, "transform"), (batch_transform, "batch_transform")):
            if fn is not None and not callable(fn):
                raise TypeError(f"{what} must be callable, got {type(fn).__name__}")
        self.read = read
        self.ragged = ragged
        self.pad_value = pad_value
        self.transform = transform
        self.batch_transform = batch_transform
        self.path = os.fspath(path)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.cache_limit_bytes = cache_limit_bytes
        self.storage_options = dict(storage_options or {})
        self._remote = _remote.is_remote(self.path)
        self._cache: Any = None  # feedpipe.cache.ShardCache of a remote dataset, made on first use
        self._index_raw: bytes | None = None
        self._index_id: tuple[int, int, int] | None = None  # local: index.json as opened
        self._stamps: dict[str, list[Any]] = {}  # local: every file as stat'ed at open
        self._verified: dict[str, Any] = {}  # verify="first-use": files checked (shared)
        self._tables: dict[str, Any] = {}  # per role: what its files must be (_shard_guard)
        # every message and the repr show this: the URL without its password or signature
        self._shown = _remote.redact(self.path, self.storage_options)
        if self._remote:
            # through the retrying path; the cache is then built from these same bytes
            policy = _remote.DEFAULT_POLICY
            fs, root = _remote.resolve(self.path, self.storage_options, policy.deadline_s)
            raw, _ = _remote.read_remote_index(fs, root, self.path, self.storage_options, policy)
            self._index_raw = raw
            self.index = parse_index(raw, _remote.join(self._shown, INDEX_NAME))
        else:
            self.path = self._shown = local_file_path(self.path)
            if not os.path.isdir(self.path):
                raise DatasetError(f"{self.path}: not a feedpipe dataset (not a directory)")
            # before reading it: a rewrite racing the read is then seen as one, never missed
            self._index_id = self._index_file_id(self.path)
            self.index = read_index(self.path)
            self._check_local_files(verify)
        layout = self.index.layout
        self.kind = layout.kind
        self.shape = layout.shape
        self.dtype = np.dtype(layout.dtype)
        self.fields = dict(self.index.fields)
        self.classes: list[str] | None = self.index.extra.get("classes")
        self._record_bytes = layout.record_bytes
        self._starts = np.concatenate(
            [[0], np.cumsum([s.records for s in self.index.shards], dtype=np.int64)]
        ).astype(np.int64)
        self._len = int(self._starts[-1])
        self._files: OpenShards | None = None
        self._space: ShardSpace | bool | None = None  # False: this dataset reads per shard
        self._var_cols = variable_columns(layout, self.fields)
        for col in self._var_cols.values():
            if col.kind == "ragged" and np.array(pad_value).astype(col.dtype) != pad_value:
                raise ValueError(f"pad_value {pad_value!r} does not fit column {col.name!r}")
        self._role_files: dict[str, OpenShards] = {}  # variable-length fields' data files
        self._offsets_of: dict[int, np.ndarray] = {}
        self._col_offsets: dict[tuple[str, int], np.ndarray] = {}
        self._columns: dict[str, np.ndarray] = {}
        self._tls = threading.local()  # per-thread scratch for gathers spanning shards
        # first reads may come from several threads at once; re-entrant: a remote table
        # (under it) makes the cache (under it too)
        self._open_lock = threading.RLock()

    # ------------------------------------------------------------------ indexing
    def __len__(self) -> int:
        return self._len

    # ------------------------------------------ access plan (feedpipe.protocols.AccessPlanDataset)
    def plan_horizon(self) -> int:
        """Samples ahead of its reads this dataset wants to know: some only for a remote dataset
        behind a bounded cache, whose eviction then follows the plan (Belady)."""
        limit = self.cache_limit_bytes
        if not self._planned() or limit is None:
            return 0
        from feedpipe.remote.plan import horizon_samples

        total = sum(s.files["data"].bytes for s in self.index.shards)
        return horizon_samples(limit, total, self._len)

    def plan_start(self) -> None:
        """A new pass begins: forget the planned reads."""
        if self._planned():
            self._shard_cache().plan.clear()

    def plan_ahead(self, indices: Sequence[int] | np.ndarray) -> None:
        """A batch ``read_batch`` will read later, after those planned before it."""
        if not self._planned():
            return
        from feedpipe.remote.plan import batch_key

        try:
            idx = self._normalize(indices)
        except (IndexError, TypeError, ValueError):
            return  # not planned: read_batch raises for it, in the worker, naming the batch
        shards = np.unique(self._locate(idx)[0]) if len(idx) else ()
        data = [self.index.shards[int(s)].files["data"].path for s in shards]
        self._shard_cache().plan.add(batch_key(idx), data)

    def _planned(self) -> bool:
        return self._remote and self.cache_limit_bytes is not None and self.cache_dir is not None

    def _plan_started(self, idx: np.ndarray) -> None:
        """This thread starts reading ``idx``: a planned read leaves the plan's future."""
        cache = self._cache
        if cache is not None and cache.plan:
            from feedpipe.remote.plan import batch_key

            cache.plan.start(batch_key(idx))

    def _normalize(self, indices: Any) -> np.ndarray:
        n, shown = self._len, self._shown
        return indices_array(
            indices, n, lambda i: f"index {i} is out of range for {shown} (length {n})"
        )

    def _locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(self._starts) == 2:  # one shard
            return np.zeros(len(idx), np.int64), idx
        sid = np.searchsorted(self._starts, idx, side="right") - 1
        return sid, idx - self._starts[sid]

    def _plan(self, shards: list[int]) -> list[int]:
        """The order to read a batch's ``shards`` in; fetches remote ones ahead when they fit."""
        if not self._remote:
            return shards
        cache = self._shard_cache()
        if cache.pressure_changed():  # a download somewhere waits for room: end idle leases
            self._release_idle()
        if len(shards) < 2:
            return shards
        limit = self.cache_limit_bytes
        rels = [rel for s in shards for rel in cache.shard_files(s)]
        need = sum(info.bytes for s in shards for info in self.index.shards[s].files.values())
        if limit is None or need <= limit // 2:
            cache.fetch(rels, on_wait=self._release_idle)  # in parallel, not one by one
            return shards
        # more than fits: read the open shards first, then the cached ones, fetch the rest last
        files = self._open_files()

        def rank(s: int) -> int:
            if files.is_open(s):
                return 0
            return 1 if os.path.exists(self._local_path(s, "data")) else 2

        return sorted(shards, key=rank)

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
        sid, local = (int(v[0]) for v in self._locate(np.array([i])))
        self._plan([sid])
        if self.kind == "fixed":
            rb = self._record_bytes
            buf = np.empty(rb, np.uint8)
            if self.read == "pread":  # never maps: a file changed under us is an error, not SIGBUS
                pos = np.array([i]), np.array([sid]), np.array([local])
                self._pread_fixed(*pos, buf.reshape(1, rb))
            elif (space := self._shard_space()) is not None:
                space.take(np.array([i], np.int64), buf.reshape(1, rb))
            else:
                with self._open_files().use(sid) as shard:  # checked (_shard_guard)
                    buf[:] = self._rows(shard)[local]
            data = torch.from_numpy(buf.view(self.dtype).reshape(self.shape))
        else:
            off = self._offsets(sid)
            a, b = int(off[local]), int(off[local + 1])
            with self._mapped("data", sid) as flat:  # checked like every read (_shard_guard)
                buf = flat[a:b].copy()
            data = torch.from_numpy(buf)
        if not self.fields:
            return data
        sample = {"data": data}
        for name in self.fields:
            sample[name] = torch.from_numpy(np.array(self._column(name)[i]))
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
        idx = self._normalize(indices)
        self._plan_started(idx)
        if self.transform is not None:
            batch = self._transformed(idx)
        else:
            batch = self._read(idx, out, self.ragged)
        return batch if self.batch_transform is None else self.batch_transform(batch)

    def _read(self, idx: np.ndarray, out: Any, mode: str) -> Any:
        """The batch before any transform; ragged columns as ``mode`` (pad, nested, list)."""
        n = len(idx)
        out_data = out.get("data") if isinstance(out, dict) else out
        data: Any = None
        if self.kind == "fixed":
            data = self._gather_fixed(idx, out_data)
        elif self.kind == "bytes":
            data = self._gather_bytes(idx, out_data)
        elif self.kind == "ragged":
            data = self._read_var(self._var_cols["data"], idx, mode)
            if not self.fields and mode == "nested":
                return data["data"]
        if not self.fields:
            return data
        result: dict[str, Any] = {}
        if isinstance(data, dict):
            result.update(data)
        elif self.kind != "none":
            result["data"] = data
        for name, spec in self.fields.items():
            vcol = self._var_cols.get(name)
            if vcol is not None:
                got = self._read_var(vcol, idx, mode)
                result.update(got) if isinstance(got, dict) else result.__setitem__(name, got)
                continue
            target = out.get(name) if isinstance(out, dict) else None
            col = self._column(name)
            if target is None:
                result[name] = torch.from_numpy(col[idx])
            else:
                view = _check_out(target, n, spec.shape, np.dtype(spec.dtype), name)
                np.take(col, idx, axis=0, out=view.numpy(), mode="clip")
                result[name] = view
        return result

    def _gather_fixed(self, idx: np.ndarray, out: Any) -> torch.Tensor:
        n, rb = len(idx), self._record_bytes
        if isinstance(out, torch.Tensor) and out.is_cuda:
            return self._dma_fixed(idx, out)
        if out is None:
            dest = torch.from_numpy(np.empty((n, *self.shape), self.dtype))
        else:
            dest = _check_out(out, n, self.shape, self.dtype, "data")
        if n == 0 or rb == 0:
            return dest
        flat = dest.numpy().reshape(n, -1).view(np.uint8)
        space = self._shard_space()
        if space is not None:  # every shard in one range: one gather, however many it touches
            space.take(idx, flat)
            return dest
        sid, local = self._locate(idx)
        if self.read == "pread":
            self._pread_fixed(idx, sid, local, flat)
            return dest
        files = self._open_files()
        one = len(self._starts) == 2 and not self._remote
        shards = [0] if one else self._plan(np.unique(sid).tolist())
        if len(shards) == 1:
            with files.use(shards[0]) as shard:  # one copy, no scatter; checked (_shard_guard)
                np.take(self._rows(shard), local, axis=0, out=flat, mode="clip")
            return dest
        # gather in file order (sorted: kinder to the TLB and prefetcher), then scatter
        order = np.argsort(idx, kind="stable")
        s_sorted, l_sorted = sid[order], local[order]
        bounds = [0, *(np.flatnonzero(np.diff(s_sorted)) + 1).tolist(), n]
        group = {int(s_sorted[a]): (a, b) for a, b in itertools.pairwise(bounds)}
        big = rb >= ROW_COPY_MIN  # big records: one copy each, no temp + scatter
        tmp = None if big else scratch(self._tls, flat)
        for s in shards:
            a, b = group[s]
            with files.use(s) as shard:
                rows = self._rows(shard)
                if tmp is None:
                    for p, q in zip(order[a:b].tolist(), l_sorted[a:b].tolist(), strict=True):
                        flat[p] = rows[q]
                else:
                    np.take(rows, l_sorted[a:b], axis=0, out=tmp[a:b], mode="clip")
        if tmp is not None:  # scatter as a gather: take copies whole rows, fancy setitem not
            np.take(tmp, inverse(order), axis=0, out=flat, mode="clip")
        return dest

    def _dma_fixed(self, idx: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Copy records by DMA from the registered shard maps into ``out`` on the GPU (see
        :mod:`feedpipe.device.dma`); asynchronous on the current CUDA stream."""
        from feedpipe.device import dma as _memmap_dma

        n = len(idx)
        want = torch.from_numpy(np.empty(0, self.dtype)).dtype
        if out.dtype != want or tuple(out.shape[1:]) != tuple(self.shape) or out.shape[0] < n:
            raise ValueError(
                f"out['data'] is {out.dtype} {tuple(out.shape)}; need {want} with at least "
                f"{n} rows of shape {tuple(self.shape)}"
            )
        dest = out[:n]
        if not dest.is_contiguous():
            raise ValueError("out['data'] must be contiguous")
        if n == 0 or self._record_bytes == 0:
            return dest
        sid, local = self._locate(idx)
        files = self._open_files()
        regs = {}
        with contextlib.ExitStack() as held:  # every shard of the batch stays mapped meanwhile
            for s in self._plan(np.unique(sid).tolist()):
                shard = held.enter_context(files.use(s))
                where = self._local_path(s, "data")
                regs[s] = _memmap_dma.register(shard, self._rows(shard), where)
            _memmap_dma.move_records(dest, regs, sid, local)
        return dest

    def dma_blocker(self) -> str | None:
        """Why :meth:`read_batch` cannot fill a CUDA ``out`` by DMA (None: it can)."""
        if self.kind != "fixed":
            return f"the {self.kind} layout (records of varying size, or none)"
        if self.transform is not None or self.batch_transform is not None:
            return "a transform (the batch is built on the host)"
        if self._remote:
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

    def _pread_fixed(
        self, idx: np.ndarray, sid: np.ndarray, local: np.ndarray, flat: np.ndarray
    ) -> None:
        """Read fixed records with ``os.preadv`` straight into ``flat`` (rows), in file order:
        runs of adjacent records in one shard become one call. Runs in the calling thread (the
        loader's workers are the parallelism; a shared pool here would serialise them)."""
        n, rb = len(idx), self._record_bytes
        key = self._shard_key(sid) * (1 << 40) + local
        order = np.argsort(key, kind="stable")
        k_sorted = key[order]
        # a run breaks where the next record is not the adjacent one of the same shard
        breaks = np.flatnonzero(np.diff(k_sorted) != 1) + 1
        bounds = [0, *breaks.tolist(), n]
        order_l, sid_l, local_l = order.tolist(), sid.tolist(), local.tolist()
        files = self._open_files()
        shard_of_run = [sid_l[order_l[a]] for a in bounds[:-1]]
        runs = list(itertools.pairwise(bounds))
        pos = 0
        for s, group in itertools.groupby(shard_of_run):
            count = sum(1 for _ in group)
            with files.use(s) as shard:
                for a, b in runs[pos : pos + count]:
                    for c in range(a, b, _IOV_MAX):
                        d = min(b, c + _IOV_MAX)
                        first = order_l[c]
                        bufs = [flat[p] for p in order_l[c:d]]
                        offset = local_l[first] * rb
                        self._preadv_exact(shard, bufs, offset, int(idx[first]), (d - c) * rb)
            pos += count

    def _shard_key(self, sid: np.ndarray) -> np.ndarray:
        """Per-record sort key placing shards in :meth:`_plan` order (index order locally)."""
        if not self._remote:
            return sid
        rank = np.zeros(len(self.index.shards), np.int64)
        rank[self._plan(np.unique(sid).tolist())] = np.arange(len(np.unique(sid)))
        return rank[sid]

    def _gather_bytes(self, idx: np.ndarray, out: Any) -> list[torch.Tensor]:
        n = len(idx)
        sid, local = self._locate(idx)
        starts = np.empty(n, np.int64)
        lengths = np.empty(n, np.int64)
        for s in np.unique(sid).tolist():
            pos = np.flatnonzero(sid == s)
            off = self._offsets(s)
            starts[pos] = off[local[pos]]
            lengths[pos] = off[local[pos] + 1] - off[local[pos]]
        total = int(lengths.sum())
        if out is None:
            buf = torch.empty(total, dtype=torch.uint8)
        else:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.ndim != 1:
                raise ValueError("out['data'] for the bytes layout must be a 1-D uint8 tensor")
            if out.numel() < total or not out.is_contiguous():
                raise ValueError(f"out['data'] holds {out.numel()} bytes; the batch needs {total}")
            buf = out[:total]
        flat = buf.numpy()
        dest = np.cumsum(lengths) - lengths
        for s in self._plan(np.unique(sid).tolist()):  # one gather from each shard's map
            pos = np.flatnonzero(sid == s)
            with self._mapped("data", s) as data:  # checked like every read (_shard_guard)
                gather(data, starts[pos], lengths[pos], flat, dest[pos])
        return list(torch.split(buf, lengths.tolist()))

    def _preadv_exact(
        self, shard: OpenShard, bufs: list[Any], offset: int, record: Any, nbytes: int
    ) -> None:
        got = readinto_exactly(shard.fd, bufs, offset, nbytes)
        if got != nbytes:  # a short read means the file changed under us: never return it
            raise DatasetError(
                f"{self._local_path(shard.sid, 'data')}: short read at record {record} "
                f"(got {got} of {nbytes} bytes at offset {offset}); the shard was truncated"
            )

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = None
        state["_space"] = None
        state["_tls"] = None
        state["_open_lock"] = None
        state["_columns"] = {}
        state["_offsets_of"] = {}
        state["_col_offsets"] = {}
        state["_role_files"] = {}
        state["_tables"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tls = threading.local()
        self._open_lock = threading.RLock()

    def close(self) -> None:
        """Close open files and maps, end cached shards' leases and stop the cache's prefetches
        (everything reopens on the next read)."""
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        space, self._space = self._space, None
        if isinstance(space, ShardSpace):
            if space.pid == os.getpid():
                space.close(timeout=60.0 if wait else 0.0)
            else:
                space.forget()
        if self._files is not None:
            self._files.close()
            self._files = None
        for files in self._role_files.values():
            files.close()
        self._role_files = {}
        if self._cache is not None:
            self._cache.close(wait=wait)

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


def _check_out(
    out: Any, n: int, shape: tuple[int, ...], dtype: np.dtype, name: str
) -> torch.Tensor:
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
