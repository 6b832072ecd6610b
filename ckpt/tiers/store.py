"""``RemoteStore``: the remote root of one tier, and every request made to it.

It owns the fsspec filesystem, the names of a step's objects (``URL/step-N/NAME``) and the
retrying call (``transfer``: ``feedpipe.io``'s ``call``, its errors raised as ckpt's
``RemoteCheckpointError``). It decides nothing: the uploader, the remote retention and the
restore path ask it to list, read, write and delete.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt import _layout
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError, RemoteCheckpointError
from ckpt.tiers import s3put
from ckpt.tiers.listing import RemoteListing, list_remote
from ckpt.tiers.options import RemoteOptions
from feedpipe.io import RetryPolicy, call, is_s3_url, redact, resolve
from feedpipe.io.dirfd import Dir, Tree, UnsafePathError, fd_path

__all__ = ["RemoteStore", "client_options", "transfer"]

_REPLACED = "was replaced while the download wrote into it"


def transfer(
    fn: Callable[[], Any],
    url: str,
    what: str,
    policy: RetryPolicy,
    storage_options: Mapping[str, Any] | None,
) -> Any:
    """``feedpipe.io``'s retrying ``call``, its ``RemoteIOError`` raised as
    ckpt's ``RemoteCheckpointError`` with the same message: ckpt raises only ckpt errors."""
    from feedpipe.io import RemoteIOError

    try:
        return call(fn, url, what=what, policy=policy, storage_options=storage_options)
    except RemoteIOError as exc:
        raise RemoteCheckpointError(str(exc), exc.url, permanent=exc.permanent) from exc


def client_options(options: RemoteOptions) -> dict[str, Any]:
    """``options.storage_options``; for S3 (the caller's values win): a connection pool with
    room for every part and file request in flight (botocore's default of 10 would cap them),
    and no request checksum computed by botocore: every data file goes with its ``Content-MD5``
    (:mod:`ckpt.tiers.s3put`), the manifest is read back, and botocore's checksum would cost the
    event loop thread that carries every transfer a pass over each part."""
    out = dict(options.storage_options or {})
    if is_s3_url(options.url):
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("max_pool_connections", max(10, 2 * options.threads + 2))
        out["config_kwargs"] = config
    return out


class RemoteStore:
    """The remote root ``options.url``: ``fs`` and ``root`` (fsspec), ``url`` (redacted, for
    messages), ``is_s3`` (whether ``ckpt.tiers.s3put`` can drive its client)."""

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options
        self.fs, self.root = resolve(options.url, client_options(options))
        self.url = redact(options.url, options.storage_options)
        self.policy = RetryPolicy(deadline_s=options.deadline_s, base_s=0.1, max_sleep_s=2.0)
        self.is_s3 = s3put.is_s3(self.fs)

    def path(self, step: int, name: str = "") -> str:
        """The fsspec path of ``step``'s prefix, or of its object ``name``."""
        return f"{self.root}/{_layout.step_name(step)}" + (f"/{name}" if name else "")

    def where(self, step: int, name: str = "") -> str:
        """``step``'s prefix or object ``name`` as a message names it (redacted URL)."""
        return f"{self.url}/{_layout.step_name(step)}" + (f"/{name}" if name else "")

    def redact(self, message: str) -> str:
        """``message`` without the credentials of the storage options."""
        return redact(message, self.options.storage_options)

    def call(self, fn: Callable[[], Any], step: int, name: str, what: str) -> Any:
        """Run one request about ``step``'s ``name`` with the retries of ``deadline_s``."""
        return transfer(
            fn,
            f"{self.options.url.rstrip('/')}/{_layout.step_name(step)}/{name}",
            what,
            self.policy,
            self.options.storage_options,
        )

    def listing(self, deadline_s: float | None = None) -> dict[int, RemoteListing]:
        """Every ``step-N`` prefix of the root; retried up to ``deadline_s`` (default: the
        options' ``deadline_s``)."""
        policy = self.policy
        if deadline_s is not None:
            policy = RetryPolicy(deadline_s=deadline_s, base_s=0.1, max_sleep_s=2.0)
        listed: dict[int, RemoteListing] = transfer(
            lambda: list_remote(self.fs, self.root),
            self.url,
            "list",
            policy,
            self.options.storage_options,
        )
        return listed

    def makedirs(self, rdir: str, step: int, name: str) -> None:
        """Create ``rdir`` where the filesystem has real directories (``file://``, a local path).
        Object stores have none, and s3fs's ``makedirs`` would even create a missing bucket."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if "file" in protocols or "local" in protocols:
            self.call(lambda: self.fs.makedirs(rdir, exist_ok=True), step, name, "mkdir")

    def manifest(self, step: int) -> bytes | None:
        """The raw manifest of ``step``, or ``None`` if it has none."""

        def get() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(self.path(step, fmt.MANIFEST)))
            except FileNotFoundError:
                return None

        result: bytes | None = self.call(get, step, fmt.MANIFEST, "read")
        return result

    def delete_step(self, step: int) -> None:
        """Delete ``step``: its manifest first (it stops being a checkpoint), then the rest."""
        manifest = self.path(step, fmt.MANIFEST)

        def rm_manifest() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(manifest)

        def rm_rest() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(step), recursive=True)

        self.call(rm_manifest, step, fmt.MANIFEST, "delete")
        self.call(rm_rest, step, "", "delete")

    def read_manifest(self, step: int) -> dict[str, Any]:
        """The validated manifest body of ``step`` (``CorruptCheckpointError`` if bad)."""
        raw = self.manifest(step)
        if raw is None:
            raise CheckpointError(f"{self.where(step)}: no manifest (not a checkpoint)")
        return self.validated(step, raw)

    def validated(self, step: int, raw: bytes) -> dict[str, Any]:
        """The manifest body in ``raw`` (``step``'s), validated in a private scratch directory;
        ``CorruptCheckpointError`` names the remote object."""
        with tempfile.TemporaryDirectory(prefix="ckpt-manifest-") as tmp:
            Path(tmp, fmt.MANIFEST).write_bytes(raw)
            try:
                return fmt.read_manifest(tmp)
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(str(exc).replace(tmp, self.where(step))) from None

    def download(self, step: int, into: Path) -> None:
        """Fetch ``step`` into the empty directory ``into``: its manifest (validated first), then
        every file it names, each created new (``O_EXCL``) and fsynced: ``into`` is the temp that
        the caller publishes, and what a crash leaves in it is only ckpt's own names.

        Every write goes through ``into`` opened once (``O_NOFOLLOW``) and the directories below
        it, each opened once through its parent (:mod:`feedpipe.io.dirfd`): one swapped for a
        symlink meanwhile is never written through. A symlink or a file on the way, an entry
        there already, a directory removed meanwhile, or ``into`` no longer naming the directory
        written when the download ends, is a ``CheckpointError`` naming the path."""
        raw = self.manifest(step)
        if raw is None:
            raise CheckpointError(f"{self.where(step)}: no manifest (not a checkpoint)")
        body = self.validated(step, raw)
        try:
            with _open_into(into) as tree:
                _create(tree.root, fmt.MANIFEST, functools.partial(_write_all, raw))
                for rec in body["files"]:
                    name = fmt.safe_relpath(rec["name"])
                    where, leaf = tree.parent(name, create=True)
                    _create(where, leaf, functools.partial(self._get, step, name))
                tree.fsync()  # every entry durable before the caller publishes the directory
                _still(tree, into, [rec["name"] for rec in body["files"]])
        except (UnsafePathError, FileExistsError) as exc:
            raise CheckpointError(
                f"{exc.filename}: {exc.strerror}; ckpt never writes a download through a "
                "symlink, nor over an entry it did not create"
            ) from None

    def _get(self, step: int, name: str, fd: int) -> None:
        """Download ``step``'s file ``name`` into the open file ``fd`` (fsspec writes to the fd's
        own path, :func:`~feedpipe.io.dirfd.fd_path`; a retry starts the file over)."""
        rpath = self.path(step, name)
        self.call(lambda: self.fs.get_file(rpath, fd_path(fd)), step, name, "download")


def _create(where: Dir, name: str, fill: Callable[[int], object]) -> None:
    """Create ``name`` in ``where`` (new: ``O_EXCL``, never through a link), ``fill`` it through
    its fd, and fsync it."""
    fd = where.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        fill(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(data: bytes, fd: int) -> None:
    with os.fdopen(os.dup(fd), "wb") as f:
        f.write(data)


def _open_into(into: Path) -> Tree:
    """The tree rooted at the directory ``into``, opened without following a link there."""
    with Dir.at(into.parent) as parent:
        return Tree(parent.child(into.name))


def _still(tree: Tree, into: Path, names: list[str]) -> None:
    """Refuse, naming the directory, when ``into`` or a directory on the way to one of the files
    ``names`` no longer is the directory the download wrote into (replaced meanwhile)."""
    try:
        now = os.lstat(into)
    except FileNotFoundError:
        now = None
    if now is None or _ident(now) != _ident(os.fstat(tree.root.fd)):
        raise UnsafePathError(errno.ESTALE, _REPLACED, str(into))
    levels = {name.rsplit("/", i)[0] for name in names for i in range(1, name.count("/") + 1)}
    for rel in sorted(levels):
        head, _, leaf = rel.rpartition("/")
        here = tree.dir(rel)
        st = tree.dir(head).stat(leaf)
        if st is None or _ident(st) != _ident(os.fstat(here.fd)):
            raise UnsafePathError(errno.ESTALE, _REPLACED, here.path)


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
