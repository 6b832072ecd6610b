"""How :class:`~feedpipe.dali.ImageLoader` runs DALI (:class:`ImageLoaderOptions`), and the flat
keywords that override its fields and those of the :class:`~feedpipe.dali.Transform`."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from feedpipe.dali.pipeline import Transform

__all__ = ["ImageLoaderOptions", "split_flat"]


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

    @property
    def readahead(self) -> int:
        """Batches the readers prepare ahead (``prefetch``, or its default)."""
        return self.prefetch if self.prefetch is not None else max(4, 2 * self.py_num_workers)


_TRANSFORM_FIELDS = frozenset(f.name for f in fields(Transform))
_OPTION_FIELDS = frozenset(f.name for f in fields(ImageLoaderOptions))


def split_flat(
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
