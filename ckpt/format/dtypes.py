"""The torch dtypes a checkpoint may hold, by the names the manifest gives them."""

from __future__ import annotations

from typing import Any

import torch

from ckpt.errors import CheckpointError

__all__ = ["TORCH_DTYPES", "torch_dtype"]

TORCH_DTYPES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)  # fmt: skip
"""The dtypes a checkpoint may hold: every dense dtype whose raw bytes round-trip."""


def torch_dtype(name: Any) -> torch.dtype:
    """Map a manifest dtype name to a supported ``torch.dtype`` (never evaluates anything)."""
    value = getattr(torch, name, None) if name in TORCH_DTYPES else None
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown torch dtype {name!r} in manifest")
    return value
