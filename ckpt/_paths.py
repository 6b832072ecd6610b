"""Local checkpoint paths: a remote URL given where a local directory is expected is an error.

``CheckpointManager``, ``ckpt.save`` and ``ckpt.load`` work on local directories; remote storage
is the manager's ``remote=`` tier. A URL (``s3://b/run``), or a path that a URL collapsed into
(``Path("s3://b/run")`` is ``s3:/b/run``), must never become a local directory named ``s3:``.
``file://`` URLs name local paths and are accepted by the rule of
:func:`feedpipe.io.local_file_path`: ``file:///abs`` and ``file://localhost/abs`` are ``/abs``
(RFC 8089); a ``file://`` URL naming another host is refused like any remote URL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["local_path"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(//|/|$)")


def local_path(path: str | os.PathLike[str], what: str, hint: str) -> Path:
    """``path`` as a local ``Path``; raises ``ValueError`` naming ``what`` and ``hint`` if it is
    (or was) a remote URL."""
    from feedpipe.io import local_file_path, redact

    text = os.fspath(path)
    try:
        local = local_file_path(text)
    except ValueError as exc:
        raise ValueError(f"{what} takes a local directory: {exc}; {hint}") from None
    if local != text:
        return Path(local)
    m = _SCHEME.match(text)
    if m is not None:
        raise ValueError(
            f"{what} takes a local directory, got {redact(text)!r} (a {m.group(1)}:// URL); {hint}"
        )
    return Path(text)
