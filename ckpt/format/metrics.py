"""A step's ``metrics``: at most ``MAX_METRICS`` names to finite numbers, as ``save`` stores
them (``check_metrics``) and as the validator accepts them (``metrics_problem``)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch

from ckpt.format.limits import MAX_METRICS

__all__ = ["MAX_METRICS", "check_metrics", "metrics_problem"]

_METRIC = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./:@+-]{0,127}$")
_METRIC_LIMIT = float(1 << 63)


def _value_problem(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"metrics[{name!r}]: expected a finite number, got {value!r:.80}"
    if isinstance(value, int) and not -_METRIC_LIMIT <= value <= _METRIC_LIMIT:
        return f"metrics[{name!r}]: int out of range: {value!r:.40}"
    if not math.isfinite(value):
        return f"metrics[{name!r}]: expected a finite number, got {value!r}"
    return None


def metrics_problem(metrics: Any) -> str | None:
    """Why ``metrics`` is not a valid metrics dict (the field at fault first), else ``None``."""
    if not isinstance(metrics, dict):
        return f"metrics: expected a dict of metric name -> number, got {metrics!r:.80}"
    if len(metrics) > MAX_METRICS:
        return f"metrics: {len(metrics)} metrics, over the limit of {MAX_METRICS}"
    for name, value in metrics.items():
        if not isinstance(name, str) or not _METRIC.fullmatch(name):
            return (
                f"metrics: bad metric name {name!r:.80} (letters, digits and _./:@+-, "
                "at most 128 characters)"
            )
        problem = _value_problem(name, value)
        if problem is not None:
            return problem
    return None


def check_metrics(metrics: Any) -> dict[str, Any]:
    """``metrics`` as ``save`` stores them: a dict of at most ``MAX_METRICS`` names (letters,
    digits, ``_./:@+-``) to finite numbers (a NumPy scalar or a 0-dim real tensor counts, as
    its Python number); anything else raises ``ValueError`` naming the metric. Leave a metric
    out to mark it missing."""
    if isinstance(metrics, dict):
        metrics = {name: _number(value) for name, value in metrics.items()}
    problem = metrics_problem(metrics)
    if problem is not None:
        raise ValueError(problem)
    return dict(metrics)


def _number(value: Any) -> Any:
    """A NumPy integer or float scalar, or a 0-dim integer or float tensor, as a Python number
    (anything else unchanged, for ``metrics_problem`` to judge)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):  # float(): a longdouble's item() stays a longdouble
        return float(value)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not (value.dtype == torch.bool or value.is_complex())
        and value.device.type != "meta"  # no value to read: refused as not a number
    ):
        return value.item()
    return value
