"""DALI graphs for :mod:`feedpipe.dali`: decode + train/eval transforms, and a CPU probe."""

from __future__ import annotations

import multiprocessing
import shutil
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from feedpipe.errors import require

__all__ = ["PoolCloser", "Transform", "worker_processes"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Transform:
    """The image transforms: ``train`` = random resized crop + flip; eval = resize + center crop."""

    train: bool = True
    crop: int = 224
    resize: int = 256  # eval: shorter side before the center crop
    mean: tuple[float, ...] = IMAGENET_MEAN  # in [0, 1] units
    std: tuple[float, ...] = IMAGENET_STD
    output_layout: str = "NCHW"
    dtype: str = "float32"  # "float32" | "float16" | "uint8"
    random_area: tuple[float, float] = (0.08, 1.0)
    random_aspect_ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        if self.output_layout not in ("NCHW", "NHWC"):
            raise ValueError(f"output_layout must be 'NCHW' or 'NHWC', got {self.output_layout!r}")
        if self.dtype not in ("float32", "float16", "uint8"):
            raise ValueError(f"dtype must be 'float32', 'float16' or 'uint8', got {self.dtype!r}")
        for name in ("mean", "std", "random_area", "random_aspect_ratio"):  # lists -> tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))


def _dali_dtype(types: Any, name: str) -> Any:
    table = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def augment(encoded: Any, t: Transform, decode_device: str, hw_decoder_load: float) -> Any:
    """Decode ``encoded`` (a DataNode of encoded images) and apply the transforms of ``t``."""
    fn: Any = require("nvidia.dali.fn", "dali")
    types: Any = require("nvidia.dali.types", "dali")
    extra: dict[str, Any] = {}
    if decode_device == "mixed":  # nvJPEG + the hardware JPEG decoder
        extra = {
            "hw_decoder_load": hw_decoder_load,
            "device_memory_padding": 211025920,
            "host_memory_padding": 140544512,
        }
    if t.train:
        images = fn.decoders.image_random_crop(
            encoded,
            device=decode_device,
            output_type=types.RGB,
            random_area=list(t.random_area),
            random_aspect_ratio=list(t.random_aspect_ratio),
            num_attempts=100,
            **extra,
        )
        images = fn.resize(images, resize_x=t.crop, resize_y=t.crop, antialias=False)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(encoded, device=decode_device, output_type=types.RGB, **extra)
        images = fn.resize(images, resize_shorter=t.resize)
        mirror = 0
    layout = t.output_layout.removeprefix("N")
    if layout not in ("CHW", "HWC"):
        raise ValueError(f"output_layout must be 'NCHW' or 'NHWC', got {t.output_layout!r}")
    dtype = _dali_dtype(types, t.dtype)
    return fn.crop_mirror_normalize(
        images,
        dtype=dtype,
        output_layout=layout,
        crop=(t.crop, t.crop),
        mean=[m * 255 for m in t.mean] if t.dtype != "uint8" else [0.0] * 3,
        std=[s * 255 for s in t.std] if t.dtype != "uint8" else [1.0] * 3,
        mirror=mirror,
    )


def _pipeline(**options: Any) -> tuple[Any, Any, Any]:
    """A new DALI pipeline (dynamic executor) with ``options``, and DALI's ``fn`` and ``types``."""
    dali: Any = require("nvidia.dali", "dali")
    fn: Any = require("nvidia.dali.fn", "dali")
    types: Any = require("nvidia.dali.types", "dali")
    return dali.Pipeline(exec_dynamic=True, **options), fn, types


def build_main(
    source: Any,
    t: Transform,
    *,
    batch_size: int,
    num_threads: int,
    device_id: int | None,
    seed: int,
    py_num_workers: int,
    py_start_method: str,
    prefetch: int,
    prefetch_queue_depth: int,
    hw_decoder_load: float,
) -> Any:
    """The loader's pipeline: parallel external source -> decode -> transforms (+ labels, meta)."""
    pipe, fn, types = _pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        py_num_workers=py_num_workers,
        py_start_method=py_start_method,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    with pipe:
        encoded, labels, meta = fn.external_source(
            source,
            num_outputs=3,
            batch=True,
            batch_info=True,
            parallel=True,
            prefetch_queue_depth=prefetch,
            dtype=[types.UINT8, types.INT64, types.INT64],
        )
        decode_device = "cpu" if device_id is None else "mixed"
        pipe.set_outputs(augment(encoded, t, decode_device, hw_decoder_load), labels, meta)
    pipe.build()
    return pipe


def build_fed(
    t: Transform,
    *,
    batch_size: int,
    num_threads: int,
    device_id: int | None,
    seed: int,
    hw_decoder_load: float,
) -> Any:
    """Same graph, fed from the main process (``feed_input("encoded", ...)``): repairs a batch."""
    pipe, fn, types = _pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=1,
    )
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        decode_device = "cpu" if device_id is None else "mixed"
        pipe.set_outputs(augment(encoded, t, decode_device, hw_decoder_load))
    pipe.build()
    return pipe


def build_probe(num_threads: int = 1) -> Any:
    """A batch-of-one CPU decoder: tells which record of a failed batch DALI cannot decode."""
    pipe, fn, types = _pipeline(
        batch_size=1, num_threads=num_threads, device_id=None, prefetch_queue_depth=1
    )
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        pipe.set_outputs(fn.decoders.image(encoded, device="cpu", output_type=types.RGB))
    pipe.build()
    return pipe


class PoolCloser:
    """The polite request that ends a pipeline's source workers (the ``ask`` of its
    :class:`~feedpipe.io.reaper.Workers`): DALI's own pool close, on a daemon thread.

    Signalling a worker first is not safe: DALI's pool close (run later by the pipeline's
    finalizer, at the latest at interpreter exit) notifies the workers it counts as waiting and
    waits for each to wake; a worker killed while waiting never wakes, and the process hangs at
    exit. So the request removes the plan directory (a worker waiting for a plan returns), then
    closes the pool (it tells the waiting workers to exit), and the reaper's signals reach only
    a worker that did neither (one stuck in the dataset). The pipeline is held weakly.
    """

    def __init__(self) -> None:
        self._pipe: weakref.ref[Any] | None = None
        self._plans: str | None = None
        self._threads: list[threading.Thread] = []

    def watch(self, pipe: Any, plan_dir: str) -> None:
        """Close ``pipe``'s pool, after removing ``plan_dir``, when asked (the previous
        pipeline's pool is its finalizer's)."""
        self._pipe, self._plans = weakref.ref(pipe), plan_dir

    def __call__(self) -> None:
        if self._plans is not None:
            shutil.rmtree(self._plans, ignore_errors=True)
        pipe = None if self._pipe is None else self._pipe()
        pool = _pool(pipe)
        close = getattr(pool, "close", None)
        if callable(close):  # returns at once: the reaper waits for the workers, then signals
            # the pipeline's finalizer closes the pool too: a second close running beside this
            # one raises inside DALI ("Exception ignored in: <finalize object>"), so the pool's
            # close becomes once-only, and a later call returns at once
            once = _Once(close)
            pool.close = once
            t = threading.Thread(target=once, name="feedpipe-dali-pool-close", daemon=True)
            t.start()
            self._threads = [*(t for t in self._threads if t.is_alive()), t]

    def threads(self) -> list[threading.Thread]:
        """The pool-close threads started and not yet ended (to join)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        return list(self._threads)


class _Once:
    """``fn`` run by the first call only; later calls return at once (never wait for it)."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._called = False

    def __call__(self) -> None:
        with self._lock:
            if self._called:
                return
            self._called = True
        self._fn()


def worker_processes(pipe: Any) -> list[multiprocessing.process.BaseProcess]:
    """The Python worker processes of ``pipe``'s parallel external source (after ``build()``).

    DALI keeps them in its private ``Pipeline._py_pool`` (a ``WorkerPool``, whose public
    ``pids()`` lists them; DALI 1.x-2.4); they are matched, by pid, to this process's
    ``multiprocessing`` children, so that only processes this process started are ever signalled.
    """
    pids_of = getattr(_pool(pipe), "pids", None)
    if not callable(pids_of):
        return []
    pids = set(pids_of())
    return [p for p in multiprocessing.active_children() if p.pid in pids]


def _pool(pipe: Any) -> Any:
    """``pipe``'s worker pool (``None`` without one)."""
    return getattr(pipe, "_py_pool", None)  # DALI-internal: the one reach into DALI's privates
