"""One file to S3 in parallel parts, with the store's own digest of what it received.

s3fs's ``put_file`` sends the parts of a file in rounds of ``max_concurrency`` on its one event
loop and keeps nothing a caller could check the stored bytes against but the size. This module
drives the same S3 calls through s3fs's client (``fs.call_s3``: its session, credentials and
endpoint), with each part read and hashed in a caller's thread pool, so every part is in flight
at once and the reads and MD5s run beside the network (``hashlib`` releases the GIL).

What the store vouches for (``verify="auto"``, :mod:`ckpt.remote`):

1. Each part (or the single ``PutObject`` body) is sent with its ``Content-MD5``: S3 rejects a
   body that does not match it (``BadDigest``), and the part is sent again.
2. S3's ETag of a part, and of a single-request object, is the MD5 of the bytes it stored; the
   ETag of a completed multipart object is the MD5 of the part MD5s, then ``-`` and the number
   of parts. Both are computed by the store from what it received and compared here with the
   MD5s of the bytes read from the local file; with the stored size from a ``HeadObject``.
   A byte altered in flight, or a part lost, repeated or reordered changes one of them.

Stores whose ETags are not MD5s (objects encrypted with SSE-KMS or SSE-C, some S3-compatible
stores) cannot vouch this way: :func:`put_file` then returns ``False`` and the caller reads the
object back (the ``"readback"`` route).

The store vouches only for the bytes sent, so they are checked against the manifest as they are
sent: ``check`` (a :class:`ChunkCheck`) sees every part's bytes, as read for the upload, before
they go, and compares the manifest's per-chunk CRC32Cs whatever the part boundaries. A file that
changes after an earlier check, or a read that returns other bytes, fails the upload.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from ckpt.errors import CorruptCheckpointError
from feedpipe.io import crc32c, read_exactly, to_hex
from feedpipe.io.futures import results_or_first_error

__all__ = [
    "MAX_PART",
    "MAX_PARTS",
    "MIN_PART",
    "Call",
    "ChunkCheck",
    "LocalMismatchError",
    "is_s3",
    "part_bytes",
    "put_file",
    "stale_uploads",
]

MAX_PARTS = 10_000  # S3's most parts in one multipart upload
MIN_PART = 5 << 20  # S3's smallest multipart part (all but the last)
MAX_PART = 5 << 30  # S3's largest part, and largest single PutObject

Call = Callable[[Callable[[], Any], str], Any]
"""Runs one remote request with the caller's retries: ``call(fn, what)``."""


def is_s3(fs: Any) -> bool:
    """True for an s3fs filesystem (the only one whose client this module drives)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "s3" in protocols and callable(getattr(fs, "call_s3", None))


def part_bytes(size: int, block_bytes: int, threads: int) -> int:
    """The multipart part size for a file of ``size`` bytes: at most ``block_bytes``, and small
    enough that the file has ``threads`` parts to send at once, but never under S3's 5 MiB, and
    large enough that the file has at most S3's 10,000 parts."""
    part = max(MIN_PART, min(block_bytes, -(-size // max(1, threads))))
    return max(part, -(-size // MAX_PARTS))


class LocalMismatchError(CorruptCheckpointError):
    """Bytes read from the local file that do not match its manifest (:class:`ChunkCheck`)."""


_POLY = 0x82F63B78  # CRC32C, reflected


def _gf2_times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec, i = vec >> 1, i + 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(mat, v) for v in mat)


@functools.lru_cache(maxsize=64)
def _zeros(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator that runs a CRC32C register over ``nbytes`` zero bytes (cached: the
    pieces of a file's chunks come in a few lengths)."""
    op: tuple[int, ...] = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    for _ in range(3):
        op = _square(op)  # one zero byte
    out = tuple(1 << n for n in range(32))  # identity
    while nbytes:
        if nbytes & 1:
            out = tuple(_gf2_times(op, v) for v in out)
        nbytes >>= 1
        if nbytes:
            op = _square(op)
    return out


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (zlib's method)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros(len2), crc1) ^ crc2


class ChunkCheck:
    """Compares bytes read for an upload with a manifest record's per-chunk CRC32Cs: called as
    ``check(offset, data)`` for each part, in any order and from any thread; a chunk cut by a
    part boundary is checked once all its pieces were seen (their CRC32Cs combined)."""

    def __init__(self, rec: dict[str, Any], where: str) -> None:
        self._chunk, self._size, self._crcs = rec["chunk_bytes"], rec["size"], rec["crc32c"]
        self._where = where
        self._pieces: dict[int, dict[int, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def _compare(self, i: int, value: int) -> None:
        if to_hex(value) != self._crcs[i]:
            lo = i * self._chunk
            raise LocalMismatchError(
                f"{self._where}: checksum mismatch in chunk {i} (bytes {lo}-"
                f"{min(lo + self._chunk, self._size)}) as read for the upload: "
                f"{to_hex(value)} != {self._crcs[i]}"
            )

    def __call__(self, offset: int, data: bytes) -> None:
        view, end, chunk = memoryview(data), offset + len(data), self._chunk
        i = offset // chunk
        while i * chunk < end:
            first, last = i * chunk, min((i + 1) * chunk, self._size)
            lo, hi = max(offset, first), min(end, last)
            value = crc32c(view[lo - offset : hi - offset])
            if (lo, hi) == (first, last):
                self._compare(i, value)
            else:
                with self._lock:
                    pieces = self._pieces.setdefault(i, {})
                    pieces[lo] = (value, hi - lo)
                    whole = sum(n for _, n in pieces.values()) == last - first
                    if whole:
                        del self._pieces[i]
                if whole:
                    total = 0
                    for start in sorted(pieces):
                        piece, n = pieces[start]
                        total = crc32c_combine(total, piece, n)
                    self._compare(i, total)
            i += 1


def _etag(response: dict[str, Any]) -> str:
    return str(response.get("ETag", "")).strip('"').lower()


def _read(fd: int, offset: int, size: int, path: Path) -> bytes:
    data = read_exactly(fd, size, offset)  # a short read goes on
    if len(data) < size:  # the file shrank
        raise CorruptCheckpointError(f"{path}: ended at byte {offset + len(data)} while uploading")
    return data


def _bad_digest(exc: BaseException | None) -> bool:
    """True if ``exc`` or an error it was raised from is S3's ``BadDigest``."""
    seen = 0
    while exc is not None and seen < 16:
        if "BadDigest" in repr(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _send(call: Call, send: Callable[[], dict[str, Any]], where: str) -> dict[str, Any]:
    """One request whose body carries a ``Content-MD5``; a ``BadDigest`` answer (the body was
    altered on the way) is sent once more, then raised as ``CorruptCheckpointError``."""
    try:
        return dict(call(send, "upload"))
    except Exception as exc:
        if not _bad_digest(exc):
            raise
    try:
        return dict(call(send, "upload"))
    except Exception as exc:
        if not _bad_digest(exc):
            raise
        raise CorruptCheckpointError(
            f"{where}: the store rejected the body twice (its Content-MD5 did not match)"
        ) from exc


class _Source:
    """The local file of one upload, open at ``fd``: each part is read whole and shown to
    ``check`` before it is sent."""

    def __init__(self, fd: int, local: Path, check: Callable[[int, bytes], None] | None) -> None:
        self.fd, self.local, self.check = fd, local, check

    def read(self, offset: int, size: int) -> bytes:
        data = _read(self.fd, offset, size, self.local)
        if self.check is not None:
            self.check(offset, data)
        return data


def _open_local(local: Path, size: int) -> int:
    """``local`` opened for reading (never through a symlink: nothing in a checkpoint directory
    is followed out of it), once it is ``size`` bytes."""
    try:
        fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CorruptCheckpointError(f"{local}: cannot open for upload: {exc.strerror}") from None
    if os.fstat(fd).st_size != size:
        found = os.fstat(fd).st_size
        os.close(fd)
        raise CorruptCheckpointError(f"{local}: {found} bytes, the manifest says {size}")
    return fd


def _md5(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


class _ObjectUpload:
    """The requests that store one object at ``rpath`` through the caller's retrying ``call``;
    each upload returns the ETag it expects and whether the store's ETags matched so far."""

    def __init__(self, fs: Any, rpath: str, call: Call, local: Path) -> None:
        self.fs, self.rpath, self.call, self.local = fs, rpath, call, local
        self.bucket, self.key, _ = fs.split_path(rpath)
        self.where = f"{rpath} ({local.name})"

    def _s3(self, method: str, **kwargs: Any) -> Callable[[], dict[str, Any]]:
        return lambda: dict(self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs))

    def put(self, data: bytes) -> tuple[str, bool]:
        """One ``PutObject`` with its ``Content-MD5``."""
        digest = _md5(data)
        md5 = base64.b64encode(digest).decode()
        out = _send(self.call, self._s3("put_object", Body=data, ContentMD5=md5), self.where)
        return digest.hex(), _etag(out) == digest.hex()

    def multipart(
        self, source: _Source, size: int, part_bytes: int, pool: Executor
    ) -> tuple[str, bool]:
        """Every part at once on ``pool``, then the completion; any failure aborts the upload
        (no parts left billed) and is raised."""
        upload_id = dict(self.call(self._s3("create_multipart_upload"), "upload"))["UploadId"]
        try:
            results = self._parts(upload_id, source, size, part_bytes, pool)
            whole = hashlib.md5(b"".join(d for d, _ in results), usedforsecurity=False)
            expected = f"{whole.hexdigest()}-{len(results)}"
            out = self._complete(upload_id, results, expected)
        except BaseException:
            with contextlib.suppress(Exception):  # leave no parts billed; the error is the news
                self._s3("abort_multipart_upload", UploadId=upload_id)()
            raise
        vouched = all(etag == d.hex() for d, etag in results) and _etag(out) == expected
        return expected, vouched

    def _parts(
        self, upload_id: str, source: _Source, size: int, part_bytes: int, pool: Executor
    ) -> list[tuple[bytes, str]]:
        """Send every part; ``(MD5 sent, ETag stored)`` each. After a failed part no more are
        sent, and every read is over before this returns (the caller closes the file)."""

        def one(number: int, offset: int) -> tuple[bytes, str]:
            data = source.read(offset, min(part_bytes, size - offset))
            digest = _md5(data)
            send = self._s3(
                "upload_part", UploadId=upload_id, PartNumber=number, Body=data,
                ContentMD5=base64.b64encode(digest).decode(),
            )  # fmt: skip
            out = _send(
                self.call, send, f"{self.bucket}/{self.key} part {number} ({self.local.name})"
            )
            return digest, _etag(out)

        return results_or_first_error(
            [pool.submit(one, n, off) for n, off in enumerate(range(0, size, part_bytes), start=1)]
        )

    def _complete(
        self, upload_id: str, results: list[tuple[bytes, str]], expected: str
    ) -> dict[str, Any]:
        parts = [{"PartNumber": n, "ETag": etag} for n, (_, etag) in enumerate(results, 1)]
        complete = self._s3(
            "complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
        try:
            return dict(self.call(complete, "upload"))
        except Exception:
            # the completion may have been done by the store and only its reply lost (a retry
            # then finds no such upload): the object's ETag tells whether it is exactly these
            # parts; otherwise the error stands
            found = _completed(self.fs, self.bucket, self.key, expected)
            if found is None:
                raise
            return found

    def stored(self, size: int) -> dict[str, Any]:
        """The object's ``HeadObject``, once its stored size is ``size``."""
        self.fs.invalidate_cache(self.rpath)
        head = dict(self.call(self._s3("head_object"), "stat"))
        if int(head.get("ContentLength", -1)) != size:
            raise CorruptCheckpointError(
                f"{self.where}: stored size {head.get('ContentLength')} != {size} bytes"
            )
        return head


def put_file(
    fs: Any,
    local: Path,
    rpath: str,
    *,
    size: int,
    part_bytes: int,
    pool: Executor,
    call: Call,
    check: Callable[[int, bytes], None] | None = None,
) -> bool:
    """Upload ``local`` (``size`` bytes) to ``rpath`` in parts of ``part_bytes``, sent at once
    on ``pool``'s threads; a file of at most one part goes in one request. ``check(offset,
    data)`` sees every part's bytes before they are sent, and may raise to stop the upload.

    Raises ``CorruptCheckpointError`` if the local file is not ``size`` bytes or the stored size
    differs. Returns whether the store's ETags vouch for every byte (module docstring);
    ``False`` means they could not, and the object must be read back to be verified."""
    upload = _ObjectUpload(fs, rpath, call, local)
    if -(-size // part_bytes) > MAX_PARTS:
        raise ValueError(
            f"{upload.where}: {size} bytes in parts of {part_bytes} is over S3's {MAX_PARTS} parts"
        )
    fd = _open_local(local, size)
    try:
        source = _Source(fd, local, check)
        if size <= part_bytes:
            expected, vouched = upload.put(source.read(0, size))
        else:
            expected, vouched = upload.multipart(source, size, part_bytes, pool)
    finally:
        os.close(fd)
    head = upload.stored(size)  # always: the stored size is checked whatever the ETags say
    return vouched and _etag(head) == expected


def _completed(fs: Any, bucket: str, key: str, expected: str) -> dict[str, Any] | None:
    """The ``HeadObject`` of ``key`` if its ETag is ``expected`` (the multipart ETag of the
    parts just sent), else ``None``."""
    try:
        fs.invalidate_cache(f"{bucket}/{key}")
        head = dict(fs.call_s3("head_object", Bucket=bucket, Key=key))
    except Exception:
        return None
    return head if _etag(head) == expected else None


def stale_uploads(fs: Any, root: str, before: float) -> list[tuple[str, str, str]]:
    """Multipart uploads under ``root`` begun before ``before`` (seconds since the epoch) and
    never completed or aborted (an uploader killed mid-file leaves its parts stored, and billed):
    ``(path relative to root, key, upload id)`` each."""
    bucket, prefix, _ = fs.split_path(root)
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    out: list[tuple[str, str, str]] = []
    page_args: dict[str, str] = {}
    for _ in range(100_000):  # pages of up to 1,000; bounded, never a loop without end
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **page_args)
        for upload in page.get("Uploads") or []:
            initiated = upload.get("Initiated")
            when = initiated.timestamp() if hasattr(initiated, "timestamp") else float("inf")
            if when < before:
                key = str(upload["Key"])
                out.append((key[len(prefix) :], key, str(upload["UploadId"])))
        if not page.get("IsTruncated"):
            break
        page_args = {
            "KeyMarker": str(page.get("NextKeyMarker", "")),
            "UploadIdMarker": str(page.get("NextUploadIdMarker", "")),
        }
    return out
