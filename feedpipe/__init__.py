"""feedpipe: a drop-in, faster ``torch.utils.data.DataLoader`` with sharded datasets,
exact/elastic resume, a pinned GPU feed, DALI decoding, remote staging and stall counters.

Public names are imported lazily (PEP 562) so ``import feedpipe`` is cheap and has no
side effects; optional dependencies are only imported by the features that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from feedpipe._compat import MovedFinder as _MovedFinder

__version__ = "0.1.0"

# The old flat paths (feedpipe.memmap, feedpipe.convert, ...) import through one finder that
# answers for those eight names only and warns once each (feedpipe._compat). It must be on
# sys.meta_path before ``import feedpipe.memmap`` looks for the submodule, so it is installed
# here: the one thing importing feedpipe does besides defining names.
_MovedFinder.install()

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "DataLoader": "feedpipe.loader",
    "get_worker_info": "feedpipe.loader",
    "DistributedSampler": "feedpipe.sampler",
    "MemmapDataset": "feedpipe.datasets.memmap",
    "MemmapWriter": "feedpipe.datasets.writer",
    "TarDataset": "feedpipe.datasets.tar",
    "ZarrDataset": "feedpipe.datasets.zarr",
    "MixedDataset": "feedpipe.datasets.mixed",
    "convert": "feedpipe.datasets.convert",
    "stage": "feedpipe.remote.stage",
    "ShardCache": "feedpipe.remote.cache",
    "StallMeter": "feedpipe.stall.meter",
    "StallStats": "feedpipe.stall.stats",
    "TokenWindows": "feedpipe.datasets.tokens",
    "DatasetError": "feedpipe.errors",
    "GPUFeed": "feedpipe.device.feed",
    "ImageLoader": "feedpipe.dali.loader",
    "headspace": "feedpipe.stall.headspace",
}

__all__ = [
    "DataLoader",
    "DatasetError",
    "DistributedSampler",
    "GPUFeed",
    "ImageLoader",
    "MemmapDataset",
    "MemmapWriter",
    "MixedDataset",
    "ShardCache",
    "StallMeter",
    "StallStats",
    "TarDataset",
    "TokenWindows",
    "ZarrDataset",
    "__version__",
    "convert",
    "get_worker_info",
    "headspace",
    "stage",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from feedpipe.dali import ImageLoader
    from feedpipe.datasets.convert import convert
    from feedpipe.datasets.memmap import MemmapDataset, MemmapWriter
    from feedpipe.datasets.mixed import MixedDataset
    from feedpipe.datasets.tar import TarDataset
    from feedpipe.datasets.tokens import TokenWindows
    from feedpipe.datasets.zarr import ZarrDataset
    from feedpipe.device.feed import GPUFeed
    from feedpipe.errors import DatasetError
    from feedpipe.loader import DataLoader, get_worker_info
    from feedpipe.remote.cache import ShardCache
    from feedpipe.remote.stage import stage
    from feedpipe.sampler import DistributedSampler
    from feedpipe.stall import StallMeter, StallStats
    from feedpipe.stall.headspace import headspace


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'feedpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
