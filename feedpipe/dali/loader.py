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

import copy
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feedpipe.dali import source as _src
from feedpipe.dali.pipeline import Transform, build_fed, build_main, build_probe, worker_processes
from feedpipe.errors import DatasetError, WorkerError, require
from feedpipe.io import trace
from feedpipe.io.reaper import Workers
from feedpipe.stall import StallMeter

__all__ = ["ImageLoader", "ImageLoaderOptions"]

_STATE_VERSION = 1
_PIPE_DEPTH = 2  # DALI's prefetch_queue_depth: run() feeds one batch ahead of what it returns


@dataclass(frozen=True)
class ImageLoaderOptions:
    """How :class:`ImageLoader` runs DALI (the image transforms are a separate :class:`Transform`).

    ``device``: "cuda" (decode with ``device="mixed"`` on GPU ``device_id``, default the current
    one) or "cpu" (DALI's CPU backend). ``num_threads``: DALI operator threads.
    ``py_num_workers``: reader processes; ``py_start_method``: "spawn" (safe once CUDA is
    initialised) or "fork". ``prefetch``: batches the readers prepare ahead (``None``:
    ``max(4, 2 * py_num_workers)``). ``hw_decoder_load``: share of JPEGs sent to the hardware
    decoder (GPU only). ``on_error``: "raise" or "skip" (module docstring). ``timeout``: seconds
    to wait for one batch before raising :class:`~feedpipe.errors.WorkerError`.
    """

    device: str = "cuda"
    device_id: int | None = None
    num_threads: int = 4
    py_num_workers: int = 4
    py_start_method: str = "spawn"
    prefetch: int | None = None
    hw_decoder_load: float = 0.9
    on_error: str = "raise"
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")


_TRANSFORM_FIELDS = frozenset(f.name for f in fields(Transform))
_OPTION_FIELDS = frozenset(f.name for f in fields(ImageLoaderOptions))


def _split_flat(
    transform: Transform | None, options: ImageLoaderOptions | None, flat: dict[str, Any]
) -> tuple[Transform, ImageLoaderOptions]:
    """``transform`` and ``options`` with the flat keywords (aliases of their fields) applied."""
    if transform is not None and not isinstance(transform, Transform):
        raise TypeError(f"transform must be a feedpipe.dali.Transform, got {type(transform)}")
    if options is not None and not isinstance(options, ImageLoaderOptions):
        raise TypeError(f"options must be a feedpipe.dali.ImageLoaderOptions, got {type(options)}")
    unknown = sorted(set(flat) - _TRANSFORM_FIELDS - _OPTION_FIELDS)
    if unknown:
        raise TypeError(f"ImageLoader() got unexpected keyword argument(s) {unknown}")
    t_kw = {k: v for k, v in flat.items() if k in _TRANSFORM_FIELDS}
    o_kw = {k: v for k, v in flat.items() if k in _OPTION_FIELDS}
    return (
        replace(transform or Transform(), **t_kw),
        replace(options or ImageLoaderOptions(), **o_kw),
    )


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
        self.transform, self.options = _split_flat(transform, options, flat)
        opts = self.options
        device_id = opts.device_id
        if opts.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device='cuda' needs a CUDA GPU; use device='cpu' without one")
            device_id = torch.cuda.current_device() if device_id is None else device_id
        else:
            device_id = None
        if sampler is None:
            from feedpipe.sampler import DistributedSampler

            sampler = DistributedSampler(
                dataset,
                num_replicas=1,
                rank=0,
                shuffle=shuffle,
                seed=seed,
                pad=False,
                batch_size=batch_size,
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.drop_last = drop_last
        self.on_error = opts.on_error
        self.device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
        self.meter = meter if meter is not None else StallMeter()
        self.timeout = opts.timeout
        self.skipped = 0  # bad records replaced so far (one per replaced sample)
        self._skip: set[int] = set()
        self._device_id = device_id
        prefetch = opts.prefetch
        self._prefetch = prefetch if prefetch is not None else max(4, 2 * opts.py_num_workers)
        self._seed = seed + 7919 * int(getattr(sampler, "rank", 0) or 0)
        self._plan_dir: str | None = None
        self._pipe: Any = None
        self._fed: Any = None
        self._probe: Any = None
        self._caller: _Caller | None = None
        # DALI's source worker processes: ended at close(), at a new pipeline, at garbage
        # collection and at interpreter exit, within feedpipe.io.reaper.DEFAULT_BOUND
        self._workers = Workers("DALI source worker", self)
        # The pipeline persists across epochs as one endless stream (see feedpipe.dali.source): each
        # epoch is a segment of DALI iterations; the next epoch's order is predicted and
        # published ahead, so DALI reads and decodes across the epoch boundary without a pause.
        self._pos = 0  # DALI iteration of the next pipe.run() output
        self._segs = 0  # segments published (the next one's id)
        self._seg_id = -1  # the segment of the epoch being iterated
        self._last_end = 0  # the iteration after the last published segment
        self._spec: tuple[int, int, np.ndarray, list[int]] | None = None  # id, start, plan, skip
        self._speculate = True  # off once a prediction was wrong
        self._tainted = False  # DALI failed on a batch of the current pipeline
        self._iter_state: dict[str, Any] | None = None  # sampler state at the current __iter__
        self._delivered = 0
        self._resume_skip = 0  # for samplers without state_dict: indices to drop on next iter

    # ------------------------------------------------------------------ DataLoader-like API
    @property
    def skipped_indices(self) -> list[int]:
        """Dataset indices found bad so far (and those loaded from a state)."""
        return sorted(self._skip)

    def __len__(self) -> int:
        n = len(self.sampler) - self._resume_skip
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

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
        self._skip = {int(i) for i in state["skipped"]}
        self.skipped = int(state.get("skipped_count", 0))
        self._iter_state = None

    def close(self) -> None:
        """Stop DALI's workers and remove the plan directory (also done at garbage collection
        and at interpreter exit).

        Returns within :data:`feedpipe.io.reaper.DEFAULT_BOUND` (6 s): a worker that does not
        exit when asked (stuck in the dataset) is terminated, then killed, and reaped; one that
        outlives SIGKILL is reported by name and pid (a ``StuckWorkerWarning``).
        """
        self._new_generation()  # the plan directory first: workers waiting on it return
        self._fed = self._probe = None
        if self._caller is not None:
            self._caller.stop()
            self._caller = None

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

    def _new_generation(self) -> None:
        """Drop the pipeline and its plans, and end its workers; the next epoch builds anew.

        Asking: the removed plan directory ends a worker's wait for a plan, and dropping the
        last reference to the pipeline closes DALI's pool; a worker still busy after that (a
        read that hangs, or a pipeline the stuck DALI thread still holds) is terminated, then
        killed (:class:`~feedpipe.io.reaper.Workers`).
        """
        if self._plan_dir is not None:
            shutil.rmtree(self._plan_dir, ignore_errors=True)
            self._plan_dir = None
        self._pipe, self._tainted, self._spec = None, False, None
        self._pos = self._segs = self._last_end = 0
        self._workers.end()

    def _publish(self, indices: np.ndarray, start: int) -> int:
        """Write the next segment (``indices`` from DALI iteration ``start`` on); its id."""
        assert self._plan_dir is not None
        seg = self._segs
        _src.write_segment(Path(self._plan_dir), seg, start, indices, sorted(self._skip))
        self._segs += 1
        self._last_end = start + self._n_batches(len(indices))
        return seg

    def _start_epoch(self, indices: np.ndarray) -> int:
        """Make DALI produce ``indices`` next; returns the iteration of their first batch."""
        if self._tainted:  # a batch failed in the last epoch: start a new pipeline
            self._new_generation()
        spec, self._spec = self._spec, None
        if self._pipe is None:
            # the pid in the name tells whose plans these are (tests/conftest.py's leftover check)
            self._plan_dir = tempfile.mkdtemp(
                prefix=f"feedpipe-dali-{os.getpid()}-", dir=_shm_dir()
            )
            source = _src._BatchSource(
                self.dataset, self._plan_dir, self.batch_size, self.drop_last, gap=_PIPE_DEPTH
            )
            self._pos = self._segs = 0
            self._seg_id = self._publish(indices, 0)
            self._pipe = build_main(
                source,
                self.transform,
                batch_size=self.batch_size,
                num_threads=self.options.num_threads,
                device_id=self._device_id,
                seed=self._seed,
                py_num_workers=self.options.py_num_workers,
                py_start_method=self.options.py_start_method,
                prefetch=self._prefetch,
                prefetch_queue_depth=_PIPE_DEPTH,
                hw_decoder_load=self.options.hw_decoder_load,
            )
            self._workers.add(worker_processes(self._pipe))
            start = 0
        elif (
            spec is not None
            and spec[1] == self._pos
            and np.array_equal(spec[2], indices)
            and spec[3] == sorted(self._skip)
        ):  # predicted right: DALI is already on it
            self._seg_id, start = spec[0], spec[1]
        else:
            if spec is not None and spec[1] == self._pos:
                self._speculate = False  # this sampler's next order is not predictable
            if spec is None and self._pos == self._last_end:
                start = self._pos + _PIPE_DEPTH  # workers answer fillers up to here, then wait
            else:  # override iterations DALI may have asked for already (pipeline + prefetch)
                start = self._pos + _PIPE_DEPTH + self._prefetch + 2
            self._seg_id = self._publish(indices, start)
        if self._speculate:
            self._predict_next()
        return start

    def _predict_next(self) -> None:
        """Publish the order the sampler will give after ``set_epoch(epoch + 1)``, if knowable."""
        sampler = self.sampler
        epoch = getattr(sampler, "epoch", None)
        if (
            not hasattr(sampler, "set_epoch")
            or not isinstance(epoch, int)
            or getattr(sampler, "generator", None) is not None  # a shared RNG: never touch it
        ):
            self._speculate = False
            return
        try:
            twin = copy.copy(sampler)
            twin.set_epoch(epoch + 1)
            indices = np.fromiter((int(i) for i in twin), dtype=np.int64)
        except Exception:
            self._speculate = False
            return
        if self._n_batches(len(indices)) > 0:
            start = self._last_end
            self._spec = (self._publish(indices, start), start, indices, sorted(self._skip))

    def _run(self, pipe: Any, what: str) -> Any:
        """``pipe.run()`` with a timeout; a hung or dead worker raises WorkerError."""
        if self._caller is None:
            self._caller = _Caller()
        try:
            return self._caller.call(pipe.run, self.timeout)
        except TimeoutError:
            # its thread is stuck in DALI until the workers are ended below; a daemon, it
            # cannot block exit, and stop() lets it end once the stuck call returns
            self._caller.stop()
            self._caller = None
            self._new_generation()
            raise WorkerError(
                f"DALI pipeline produced no {what} within {self.timeout} s "
                f"(dataset {_describe(self.dataset)})"
            ) from None

    def _next(self, what: str) -> Any:
        """The next DALI output (advances the stream position, also when DALI raises)."""
        try:
            return self._run(self._pipe, what)
        except StopIteration:
            raise WorkerError(f"DALI pipeline ended before {what}") from None
        finally:
            self._pos += 1

    def _batches(self, indices: np.ndarray) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        bs = self.batch_size
        n_batches = self._n_batches(len(indices))
        if n_batches == 0:
            return
        start = self._start_epoch(indices)
        while self._pos < start:  # outputs of fillers or of overridden batches
            try:
                self._next("a discarded batch")
            except (WorkerError, KeyboardInterrupt):
                raise
            except Exception:
                self._tainted = True
        for b in range(n_batches):
            self.meter.wait_begin()
            try:
                with trace.span("feedpipe/decode"):  # the wait for DALI's decoded batch
                    out = self._next(f"batch {b}")
            except (WorkerError, KeyboardInterrupt):
                raise
            except Exception as exc:  # DALI could not decode this batch
                self._tainted = True  # DALI says the pipeline is no longer valid: rebuild later
                batch = indices[b * bs : (b + 1) * bs]
                images, labels, meta = self._repair(batch, exc)
            else:
                images, labels, meta = self._to_torch(out)
            expected = indices[b * bs : (b + 1) * bs]
            if not np.array_equal(meta[:, 0], expected) or (meta[:, 5] != self._seg_id).any():
                raise WorkerError(
                    f"DALI returned batch {b} out of order: indices {meta[:, 0].tolist()[:8]} of "
                    f"segment {meta[0, 5]}, expected {expected.tolist()[:8]} "
                    f"of segment {self._seg_id}"
                )
            self._account(meta)
            nbytes = int(meta[:, 4].sum())
            self.meter.add_stage("fetch", float(meta[:, 3].sum()) / 1e9, nbytes)
            self.meter.wait_end(samples=len(labels), nbytes=nbytes)
            self._delivered += len(labels)
            yield images, labels

    def _to_torch(self, out: Any) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        images = _tensor(out[0], self.device)
        labels = torch.from_numpy(np.asarray(out[1].as_tensor()).reshape(-1).copy())
        meta = np.asarray(out[2].as_tensor()).reshape(-1, _src._META_COLS)
        if self.device.type == "cuda":  # pinned: a pageable copy would wait for the stream
            labels = labels.pin_memory().to(self.device, non_blocking=True)
        return images, labels, meta

    def _account(self, meta: np.ndarray) -> None:
        """Raise for bad records (``on_error="raise"``) or count them (``"skip"``)."""
        for requested, used, reason in meta[:, :3].tolist():
            if requested == used:
                continue
            if self.on_error == "raise" and reason != _src.KNOWN_BAD:
                raise self._error(requested, reason)
            self.skipped += 1
            self._skip.add(requested)

    def _error(self, index: int, reason: int, cause: BaseException | None = None) -> DatasetError:
        if reason == _src.READ_ERROR and cause is None:
            try:
                self.dataset[index]
            except Exception as exc:
                cause = exc
        err = DatasetError(
            f"bad image in dataset {_describe(self.dataset)}, {_locate(self.dataset, index)} "
            f"(index {index}): {_src.REASONS[reason]}"
            + (f": {type(cause).__name__}: {cause}" if reason == _src.READ_ERROR and cause else "")
        )
        err.__cause__ = cause
        return err

    def _repair(
        self, batch: np.ndarray, exc: Exception
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """DALI failed on ``batch``: find undecodable records on the CPU, decode without them."""
        start = time.perf_counter()
        bufs, labels, rows = [], [], []
        for index in batch.tolist():
            while True:
                buf, label, row = _src.read_valid(self.dataset, index, self._skip)
                if self._decodes(buf):
                    break
                used = int(row[1])
                if self.on_error == "raise":
                    raise self._error(used, _src.DECODE_ERROR, exc)
                self._skip.add(used)  # the next read_valid moves past it
            if int(row[1]) != index and int(row[2]) == _src.OK:
                row[2] = _src.DECODE_ERROR
            row[5] = self._seg_id
            bufs.append(buf)
            labels.append(label)
            rows.append(row)
        if self._fed is None:
            self._fed = build_fed(
                self.transform,
                batch_size=self.batch_size,
                num_threads=self.options.num_threads,
                device_id=self._device_id,
                seed=self._seed + 1,
                hw_decoder_load=self.options.hw_decoder_load,
            )
        self._fed.feed_input("encoded", bufs)
        (images,) = self._run(self._fed, "repaired batch")
        self.meter.add_stage("repair", time.perf_counter() - start)
        label_t = torch.tensor(labels, dtype=torch.int64)
        return _tensor(images, self.device), label_t.to(self.device), np.stack(rows)

    def _decodes(self, buf: np.ndarray) -> bool:
        if self._probe is None:
            self._probe = build_probe()
        self._probe.feed_input("encoded", [buf])
        try:
            self._probe.run()
        except Exception:
            self._probe = build_probe()  # a failed pipeline is not reused
            return False
        return True


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


class _Caller:
    """Runs calls on one daemon thread so the caller can wait with a timeout.

    A daemon thread (unlike ``concurrent.futures`` workers, which are joined at interpreter exit)
    never keeps the process alive when DALI hangs.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="feedpipe-dali", daemon=True).start()

    def _loop(self) -> None:
        while (fn := self._tasks.get()) is not None:
            try:
                self._results.put((True, fn()))
            except BaseException as exc:
                self._results.put((False, exc))

    def call(self, fn: Any, timeout: float) -> Any:
        self._tasks.put(fn)
        try:
            ok, value = self._results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if ok:
            return value
        raise value

    def stop(self) -> None:
        self._tasks.put(None)


def _shm_dir() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def _describe(dataset: Any) -> str:
    for attr in ("path", "root", "url"):
        value = getattr(dataset, attr, None)
        if value is not None:
            return str(value)
    return type(dataset).__name__


def _locate(dataset: Any, index: int) -> str:
    """``"shard S (file), record R"`` when the dataset can tell, else ``"record I"``."""
    locate = getattr(dataset, "locate", None)
    if callable(locate):
        try:
            shard, record = locate(index)
            return f"shard {shard}, record {record}"
        except Exception:
            pass
    shards = getattr(getattr(dataset, "index", None), "shards", None)
    if isinstance(shards, list):  # a feedpipe MemmapDataset index: shards with record counts
        start = 0
        for sid, shard in enumerate(shards):
            records = int(getattr(shard, "records", 0))
            if start <= index < start + records:
                data = getattr(shard, "files", {}).get("data")
                name = f" ({data.path})" if data is not None else ""
                return f"shard {sid}{name}, record {index - start}"
            start += records
    return f"record {index}"
