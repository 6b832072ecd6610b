"""Fixed-size records of a :class:`~feedpipe.MemmapDataset`: a batch of indices into rows.

:class:`FixedRecords` picks one way per batch (see the ``read=`` part of
:mod:`feedpipe.datasets.memmap`):

- every shard mapped into one range (:class:`~._gather.ShardSpace`): one ``np.take``;
- shard by shard from the open files' maps, in file order, then one scatter (remote shards,
  more shards than the map budget);
- ``read="pread"``: ``os.preadv`` into the destination rows, adjacent records in one call,
  every byte count checked;
- a CUDA ``out``: by DMA from the page cache (:mod:`feedpipe.device.dma`).

Every path reads through the dataset's :class:`~._memmap_open.ShardFiles`, so every shard is
checked by :mod:`._shard_guard` before it is read.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import numpy as np
import torch

from feedpipe.datasets._batch_pool import ALIGN_MIN, BatchPool
from feedpipe.datasets._gather import ROW_COPY_MIN, MapsClosedError, inverse, scratch
from feedpipe.datasets._memmap_columns import check_out
from feedpipe.datasets._memmap_open import OpenShard, ShardFiles
from feedpipe.errors import DatasetError
from feedpipe.io.fsutil import readinto_exactly

__all__ = ["FixedRecords"]

_IOV_MAX = 1024
_U8 = np.dtype(np.uint8)


class FixedRecords:
    """Batches of fixed-size records (``shape``, ``dtype``, ``record_bytes`` each) read the
    ``read`` way (``"auto"``, ``"mmap"``, ``"pread"``) from ``files``."""

    def __init__(
        self,
        files: ShardFiles,
        *,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        record_bytes: int,
        read: str,
    ) -> None:
        self.files, self.shape, self.dtype = files, shape, dtype
        self.record_bytes, self.read = record_bytes, read
        self._tls = threading.local()  # per-thread scratch for gathers spanning shards
        self._pool = BatchPool()  # new batches' memory, reused once released

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tls": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tls = threading.local()

    # ------------------------------------------------------------------ host
    def gather(self, idx: np.ndarray, out: Any) -> torch.Tensor:
        """Records ``idx`` as one tensor (views of ``out`` when given)."""
        n, rb = len(idx), self.record_bytes
        if out is None:
            arr = self._pool.empty((n, *self.shape), self.dtype)
            dest = torch.from_numpy(arr)
        elif isinstance(out, torch.Tensor) and out.is_cuda:
            return self.dma(idx, out)
        else:
            dest = check_out(out, n, self.shape, self.dtype, "data")
            arr = dest.numpy()
        if n == 0 or rb == 0:
            return dest
        # (n, record_bytes) bytes: one view for rows of one dimension, else a reshape first
        flat = arr.view(_U8) if arr.ndim == 2 else arr.reshape(n, -1).view(_U8)
        if self._space_take(idx, flat):  # every shard in one range: one gather, however many
            pass
        elif self.read == "pread":
            self._pread(idx, flat)
        else:
            self._per_shard(idx, flat)
        return dest

    def fresh(self, idx: np.ndarray) -> torch.Tensor | None:
        """Records ``idx`` (an ``int64`` array, unchecked: out of range is an ``IndexError``)
        as new memory, where the dataset is one local file and the batch is under
        ``ALIGN_MIN`` bytes (:meth:`ShardSpace.take_new`: the shortest per-batch path); else
        None."""
        n, rb = len(idx), self.record_bytes
        if not n or not rb or n * rb >= ALIGN_MIN or self.read == "pread":
            return None
        space = self.files.space()
        if space is None or not space.one_file:
            return None
        try:
            flat = space.take_new(idx)
        except MapsClosedError:  # its maps closed by another thread: the general path reopens
            return None
        return torch.from_numpy(flat.view(self.dtype).reshape(n, *self.shape))

    def one(self, i: int, sid: int, local: int) -> torch.Tensor:
        """Record ``i`` (record ``local`` of shard ``sid``) as a tensor of its own."""
        rb = self.record_bytes
        buf = np.empty(rb, np.uint8)
        if self.read == "pread":  # never maps: a file changed under us is an error, not SIGBUS
            self._pread(np.array([i]), buf.reshape(1, rb))
        elif self._space_take(np.array([i], np.int64), buf.reshape(1, rb)):
            pass
        else:
            with self.files.files().use(sid) as shard:  # checked (_shard_guard)
                buf[:] = self.files.rows(shard)[local]
        return torch.from_numpy(buf.view(self.dtype).reshape(self.shape))

    def _space_take(self, idx: np.ndarray, flat: np.ndarray) -> bool:
        """Records ``idx`` gathered into ``flat`` through the one-range map; False where there
        is none. Its maps closed by another thread meanwhile: the reopened maps serve (once)."""
        for last in (False, True):
            space = self.files.space()
            if space is None:
                return False
            try:
                space.take(idx, flat)
                return True
            except MapsClosedError:
                if last:
                    raise
        return False  # pragma: no cover - the loop returns or raises

    def _per_shard(self, idx: np.ndarray, flat: np.ndarray) -> None:
        """Shard by shard from the open files' maps, in file order, then one scatter."""
        files = self.files
        sid, local = files.locate(idx)
        one = len(files.starts) == 2 and not files.source.remote
        shards = [0] if one else files.order(np.unique(sid).tolist())
        if len(shards) == 1:
            with files.files().use(shards[0]) as shard:  # one copy, no scatter; checked
                np.take(files.rows(shard), local, axis=0, out=flat, mode="clip")
            return
        # gather in file order (sorted: kinder to the TLB and prefetcher), then scatter
        order = np.argsort(idx, kind="stable")
        s_sorted, l_sorted = sid[order], local[order]
        bounds = [0, *(np.flatnonzero(np.diff(s_sorted)) + 1).tolist(), len(idx)]
        group = {int(s_sorted[a]): (a, b) for a, b in itertools.pairwise(bounds)}
        big = self.record_bytes >= ROW_COPY_MIN  # big records: one copy each, no temp + scatter
        tmp = None if big else scratch(self._tls, flat)
        for s in shards:
            a, b = group[s]
            with files.files().use(s) as shard:
                rows = files.rows(shard)
                if tmp is None:
                    for p, q in zip(order[a:b].tolist(), l_sorted[a:b].tolist(), strict=True):
                        flat[p] = rows[q]
                else:
                    np.take(rows, l_sorted[a:b], axis=0, out=tmp[a:b], mode="clip")
        if tmp is not None:  # scatter as a gather: take copies whole rows, fancy setitem not
            np.take(tmp, inverse(order), axis=0, out=flat, mode="clip")

    def _pread(self, idx: np.ndarray, flat: np.ndarray) -> None:
        """Read records with ``os.preadv`` straight into ``flat`` (rows), in file order: runs of
        adjacent records in one shard become one call. Runs in the calling thread (the
        loader's workers are the parallelism; a shared pool here would serialise them)."""
        n, rb = len(idx), self.record_bytes
        sid, local = self.files.locate(idx)
        key = self._shard_key(sid) * (1 << 40) + local
        order = np.argsort(key, kind="stable")
        # a run breaks where the next record is not the adjacent one of the same shard
        breaks = np.flatnonzero(np.diff(key[order]) != 1) + 1
        bounds = [0, *breaks.tolist(), n]
        order_l, sid_l, local_l = order.tolist(), sid.tolist(), local.tolist()
        files = self.files.files()
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
        """Per-record sort key placing shards in ``files.order`` (index order locally)."""
        if not self.files.source.remote:
            return sid
        shards = np.unique(sid)
        rank = np.zeros(len(self.files.source.index.shards), np.int64)
        rank[self.files.order(shards.tolist())] = np.arange(len(shards))
        keyed: np.ndarray = rank[sid]
        return keyed

    def _preadv_exact(
        self, shard: OpenShard, bufs: list[Any], offset: int, record: Any, nbytes: int
    ) -> None:
        got = readinto_exactly(shard.fd, bufs, offset, nbytes)
        if got != nbytes:  # a short read means the file changed under us: never return it
            raise DatasetError(
                f"{self.files.source.local_path(shard.sid, 'data')}: short read at record "
                f"{record} (got {got} of {nbytes} bytes at offset {offset}); the shard was "
                "truncated"
            )

    # ------------------------------------------------------------------ device
    def dma(self, idx: np.ndarray, out: torch.Tensor) -> torch.Tensor:
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
        if n == 0 or self.record_bytes == 0:
            return dest
        files = self.files
        sid, local = files.locate(idx)
        regs = {}
        with contextlib.ExitStack() as held:  # every shard of the batch stays mapped meanwhile
            for s in files.order(np.unique(sid).tolist()):
                shard = held.enter_context(files.files().use(s))
                where = files.source.local_path(s, "data")
                regs[s] = _memmap_dma.register(shard, files.rows(shard), where)
            _memmap_dma.move_records(dest, regs, sid, local)
        return dest
