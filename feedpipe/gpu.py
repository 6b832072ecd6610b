"""Moved to :mod:`feedpipe.device.feed`; this public path re-exports it."""

from feedpipe.device.feed import GPUFeed, GPUFeedWarning, Prefetcher, map_tensors, resolve_device

__all__ = ["GPUFeed", "GPUFeedWarning", "Prefetcher", "map_tensors", "resolve_device"]
