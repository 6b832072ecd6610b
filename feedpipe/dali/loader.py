"""DALI image loading: encoded images + labels of a feedpipe dataset, decoded and augmented by DALI.

``ImageLoader`` iterates like a ``DataLoader`` (``len``, epochs, ``drop_last``, ``state_dict``)
and yields ``(images, labels)`` torch tensors, on the GPU with ``device="cuda"`` (nvJPEG and the
hardware JPEG decoder, ``hw_decoder_load``) or on the CPU with ``device="cpu"`` (DALI's CPU
backend). The order of indices comes from a feedpipe or torch sampler, so sharding, shuffling and
(elastic) resume are the sampler's; DALI's parallel external source reads the records through
the dataset in ``py_num_workers`` processes.

One DALI pipeline serves all epochs: it is never reset or rebuilt between epochs (only after a
failed batch or a timeout). Each epoch's order is published as a segment of one endless DALI
epoch, and the next epoch's order (the sampler after ``set_epoch(epoch + 1)``) is published ahead,
so reading and decoding run on across the epoch boundary; a wrong guess or an abandoned epoch
costs a few discarded batches, and samplers whose next order cannot be predicted cost a pause of
two tiny filler batches per epoch.

Bad records. ``on_error="raise"`` (default) raises :class:`~feedpipe.errors.DatasetError` naming
the dataset, shard and record. ``on_error="skip"`` replaces a bad record by the next valid record
in dataset order (``i + 1, i + 2, ...`` modulo the length), counts it in ``loader.skipped`` and
keeps its index in ``loader.skipped_indices`` and in the state, so a resumed run replaces the same
records. Records are checked cheaply before decode (magic bytes, end marker); if DALI still fails
on a batch, each record of that batch is decoded alone on the CPU to find the bad one(s), and the
batch is decoded again without them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from feedpipe.dali.options import ImageLoaderOptions, split_flat
from feedpipe.dali.pipeline import PoolCloser, Transform
from feedpipe.dali.records import BadRecords
from feedpipe.dali.source import META_COLS
from feedpipe.dali.stream import PipelineStream
from feedpipe.errors import WorkerError, require
from feedpipe.io import trace
from feedpipe.io.reaper import Workers
from feedpipe.stall import StallMeter

__all__ = ["ImageLoader", "ImageLoaderOptions"]

_STATE_VERSION = 1


class ImageLoader:
    """Decode and augment images of a feedpipe dataset with DALI; yields ``(images, labels)``.

    Args:
        dataset: indexable; ``dataset[i]`` gives ``(encoded uint8 array/tensor, int label)`` or a
            dict with ``"data"`` and ``"label"`` (e.g. :class:`feedpipe.MemmapDataset`, bytes
            layout). It is pickled into DALI's worker processes.
        batch_size: images per batch.
        sampler: a feedpipe/torch sampler (``set_epoch`` and ``state_dict`` are used when present);
            default: ``feedpipe.DistributedSampler`` over one rank with ``shuffle`` and ``seed``.
        drop_last: drop the last incomplete batch.
        transform: a :class:`Transform`: ``train`` = random resized crop + horizontal flip; else
            resize the shorter side to ``resize`` and center-crop ``crop``; then normalize with
            ``mean``/``std`` (0..1 units) into ``dtype`` ("float32", "float16" or "uint8" = no
            normalization) and ``output_layout``.
        options: an :class:`ImageLoaderOptions` (device, DALI threads and workers, prefetch,
            ``on_error``, ``timeout``).
        meter: a :class:`~feedpipe.StallMeter` to report into (one is created otherwise).
        **flat: each field of ``Transform`` and ``ImageLoaderOptions`` is also accepted as a flat
            keyword (``ImageLoader(ds, 256, device="cpu", crop=224)``); it overrides that field
            of ``transform``/``options``.

    The loader owns two objects: its :class:`~feedpipe.dali.stream.PipelineStream` (the DALI
    pipeline, its segments and position) and its :class:`~feedpipe.dali.records.BadRecords`
    (the ``on_error`` policy and the bad indices found so far); it keeps the sampler, the
    epoch's place in it and the state.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        sampler: Any = None,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        transform: Transform | None = None,
        options: ImageLoaderOptions | None = None,
        meter: StallMeter | None = None,
        **flat: Any,
    ) -> None:
        require("nvidia.dali", "dali")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.transform, self.options = split_flat(transform, options, flat)
        device_id = _device_id(self.options)
        if sampler is None:
            sampler = _default_sampler(dataset, batch_size, shuffle, seed)
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.drop_last = drop_last
        self.device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
        self.meter = meter if meter is not None else StallMeter()
        self._records = BadRecords(dataset, self.options.on_error)
        closer = PoolCloser()  # DALI's pool closed before any worker is signalled
        self._stream = PipelineStream(
            dataset,
            batch_size,
            drop_last,
            self.transform,
            self.options,
            device_id=device_id,
            seed=seed + 7919 * int(getattr(sampler, "rank", 0) or 0),
            workers=Workers("DALI source worker", self, ask=closer),
            pool_closer=closer,
        )
        self._iter_state: dict[str, Any] | None = None  # sampler state at the current __iter__
        self._delivered = 0
        self._resume_skip = 0  # for samplers without state_dict: indices to drop on next iter

    # ------------------------------------------------------------------ DataLoader-like API
    @property
    def skipped_indices(self) -> list[int]:
        """Dataset indices found bad so far (and those loaded from a state)."""
        return self._records.known()

    @property
    def skipped(self) -> int:
        """Bad records replaced so far (one per replaced sample)."""
        return self._records.skipped

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._records.skipped = value

    @property
    def on_error(self) -> str:
        """``"raise"`` or ``"skip"`` (the module docstring)."""
        return self._records.on_error

    @on_error.setter
    def on_error(self, value: str) -> None:
        self._records.on_error = value

    @property
    def timeout(self) -> float:
        """Seconds to wait for one batch before raising :class:`~feedpipe.errors.WorkerError`."""
        return self._stream.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._stream.timeout = value

    # the stream's state as the tests look at it
    @property
    def _pipe(self) -> Any:
        return self._stream.pipe

    @property
    def _speculate(self) -> bool:
        return self._stream.speculate

    @property
    def _prefetch(self) -> int:
        return self._stream.prefetch

    def __len__(self) -> int:
        return self._n_batches(len(self.sampler) - self._resume_skip)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the sampler (reshuffles); call it before iterating each epoch."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._iter_state = None
        self._resume_skip = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        indices = self._begin_epoch()
        return self.meter.metered_pass(self._batches(indices))  # time between passes: outside

    def _n_batches(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Sampler state (``consumed`` = samples delivered this epoch) + the bad-record list."""
        if self._iter_state is not None:
            base = self._iter_state
            sampler_state = {**base, "consumed": int(base["consumed"]) + self._delivered}
        elif hasattr(self.sampler, "state_dict"):
            sampler_state = self.sampler.state_dict()
        else:
            sampler_state = {"consumed": self._resume_skip}
        return {
            "version": _STATE_VERSION,
            "sampler": sampler_state,
            "skipped": self.skipped_indices,
            "skipped_count": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``__iter__`` continues the saved epoch after its consumed samples."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported ImageLoader state version {state.get('version')!r}")
        if hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
            self._resume_skip = 0
        else:
            self._resume_skip = int(state["sampler"]["consumed"])
        self._records.indices = {int(i) for i in state["skipped"]}
        self._records.skipped = int(state.get("skipped_count", 0))
        self._iter_state = None

    def close(self) -> None:
        """Stop DALI's workers and remove the plan directory (also done at garbage collection
        and at interpreter exit).

        Returns within :data:`feedpipe.io.reaper.DEFAULT_BOUND` (6 s): a worker that does not
        exit when asked (stuck in the dataset) is terminated, then killed, and reaped; one that
        outlives SIGKILL is reported by name and pid (a ``StuckWorkerWarning``). An epoch in
        progress (on any thread) then raises :class:`~feedpipe.errors.WorkerError` at its next
        batch; a new ``iter(loader)`` builds a new pipeline.
        """
        self._stream.close()
        self._records.close()

    def __enter__(self) -> ImageLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------- internals
    def _begin_epoch(self) -> np.ndarray:
        it = iter(self.sampler)  # first: a sampler may start its epoch (or a resume) here
        self._iter_state = (
            dict(self.sampler.state_dict())
            if hasattr(self.sampler, "state_dict")
            else {"consumed": self._resume_skip}
        )
        self._delivered = 0
        indices = np.fromiter((int(i) for i in it), dtype=np.int64)
        if self._resume_skip:
            indices, self._resume_skip = indices[self._resume_skip :], 0
        return indices

    def _batches(self, indices: np.ndarray) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        bs = self.batch_size
        n_batches = self._n_batches(len(indices))
        if n_batches == 0:
            return
        stream = self._stream
        stream.discard_until(stream.start(indices, self._records.known(), self.sampler))
        for b in range(n_batches):
            self.meter.wait_begin()
            expected = indices[b * bs : (b + 1) * bs]
            images, labels, meta = self._decoded(b, expected)
            if not np.array_equal(meta[:, 0], expected) or (meta[:, 5] != stream.seg_id).any():
                raise WorkerError(
                    f"DALI returned batch {b} out of order: indices {meta[:, 0].tolist()[:8]} of "
                    f"segment {meta[0, 5]}, expected {expected.tolist()[:8]} "
                    f"of segment {stream.seg_id}"
                )
            self._records.account(meta)
            nbytes = int(meta[:, 4].sum())
            self.meter.add_stage("fetch", float(meta[:, 3].sum()) / 1e9, nbytes)
            self.meter.wait_end(samples=len(labels), nbytes=nbytes)
            self._delivered += len(labels)
            yield images, labels

    def _decoded(self, b: int, batch: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Batch ``b`` (the indices ``batch``) as DALI decoded it, or repaired."""
        try:
            with trace.span("feedpipe/decode"):  # the wait for DALI's decoded batch
                out = self._stream.next(f"batch {b}")
        except (WorkerError, KeyboardInterrupt):
            raise
        except Exception as exc:  # DALI could not decode this batch
            self._stream.tainted = True  # DALI says the pipeline is no longer valid: rebuild
            return self._repair(batch, exc)
        return self._to_torch(out)

    def _to_torch(self, out: Any) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        images = _tensor(out[0], self.device)
        labels = torch.from_numpy(np.asarray(out[1].as_tensor()).reshape(-1).copy())
        meta = np.asarray(out[2].as_tensor()).reshape(-1, META_COLS)
        if self.device.type == "cuda":  # pinned: a pageable copy would wait for the stream
            labels = labels.pin_memory().to(self.device, non_blocking=True)
        return images, labels, meta

    def _repair(
        self, batch: np.ndarray, exc: Exception
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """DALI failed on ``batch``: find undecodable records on the CPU, decode without them."""
        start = time.perf_counter()
        bufs, labels, rows = self._records.replace(batch, exc, self._stream.seg_id)
        if self._stream.pipe is None:  # closed meanwhile (close() on another thread)
            self._records.close()  # the probe this repair built: ended here, not left behind
            raise self._stream.closed_error("repaired batch")
        images = self._stream.decode_alone(bufs)
        self.meter.add_stage("repair", time.perf_counter() - start)
        label_t = torch.tensor(labels, dtype=torch.int64)
        return _tensor(images, self.device), label_t.to(self.device), np.stack(rows)


def _device_id(opts: ImageLoaderOptions) -> int | None:
    """The CUDA device to decode on (None: the CPU backend)."""
    if opts.device != "cuda":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' needs a CUDA GPU; use device='cpu' without one")
    return torch.cuda.current_device() if opts.device_id is None else opts.device_id


def _default_sampler(dataset: Any, batch_size: int, shuffle: bool, seed: int) -> Any:
    """``feedpipe.DistributedSampler`` over one rank."""
    from feedpipe.sampler import DistributedSampler

    return DistributedSampler(
        dataset,
        num_replicas=1,
        rank=0,
        shuffle=shuffle,
        seed=seed,
        pad=False,
        batch_size=batch_size,
    )


def _tensor(batch: Any, device: torch.device) -> torch.Tensor:
    """Copy a DALI TensorList (CPU or GPU) into a new torch tensor on ``device``."""
    dense = batch.as_tensor()
    if device.type == "cpu":
        return torch.from_numpy(np.array(dense))
    plugin: Any = require("nvidia.dali.plugin.pytorch", "dali")
    types: Any = require("nvidia.dali.types", "dali")
    dtypes = {types.FLOAT: torch.float32, types.FLOAT16: torch.float16, types.UINT8: torch.uint8}
    out = torch.empty(dense.shape(), dtype=dtypes[dense.dtype], device=device)
    plugin.feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
    return out
