"""Functions for tests/test_convert_fn_columns.py: importable by worker processes."""

from __future__ import annotations

from typing import Any

import numpy as np


def docs(item: int) -> list[dict[str, Any]]:
    """Dict records without "data": a str, a JSON dict, ragged tokens and a fixed number."""
    return [
        {
            "text": f"doc {item}.{j} é",
            "meta": {"item": item, "j": j, "tags": ["a"] * j},
            "tokens": list(range(item + j)),
            "score": float(item) / 4,
        }
        for j in range(item % 3)
    ]


def ragged_records(item: int) -> dict[str, Any]:
    """Ragged records (a list of token ids) with a ragged side field of arrays."""
    return {"data": [item] * (item % 4 + 1), "pos": list(range(item % 3))}


def text_then_number(item: int) -> dict[str, Any]:
    """Field ``text`` is a str, except at input 5 where it is a number."""
    return {"text": 5 if item == 5 else f"t{item}"}


def a_set(item: int) -> dict[str, Any]:
    """A field no column can hold."""
    return {"ok": item, "bad": {item}}


def hostile_json(item: int) -> dict[str, Any]:
    """A JSON field that would not read back equal at input 4 (a NaN, a non-str key)."""
    meta: dict[Any, Any] = {"x": float("nan")} if item == 4 else {"x": 1.0}
    return {"data": np.full(3, item, np.int16), "meta": meta}


def lone_surrogate(item: int) -> dict[str, Any]:
    return {"text": "\ud800" if item == 2 else "fine"}


def mixed_ragged(item: int) -> dict[str, Any]:
    """Ragged int tokens given as a list first, then as int32/int64 arrays and empty lists;
    input 7 gives floats (refused: they do not fit the int64 column)."""
    if item == 7:
        return {"tokens": [0.5, 1.5]}
    if item % 3 == 0:
        return {"tokens": list(range(item))}
    return {"tokens": np.arange(item, dtype=np.int32 if item % 2 else np.int64)}


def fixed_then_longer(item: int) -> dict[str, Any]:
    return {"tokens": np.arange(4 + (item == 2), dtype=np.int32)}


def scalar_types(item: int) -> dict[str, Any]:
    """A count that is a Python int in record 0 and a numpy int32 later (widened, kept); a
    score that is a float at input 3 where record 0 had an int (refused: it would truncate)."""
    score: Any = 0.5 if item == 3 else item
    return {
        "data": np.zeros(2, np.uint8),
        "count": np.int32(item) if item else item,
        "score": score,
    }
