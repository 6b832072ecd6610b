"""The manifest file: a JSON body (the tree, entries and file records) framed with its own
CRC32C, ``{"crc32c":"XXXXXXXX","body":{...}}``, written last and fsynced. ``new_manifest`` builds
the body, ``write_manifest`` writes it, ``read_manifest`` reads, checksums and validates it."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from ckpt._layout import MANIFEST
from ckpt.errors import CorruptCheckpointError
from ckpt.format.limits import FORMAT_VERSION, MAX_MANIFEST_BYTES
from ckpt.format.paths import open_regular
from ckpt.format.validator import validate_manifest
from ckpt.format.writer import pwrite_all
from feedpipe.io import crc32c, to_hex

__all__ = ["MANIFEST", "new_manifest", "read_manifest", "write_manifest"]

_HEAD, _MID, _TAIL = b'{"crc32c":"', b'","body":', b"}\n"


def new_manifest(
    *,
    step: int | None,
    nbytes: int,
    tree: dict[str, Any],
    entries: list[dict[str, Any]],
    files: list[dict[str, Any]],
    metadata: dict[str, Any] | None = None,
    created: float | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A manifest body of this format version (``write_manifest`` writes it). ``step`` is
    ``None`` for a lone ``ckpt.save``; ``created`` (seconds since the epoch) is left out when
    ``None``; ``metrics`` (``check_metrics``) only when given."""
    body: dict[str, Any] = {"format": "ckpt", "version": FORMAT_VERSION, "step": step}
    if created is not None:
        body["created"] = created
    body.update(nbytes=nbytes, tree=tree, entries=entries, files=files, metadata=metadata or {})
    if metrics:
        body["metrics"] = dict(metrics)
    return body


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_manifest(
    directory: str | os.PathLike[str], body: dict[str, Any], name: str = MANIFEST
) -> Path:
    """Write ``body`` as the manifest (with its own CRC32C) into ``directory`` and fsync it."""
    canon = _canonical(body)
    text = _HEAD + to_hex(crc32c(canon)).encode() + _MID + canon + _TAIL
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, memoryview(text), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _read_bounded(path: Path) -> bytes:
    """The manifest's bytes: a regular file only, at most ``MAX_MANIFEST_BYTES``."""
    try:
        with open(open_regular(path), "rb") as f:  # never a symlink, a FIFO or a device
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:  # a (sparse) giant is refused before it is read
                raise CorruptCheckpointError(
                    f"{path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
                )
            return f.read(size)  # never more than it claimed (a growing file is cut)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: manifest missing") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CorruptCheckpointError(f"{path}: manifest is a symlink") from None


def _unframe(raw: bytes, path: Path) -> bytes:
    """The body's bytes, once the frame is intact and its CRC32C matches them."""
    start = len(_HEAD) + 8 + len(_MID)
    if not (raw.startswith(_HEAD) and raw[len(_HEAD) + 8 : start] == _MID and raw.endswith(_TAIL)):
        raise CorruptCheckpointError(f"{path}: manifest is not valid: bad framing")
    stored, body_raw = raw[len(_HEAD) : len(_HEAD) + 8], raw[start : -len(_TAIL)]
    actual = to_hex(crc32c(body_raw)).encode()
    if actual != stored:
        want = stored.decode(errors="replace")
        raise CorruptCheckpointError(
            f"{path}: manifest checksum mismatch ({actual.decode()} != {want})"
        )
    return body_raw


def read_manifest(directory: str | os.PathLike[str], name: str = MANIFEST) -> dict[str, Any]:
    """Read, checksum and validate a manifest; raises ``CorruptCheckpointError`` naming the file.

    The CRC32C covers the body's exact bytes, so any changed byte is detected.
    """
    path = Path(directory) / name
    body_raw = _unframe(_read_bounded(path), path)
    try:
        body = json.loads(body_raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest is not valid: {exc}") from None
    validate_manifest(body, path)
    checked: dict[str, Any] = body  # validate_manifest: a dict
    return checked
