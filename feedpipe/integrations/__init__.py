"""Integrations of feedpipe with training frameworks; each module imports its framework lazily.

- :mod:`feedpipe.integrations.lightning`: a PyTorch Lightning callback that logs stall counters.
"""

from __future__ import annotations

__all__: list[str] = []
