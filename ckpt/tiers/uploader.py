"""``StepUploader``: one committed local step to the remote, verified, then committed there.

Its data files go in parallel (large files as multipart on S3, ``ckpt.tiers.s3put``), each one
verified against the manifest (``RemoteOptions.verify``: the store's digests, a read-back, or the
size); only then is the manifest written, and read back. A remote step that holds a different
save of the step is un-committed (its manifest deleted) first; one whose manifest ckpt did not
write is refused.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from ckpt import _faults, _owner
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.saving import commit
from ckpt.tiers import s3put
from ckpt.tiers.store import RemoteStore
from feedpipe.io import crc32c, to_hex
from feedpipe.io.trace import span

__all__ = ["StepUploader"]

log = logging.getLogger("ckpt")


class StepUploader:
    """Uploads steps to ``store``: files on ``files``' threads, multipart parts (and local
    checks) on ``parts``' (their own pool, so a file's thread that waits for its parts never
    holds a worker its parts need)."""

    def __init__(self, store: RemoteStore, files: Executor, parts: Executor) -> None:
        self.store, self.files, self.parts = store, files, parts
        self.options = store.options

    def upload(self, step: int, path: Path) -> int:
        """Upload the committed step in ``path`` (under a shared lock: local retention cannot
        take it meanwhile); return the bytes it holds (data files and manifest)."""
        with commit.reading(path):
            raw = (path / fmt.MANIFEST).read_bytes()
            body = fmt.read_manifest(path)
            existing = self.store.manifest(step)
            if existing is not None and not _owner.is_ckpt_manifest(existing):
                raise CheckpointError(
                    f"{self.store.where(step, fmt.MANIFEST)}: was not written by ckpt; refusing "
                    "to overwrite another tool's checkpoint (give ckpt a remote root of its own)"
                )
            if existing != raw:
                if existing is not None:  # a different save of this step: un-commit it first
                    self.store.call(
                        lambda: self.store.fs.rm_file(self.store.path(step, fmt.MANIFEST)),
                        step, fmt.MANIFEST, "delete",
                    )  # fmt: skip
                self._put_files(step, path, body["files"])
                self._commit(step, raw)
        nbytes: int = sum(rec["size"] for rec in body["files"]) + len(raw)
        return nbytes

    def _put_files(self, step: int, path: Path, recs: list[dict[str, Any]]) -> None:
        futures = [self.files.submit(self.put_verified, path, step, rec) for rec in recs]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _commit(self, step: int, raw: bytes) -> None:
        """Write the manifest (the remote commit), then read it back."""
        _faults.pause("upload_manifest")
        rpath = self.store.path(step, fmt.MANIFEST)
        self.store.makedirs(self.store.path(step), step, fmt.MANIFEST)
        self.store.call(lambda: self.store.fs.pipe_file(rpath, raw), step, fmt.MANIFEST, "upload")
        if self.store.manifest(step) != raw:
            raise CorruptCheckpointError(
                f"{self.store.where(step, fmt.MANIFEST)}: read back differs from the local manifest"
            )

    def put_verified(self, path: Path, step: int, rec: dict[str, Any]) -> None:
        """Upload one data file and verify it; a file that does not verify is sent once more."""
        # never through a symlink, at any component of the name (a symlinked directory too)
        name = rec["name"]
        local, rpath = fmt.inside(path, name), self.store.path(step, name)
        self.store.makedirs(rpath.rsplit("/", 1)[0], step, name)
        part = s3put.part_bytes(rec["size"], self.options.block_bytes, self.options.threads)
        for attempt in (1, 2):
            try:
                with span("ckpt/upload"):  # in the upload pool's thread
                    vouched = self._send(local, rpath, step, rec, part)
                _faults.pause("upload")
                self.verify(step, rec, vouched)
                return
            except s3put.LocalMismatchError:  # the local file itself: sending again cannot help
                raise
            except CorruptCheckpointError:
                if attempt == 2:
                    raise
                log.warning(
                    "ckpt: %s did not verify; uploading again", self.store.where(step, name)
                )

    def _send(self, local: Path, rpath: str, step: int, rec: dict[str, Any], part: int) -> bool:
        """Upload one data file; return whether the store vouched for every byte."""
        name = rec["name"]
        if self.store.is_s3:
            # the store vouches only for the bytes sent: those very bytes, as read for the
            # upload, are checked against the manifest's CRC32Cs before they go
            check = s3put.ChunkCheck(rec, str(local)) if self.options.verify == "auto" else None
            return s3put.put_file(
                self.store.fs, local, rpath, size=rec["size"], part_bytes=part, pool=self.parts,
                call=lambda fn, what: self.store.call(fn, step, name, what), check=check,
            )  # fmt: skip
        self.store.call(
            lambda: self.store.fs.put_file(
                str(local), rpath, chunksize=part, max_concurrency=self.options.threads
            ),
            step, name, "upload",
        )  # fmt: skip
        return False

    def verify(self, step: int, rec: dict[str, Any], vouched: bool = False) -> None:
        """Check the stored object of ``rec``: its size; then, unless ``verify="size"`` or the
        store vouched for every byte (``verify="auto"`` on S3; its size is checked then), every
        chunk read back."""
        if vouched and self.options.verify == "auto":
            return
        rpath, name = self.store.path(step, rec["name"]), rec["name"]
        where = self.store.where(step, name)
        info = self.store.call(lambda: self.store.fs.info(rpath), step, name, "stat")
        if int(info.get("size", -1)) != rec["size"]:
            raise CorruptCheckpointError(
                f"{where}: stored size {info.get('size')} != {rec['size']} bytes"
            )
        if self.options.verify == "size" or rec["size"] == 0:
            return
        self._read_back(step, rec, where)

    def _read_back(self, step: int, rec: dict[str, Any], where: str) -> None:
        """Every chunk of ``rec``'s object read back, ``threads`` ranges in flight (bounded
        memory), its CRC32C compared with the manifest's."""
        rpath, name, chunk = self.store.path(step, rec["name"]), rec["name"], rec["chunk_bytes"]
        starts = list(range(0, rec["size"], chunk))
        ends = [min(s + chunk, rec["size"]) for s in starts]
        flight = self.options.threads
        for lo in range(0, len(starts), flight):
            s_, e_ = starts[lo : lo + flight], ends[lo : lo + flight]

            def get(s_: list[int] = s_, e_: list[int] = e_) -> list[bytes]:
                return list(self.store.fs.cat_ranges([rpath] * len(s_), s_, e_, on_error="raise"))

            pieces = self.store.call(get, step, name, "read back")
            for i, piece in enumerate(pieces, start=lo):
                actual = to_hex(crc32c(piece))
                if actual != rec["crc32c"][i]:
                    raise CorruptCheckpointError(
                        f"{where}: read back chunk {i} has CRC32C {actual} != {rec['crc32c'][i]}"
                    )
