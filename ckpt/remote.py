"""The remote tier (``CheckpointManager(remote=...)``): its options and what it reports.

The public path of ``RemoteOptions``, ``RemoteStats``, ``UploadStatus``, ``RemoteTier`` and the
listing and status readers ``ckpt ls`` uses; the implementation lives in ``ckpt.tiers``
(``ckpt.tiers.remote`` describes the upload, its verification and remote retention).
"""

from __future__ import annotations

from ckpt.tiers.listing import RemoteListing, list_remote
from ckpt.tiers.options import RemoteOptions
from ckpt.tiers.remote import RemoteTier
from ckpt.tiers.status import STATUS_FILE, RemoteStats, UploadStatus, read_status

__all__ = [
    "STATUS_FILE",
    "RemoteListing",
    "RemoteOptions",
    "RemoteStats",
    "RemoteTier",
    "UploadStatus",
    "list_remote",
    "read_status",
]
