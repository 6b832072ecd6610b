"""Moved to :mod:`feedpipe.remote.cache`; this public path re-exports it."""

from feedpipe.remote.cache import CacheStats, ShardCache

__all__ = ["CacheStats", "ShardCache"]
