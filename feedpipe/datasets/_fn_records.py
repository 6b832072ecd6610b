"""What ``fn`` produced, as the records of ``convert(fn, ...)``: the records of one call
(:func:`records_of`), a record's data and side fields (:func:`split_record`), and a value
checked against its column (:func:`conform`). Columns are typed as ``infer_column`` types them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from numbers import Number
from typing import Any

import numpy as np

from feedpipe.datasets.columns import encode
from feedpipe.datasets.convert_sources import infer_column, is_variable
from feedpipe.errors import DatasetError

__all__ = ["NO_DATA", "conform", "records_of", "spec_text", "split_record"]

NO_DATA: Any = object()  # a dict record without "data": the dataset has no records column
_MISMATCH: Any = object()  # conform: the value does not fit its column
_SINGLE = (Mapping, tuple, bytes, bytearray, memoryview, np.ndarray, np.generic, Number)


def records_of(produced: Any) -> Iterable[Any]:
    """The records of one ``fn(item)``: none, the one it returned, or those it yielded."""
    if produced is None:
        return ()
    if isinstance(produced, _SINGLE) or hasattr(produced, "numpy"):
        return (produced,)
    if isinstance(produced, str):
        raise DatasetError("a str record cannot be stored (encode it to bytes)")
    return produced  # type: ignore[no-any-return]


def split_record(record: Any) -> tuple[Any, dict[str, Any]]:
    """(data, side fields) of one record; data is :data:`NO_DATA` for a dict without it."""
    if isinstance(record, Mapping):
        for k in record:
            if not isinstance(k, str) or not k.isidentifier():
                raise DatasetError(f"key {k!r} cannot name a field (a Python identifier)")
        data = _plain(record["data"]) if "data" in record else NO_DATA
        return data, {k: _value(v, k) for k, v in record.items() if k != "data"}
    if isinstance(record, tuple):
        names = ["label"] if len(record) == 2 else [f"field{j}" for j in range(1, len(record))]
        rest = {n: _value(v, n) for n, v in zip(names, record[1:], strict=True)}
        return _plain(record[0]), rest
    return _plain(record), {}


def _plain(value: Any) -> Any:
    """A records value: an array, bytes, or a list of numbers (ragged)."""
    if isinstance(value, str):
        raise DatasetError(
            "a str record cannot be stored as the records (encode it to bytes, or return it "
            "in a dict under a key other than 'data': a str column)"
        )
    if value is None:
        raise DatasetError("a None record cannot be stored (to filter an input out, yield nothing)")
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    if isinstance(value, (bytes, bytearray, memoryview, list)):
        return value
    return np.asarray(value)


def _value(value: Any, name: str) -> Any:
    """A side-field value as ``infer_column`` types it (str, dict, list and bytes kept)."""
    if value is None:
        raise DatasetError(f"field {name!r} is None: a column cannot hold a missing value")
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    if isinstance(value, (str, dict, list, bytes, bytearray, memoryview)):
        return value
    return np.asarray(value)


def spec_text(spec: Any) -> str:
    """A column spec as an error shows it."""
    if isinstance(spec, str):
        return spec
    return f"{spec[0]} {list(spec[1])}".replace("None", "n")


def conform(value: Any, spec: Any, what: str) -> Any:
    """``value`` as stored in a column of ``spec`` (the first record's), else ``DatasetError``."""
    got = infer_column(value, what)
    if isinstance(spec, str):
        fit = _conform_text(value, spec, got, what)
    elif isinstance(spec, tuple):
        fit = _conform_array(value, spec, got)
    else:
        fit = value if got == spec else _MISMATCH
    if fit is not _MISMATCH:
        return fit
    hint = ""
    if isinstance(spec, tuple) and isinstance(got, tuple) and not is_variable(spec):
        hint = " (for a variable-length column, make the first record's value a list)"
    raise DatasetError(
        f"{what} is {spec_text(got)}; the first record's was {spec_text(spec)}{hint}"
    )


def _conform_text(value: Any, spec: str, got: Any, what: str) -> Any:
    """A str or json column: the value checked now (naming the input, not at flush)."""
    if spec in ("str", "json") and (got == spec or (spec == "json" and isinstance(value, list))):
        encode(spec, "uint8", (), value, what)
        return value
    return value if got == spec else _MISMATCH


def _conform_array(value: Any, spec: tuple[Any, ...], got: Any) -> Any:
    """An array column: the value cast to its dtype where that loses nothing."""
    if got == spec:
        return value
    if not isinstance(got, tuple) or not isinstance(value, (list, np.ndarray)):
        return _MISMATCH
    if is_variable(spec):  # a list or an array of any length, its rows the first's
        if len(value) == 0 or (got[1][1:] == spec[1][1:] and np.can_cast(got[0], spec[0])):
            return np.asarray(value, dtype=spec[0]).reshape(-1, *spec[1][1:])
    elif got[1] == spec[1] and np.can_cast(got[0], spec[0]):  # e.g. np.int32 in int64
        return np.asarray(value, dtype=spec[0])
    return _MISMATCH
