"""DALI image loading: ``ImageLoader`` (``loader``), its DALI graphs (``pipeline``) and the
parallel external source that reads a feedpipe dataset (``source``).

``feedpipe.dali.ImageLoader`` is the public path.
"""

from __future__ import annotations

from feedpipe.dali.loader import ImageLoader

__all__ = ["ImageLoader"]
