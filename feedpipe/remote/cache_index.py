"""The files of one dataset version as a shard cache sees them: its index, read once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.remote import transfer as _remote
from feedpipe.remote.transfer import INDEX_NAME, FileEntry

__all__ = ["CacheIndex"]


class CacheIndex:
    """The index of the dataset at ``url`` (``raw``: its bytes): entries by path and by shard,
    and each shard's main (largest) file. A path under ``reserved`` (the cache's lock folder)
    is refused."""

    def __init__(
        self, url: str, options: Mapping[str, Any], raw: bytes, entries: Iterable[FileEntry]
    ) -> None:
        self.url = url
        self._options = options
        self.raw = raw
        self.entries = {e.relpath: e for e in entries}
        self.by_shard: dict[int, list[str]] = {}
        for e in self.entries.values():
            self.by_shard.setdefault(e.shard, []).append(e.relpath)
        self.main = {
            max(rels, key=lambda rel: self.entries[rel].nbytes) for rels in self.by_shard.values()
        }

    @classmethod
    def load(
        cls,
        fs: Any,
        root: str,
        url: str,
        options: Mapping[str, Any],
        policy: _remote.RetryPolicy,
        *,
        raw: bytes | None = None,
        reserved: str,
    ) -> CacheIndex:
        """Parse ``raw`` (the index a caller already read) or read the remote index."""
        if raw is None:
            raw, entries = _remote.read_remote_index(fs, root, url, options, policy)
        else:
            entries = _remote.parse_index(raw, _remote.join(url, INDEX_NAME))
        index = cls(url, options, raw, entries)
        for rel in index.entries:  # the cache's own lock directory sits beside the files
            if rel.split("/", 1)[0] == reserved:
                shown = _remote.join(_remote.redact(url, options), INDEX_NAME)
                raise DatasetError(f"{shown}: file path {rel!r} is reserved by the cache")
        return index

    def name(self, relpath: str) -> str:
        """The redacted URL of ``relpath``, for messages."""
        return _remote.join(_remote.redact(self.url, self._options), relpath)

    def entry(self, relpath: str) -> FileEntry:
        try:
            return self.entries[relpath]
        except KeyError:
            raise DatasetError(f"{self.name(relpath)}: not listed in the index") from None

    def shard_files(self, shard: int) -> list[str]:
        return list(self.by_shard.get(shard, ()))

    def ahead(self, relpath: str, readahead: int) -> Iterator[str]:
        """The files of the ``readahead`` shards after that of ``relpath`` (index order)."""
        shard = self.entries[relpath].shard
        for k in range(shard + 1, shard + 1 + readahead):
            yield from self.by_shard.get(k, ())

    def eager(self, eager_bytes: int, limit_bytes: int | None) -> list[str]:
        """Side files up to ``eager_bytes`` each, when together they take a small part of the
        limit: eager fetches that do not fit would evict each other (and the shards in use)
        before their first use."""
        small = [
            e
            for e in self.entries.values()
            if e.nbytes <= eager_bytes and e.relpath not in self.main
        ]
        if small and (limit_bytes is None or sum(e.nbytes for e in small) <= limit_bytes // 4):
            return [e.relpath for e in small]
        return []
