"""``TarDataset``: WebDataset-style ``.tar`` shards, read in place, for trying data before
converting it.

A sample is the run of consecutive regular-file members that share a key: the member's path up
to the first ``.`` of its file name (``a/b/000017.jpg`` and ``a/b/000017.cls`` are sample
``a/b/000017`` with fields ``jpg`` and ``cls``), as WebDataset groups them. ``ds[i]`` is a dict
``{"__key__": key, "__url__": shard, field: bytes, ...}`` (after ``transform`` when given).

The index is built once, from the tar headers: ``tarfile`` reads each header and seeks past the
member's data, through a buffer (local shards: the file's own, URLs: fsspec read-ahead blocks of
``INDEX_BLOCK`` bytes), so the data of members smaller than the buffer is read along with the
headers, and that of larger ones is skipped. Reads are then one positioned read per field, so
the dataset is map-style: shuffling, the distributed sampler and exact resume work as for any
dataset. Compressed tars have no offsets to seek to and are refused, naming the shard.
Directories, links, special members and names WebDataset skips (no extension, a dot file) are
skipped; sparse members are refused; a member that runs past the end of its shard (a truncated
download) is a :class:`~feedpipe.DatasetError` naming the shard and the member.

A shard that changes after it was indexed is a ``DatasetError`` naming it: a local shard is
checked (size, mtime) before each sample is read (a shard replaced by rename after a reader
opened it is read as it was: the open file is the old one), a remote one (size, ETag) when a
reader opens it, and on S3 every read is conditional on the ETag indexed (``If-Match``), so a
replaced object is never read at the old offsets.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from feedpipe.errors import DatasetError
from feedpipe.io.fsutil import read_exactly
from feedpipe.io.remote import is_remote, local_file_path
from feedpipe.remote.transfer import call, resolve

__all__ = ["INDEX_BLOCK", "TarDataset", "expand_shards"]

_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")
_MAX_SHARDS = 1_000_000  # shards a brace pattern may name
#: fsspec read-ahead while a remote shard is indexed: few requests for shards of small members,
#: and at most this much of each larger member read (s3fs's default block is 50 MiB)
INDEX_BLOCK = 8 << 20


def expand_shards(spec: str | os.PathLike[str] | Sequence[str]) -> list[str]:
    """Shard paths from a list, or from a brace pattern ``"data-{000..099}.tar"`` (zero-padded
    to the width of the first bound, as WebDataset writes them); a ``Path`` is one shard."""
    if isinstance(spec, os.PathLike):
        return [os.fspath(spec)]
    if not isinstance(spec, str):
        return [os.fspath(s) for s in spec]
    m = _BRACES.search(spec)
    if m is None:
        return [spec]
    total = 1
    for b in _BRACES.finditer(spec):  # before any list is built: a typo must not eat the RAM
        total *= max(0, int(b.group(2)) - int(b.group(1)) + 1)
        if total > _MAX_SHARDS:
            raise ValueError(
                f"shard pattern {spec!r} names more than {_MAX_SHARDS:,} shards; is a bound "
                "mistyped?"
            )
    lo, hi = int(m.group(1)), int(m.group(2))
    if hi < lo:
        raise ValueError(f"shard pattern {spec!r}: {{{lo}..{hi}}} is empty")
    width = len(m.group(1))
    return [
        p
        for i in range(lo, hi + 1)
        for p in expand_shards(spec[: m.start()] + f"{i:0{width}d}" + spec[m.end() :])
    ]


_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext


def _split(name: str) -> tuple[str, str] | None:
    """WebDataset's key and field of a member name; None for a name WebDataset skips (no
    extension, like ``README``, or a dot file, like macOS's ``._0001.jpg``)."""
    m = _KEY.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


def _remote_stamp(f: Any, fs: Any, path: str) -> tuple[int, int | str | None]:
    """(size, ETag or object version) of an open remote file, from the details fsspec fetched
    when it opened it (no extra request)."""
    info = getattr(f, "details", None) or fs.info(path)
    tag = next(
        (info[k] for k in ("ETag", "etag", "generation", "VersionId", "mtime") if info.get(k)),
        None,
    )
    return int(info.get("size") or 0), None if tag is None else str(tag)


class _Capped:
    """A file's ``read``/``seek``/``tell`` for ``tarfile``, reads cut at the file's length."""

    def __init__(self, f: Any, length: int) -> None:
        self._f, self._length = f, length

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._length - self._f.tell())
        return bytes(self._f.read(left if n is None or n < 0 else min(n, left)))

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return int(self._f.seek(offset, whence))

    def tell(self) -> int:
        return int(self._f.tell())


def _read_headers(f: Any, shard: str) -> tuple[list[tarfile.TarInfo], int]:
    """The members of the open shard ``f`` and its length; ``DatasetError`` for a compressed,
    truncated or hostile tar."""
    head = f.read(4)
    f.seek(0)
    if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head == b"\xfd7zX":
        raise DatasetError(
            f"{shard} is a compressed tar: its members cannot be read in place; "
            "decompress it (or convert it with `feedpipe convert`)"
        )
    f.seek(0, os.SEEK_END)
    length = int(f.tell())
    f.seek(0)
    try:
        # capped reads: a hostile pax or long-name header claiming terabytes would make
        # tarfile ask for a buffer of that size (a MemoryError, or the OOM killer)
        capped: Any = _Capped(f, length)
        tar = tarfile.open(fileobj=capped, mode="r:")  # noqa: SIM115
        members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError, ValueError, OverflowError, MemoryError) as exc:
        # hostile headers (a negative or huge pax size) make tarfile seek out of range
        raise DatasetError(f"{shard} is truncated or not a tar: {exc}") from exc
    if length - tar.offset < 2 * tarfile.BLOCKSIZE:
        raise DatasetError(
            f"{shard} ends without the tar end-of-archive marker after member "
            f"{members[-1].name if members else '(none)'!r}: the shard is truncated"
        )
    return members, length


def _member_span(m: tarfile.TarInfo, shard: str, length: int) -> tuple[str, str, int, int] | None:
    """``(key, field, offset, size)`` of a member, None for one WebDataset skips; a sparse or
    truncated member is a ``DatasetError``."""
    split = _split(m.name)
    if not m.isreg() or split is None:
        return None
    if m.issparse() or m.size < 0:  # a sparse member's bytes are not its data
        raise DatasetError(
            f"{shard}: member {m.name!r} is "
            f"{'sparse' if m.issparse() else f'of negative size {m.size}'}: "
            "TarDataset reads members in place and cannot hold it"
        )
    if m.offset_data + m.size > length:
        raise DatasetError(
            f"{shard}: member {m.name!r} ends at byte {m.offset_data + m.size}, past "
            f"the end of the shard ({length} B): the shard is truncated"
        )
    return split[0], split[1], m.offset_data, m.size


class _SampleRun:
    """Groups a shard's consecutive members that share a key into samples, appended to
    ``samples`` as ``(shard number, key, ((field, offset, size), ...))``."""

    def __init__(self, number: int, shard: str, samples: list[Any]) -> None:
        self.number, self.shard, self.samples = number, shard, samples
        self.key: str | None = None
        self.fields: dict[str, tuple[int, int]] = {}

    def add(self, key: str, field: str, offset: int, size: int) -> None:
        if key != self.key:
            self.flush()
            self.key, self.fields = key, {}
        if field in self.fields:
            raise DatasetError(f"{self.shard}: sample {key!r} has two {field!r} members")
        self.fields[field] = (offset, size)

    def flush(self) -> None:
        if self.key is not None and self.fields:
            spans = tuple((f, off, size) for f, (off, size) in self.fields.items())
            self.samples.append((self.number, self.key, spans))


class TarDataset:
    """Map-style dataset over WebDataset ``.tar`` shards (local paths or fsspec URLs).

    Args:
      shards: a path, a brace pattern (``"s3://b/train-{0000..0099}.tar"``) or a list.
      transform: called on each sample dict (e.g. decode the image), in the worker.
      storage_options: fsspec options for URLs (credentials never appear in errors).
    """

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str],
        *,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.shards = [local_file_path(s) for s in expand_shards(shards)]  # file:///abs: /abs
        if not self.shards:
            raise ValueError("TarDataset needs at least one shard")
        self.transform = transform
        self.storage_options = dict(storage_options or {})
        # per sample: (shard number, key, ((field, offset, size), ...))
        self._samples: list[tuple[int, str, tuple[tuple[str, int, int], ...]]] = []
        # what each shard was when indexed: local (size, mtime_ns), remote (size, ETag or version)
        self._stamps: dict[int, tuple[int, int | str | None]] = {}
        for number, shard in enumerate(self.shards):
            self._index(number, shard)
        self._local = threading.local()

    # ------------------------------------------------------------------ index
    def _open(self, number: int, shard: str) -> Any:
        if is_remote(shard):
            fs, path = resolve(shard, self.storage_options)
            f = call(
                lambda: fs.open(path, "rb", block_size=INDEX_BLOCK, cache_type="readahead"),
                shard,
                what="open",
                storage_options=self.storage_options,
            )
            self._stamps[number] = _remote_stamp(f, fs, path)
            return f
        try:
            f = open(shard, "rb")  # noqa: SIM115 - the caller closes it
        except OSError as exc:
            raise DatasetError(f"cannot open tar shard {shard}: {exc}") from exc
        st = os.fstat(f.fileno())
        self._stamps[number] = (st.st_size, st.st_mtime_ns)
        return f

    def _index(self, number: int, shard: str) -> None:
        with self._open(number, shard) as f:
            members, length = _read_headers(f, shard)
        run = _SampleRun(number, shard, self._samples)
        for m in members:
            span = _member_span(m, shard, length)
            if span is not None:
                run.add(*span)
        run.flush()

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._samples)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]  # open files stay in the process that opened them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _here(self) -> Any:
        """This thread's open files and filesystems, fresh after a fork (s3fs is not fork-safe)."""
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            local.fds, local.remote, local.pid = {}, {}, os.getpid()
        return local

    def _fd(self, number: int) -> int:
        fds: dict[int, int] = self._here().fds
        fd = fds.get(number)
        if fd is None:
            shard = self.shards[number]
            try:
                fd = os.open(shard, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise DatasetError(f"cannot open tar shard {shard}: {exc}") from exc
            try:
                self._check_local(number, fd)
            except DatasetError:
                os.close(fd)
                raise
            fds[number] = fd
        return fd

    def _check_local(self, number: int, fd: int) -> None:
        """Raise if the open local shard differs from the one indexed (size, mtime): checked
        when it is opened and before each sample, so a rewrite in place is never read."""
        st = os.fstat(fd)
        was = self._stamps.get(number, (st.st_size, st.st_mtime_ns))
        if was != (st.st_size, st.st_mtime_ns):  # replaced or rewritten since indexing
            raise DatasetError(
                f"tar shard {self.shards[number]} changed after it was indexed (size {was[0]} "
                f"-> {st.st_size} B, mtime changed: {was[1] != st.st_mtime_ns}): its member "
                "offsets no longer hold (short reads or wrong bytes); index it again"
            )

    def _remote(self, number: int) -> Any:
        """This thread's open file of a remote shard, checked against the indexed stamp; on S3
        every later read is conditional on the indexed ETag (``If-Match``)."""
        cache: dict[int, Any] = self._here().remote
        f = cache.get(number)
        if f is None:
            shard = self.shards[number]
            fs, path = resolve(shard, self.storage_options)
            fs.invalidate_cache(path)  # a listing cached before the replacement is stale
            f = call(
                lambda: fs.open(path, "rb", cache_type="none"),
                shard,
                what="open",
                storage_options=self.storage_options,
            )
            now = _remote_stamp(f, fs, path)
            if now != self._stamps.get(number, now):
                f.close()
                raise self._changed(number, f"{self._stamps[number]} -> {now}")
            cache[number] = f
        return f

    def _changed(self, number: int, how: str) -> DatasetError:
        return DatasetError(
            f"tar shard {self.shards[number]} changed after it was indexed ((size, ETag) "
            f"{how}): its member offsets no longer hold; index it again"
        )

    def _read(self, number: int, offset: int, size: int) -> bytes:
        shard = self.shards[number]
        if is_remote(shard):
            f = self._remote(number)

            def positioned() -> bytes | None:
                f.seek(offset)
                try:
                    return bytes(f.read(size))
                except OSError as exc:
                    if type(exc).__name__ == "FileExpired":  # s3fs: If-Match failed (412)
                        return None
                    raise

            got = call(positioned, shard, storage_options=self.storage_options)
            if got is None:
                self._here().remote.pop(number, None)
                raise self._changed(number, f"{self._stamps.get(number)} -> (replaced)")
            data: bytes = got
        else:
            data = read_exactly(self._fd(number), size, offset)
        if len(data) != size:
            raise DatasetError(
                f"{shard}: short read at byte {offset} ({len(data)} of {size} B): the shard "
                "changed or was truncated after it was indexed"
            )
        return bytes(data)

    def __getitem__(self, index: int) -> Any:
        n = len(self._samples)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        number, key, spans = self._samples[index]
        sample: dict[str, Any] = {"__key__": key, "__url__": self.shards[number]}
        if spans and not is_remote(self.shards[number]):
            self._check_local(number, self._fd(number))  # one fstat: a rewrite since opening
        for field, offset, size in spans:
            sample[field] = self._read(number, offset, size)
        return self.transform(sample) if self.transform is not None else sample

    def __getitems__(self, indices: Iterable[int]) -> list[Any]:
        return [self[int(i)] for i in indices]

    def keys(self) -> list[str]:
        """Every sample's key, in order."""
        return [key for _, key, _ in self._samples]

    def __repr__(self) -> str:
        return f"TarDataset({len(self.shards)} shards, {len(self)} samples)"
