"""DALI image loading: ``ImageLoader`` (``loader``), its DALI graphs (``pipeline``) and the
parallel external source that reads a feedpipe dataset (``source``).

``feedpipe.dali.ImageLoader``, ``feedpipe.dali.ImageLoaderOptions`` and
``feedpipe.dali.Transform`` are the public paths.
"""

from __future__ import annotations

from feedpipe.dali.loader import ImageLoader, ImageLoaderOptions
from feedpipe.dali.pipeline import Transform

__all__ = ["ImageLoader", "ImageLoaderOptions", "Transform"]
