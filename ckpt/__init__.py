"""ckpt: asynchronous, verified checkpoint I/O for PyTorch.

A save costs the training loop only a device-to-host copy into a reused pinned pool; writing,
checksumming, the atomic commit and the upload run in the background. Public names are
imported lazily (PEP 562): no import-time side effects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "CheckpointManager": "ckpt.manager",
    "save": "ckpt.simple",
    "load": "ckpt.simple",
    "CheckpointError": "ckpt.errors",
    "RemoteOptions": "ckpt.remote",
    "register_type": "ckpt.types",
}

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "RemoteOptions",
    "__version__",
    "load",
    "register_type",
    "save",
]

if TYPE_CHECKING:  # pragma: no cover
    from ckpt.errors import CheckpointError
    from ckpt.manager import CheckpointManager
    from ckpt.remote import RemoteOptions
    from ckpt.simple import load, save
    from ckpt.types import register_type


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
