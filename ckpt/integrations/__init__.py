"""Integrations of ckpt with training frameworks; each module imports its framework lazily.

- :mod:`ckpt.integrations.lightning`: a PyTorch Lightning ``CheckpointIO`` plugin.
"""

from __future__ import annotations

__all__: list[str] = []
