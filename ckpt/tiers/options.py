"""``RemoteOptions``: where and how the remote tier uploads (public as ``ckpt.remote``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt.tiers.s3put import MAX_PART, MIN_PART

__all__ = ["RemoteOptions"]


@dataclass(frozen=True)
class RemoteOptions:
    """Where and how checkpoints are uploaded.

    ``url``: the remote root (``s3://bucket/run``, any fsspec URL). ``storage_options``: passed to
    fsspec (credentials are redacted from every message). ``threads``: files and multipart parts
    in flight (and read-back ranges). ``block_bytes``: the largest multipart part; a file is
    cut into at least ``threads`` parts (never under S3's 5 MiB minimum), so one large file
    still uses every connection. ``verify``: ``"auto"``, ``"readback"`` or ``"size"``
    (module docstring). ``deadline_s``: how long one transfer keeps retrying transient errors.
    ``grace_s``: remote prefixes without a manifest older than this are garbage-collected (on
    S3 also multipart uploads of a step begun before and never completed).
    ``evict_before_upload``: let local retention delete steps not yet uploaded (opt-out of
    tier-aware retention). ``close_timeout_s``: how long ``close()`` waits for uploads.
    ``on_error``: ``"raise"`` (default) re-raises an upload failure from the manager's next
    ``save``/``wait``/``close``, and the next manager on the directory uploads the step again;
    ``"warn"`` logs a warning instead, training goes on, and the step is uploaded again after each
    later commit until it succeeds. Either way the local copy is kept until uploaded.
    """

    url: str
    storage_options: Mapping[str, Any] | None = None
    threads: int = 8
    block_bytes: int = 16 << 20
    verify: str = "auto"
    deadline_s: float = 300.0
    grace_s: float = 3600.0
    evict_before_upload: bool = False
    close_timeout_s: float | None = 600.0
    on_error: str = "raise"

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "warn"):
            raise ValueError(
                f"RemoteOptions.on_error must be 'raise' or 'warn', not {self.on_error!r}"
            )
        if self.verify not in ("auto", "readback", "size"):
            raise ValueError(
                f"RemoteOptions.verify must be 'auto', 'readback' or 'size', not {self.verify!r}"
            )
        if self.threads < 1 or not MIN_PART <= self.block_bytes <= MAX_PART:
            raise ValueError(
                "RemoteOptions needs threads >= 1 and 5 MiB <= block_bytes <= 5 GiB (S3 limits)"
            )
