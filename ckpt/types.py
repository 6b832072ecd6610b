"""The registry of safe constructors: the classes a restore may rebuild by name.

A checkpoint stores a namedtuple or an ``Enum`` member by its class name, and loading never
imports anything: ``restore`` rebuilds the class itself only if it was registered here (by class
object, in the restoring process) with ``register_type``. Otherwise it falls back, with a
warning: a namedtuple becomes an equivalent namedtuple class (same type name and fields, so
attribute access works, but ``isinstance`` against the original is false); an ``Enum`` member
becomes its plain value (an ``IntEnum`` member compares equal to that int).
"""

from __future__ import annotations

import collections
import enum
import functools
import keyword
import warnings
from typing import Any, TypeVar

__all__ = ["register_type", "registered", "type_name"]

T = TypeVar("T", bound=type)

_REGISTRY: dict[str, type] = {}


def type_name(cls: type) -> str:
    """The name a checkpoint stores for ``cls``: ``module.qualname``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def register_type(cls: T) -> T:
    """Let restores rebuild ``cls`` (a namedtuple class or an ``Enum`` subclass) by name; returns
    ``cls``, so it also works as a class decorator."""
    if not isinstance(cls, type) or not (_is_namedtuple(cls) or issubclass(cls, enum.Enum)):
        raise TypeError(f"register_type takes a namedtuple class or an Enum subclass, not {cls!r}")
    _REGISTRY[type_name(cls)] = cls
    return cls


def registered(name: str) -> type | None:
    """The class registered under ``name``, if any (never imports)."""
    return _REGISTRY.get(name)


def make_namedtuple(name: str, fields: list[str], items: list[Any]) -> tuple[Any, ...]:
    """Rebuild a namedtuple: the registered class, else an equivalent one (with a warning)."""
    cls = registered(name)
    why = "is not registered" if cls is None else "has other fields now"
    if cls is not None and _is_namedtuple(cls) and list(cls._fields) == fields:  # type: ignore[attr-defined]
        try:
            rebuilt: tuple[Any, ...] = cls(*items)
            return rebuilt
        except Exception as exc:  # its constructor refuses the saved values
            why = f"refused the saved values ({exc!r:.200})"
    warnings.warn(
        f"ckpt: namedtuple {name} {why}; restored as an equivalent namedtuple "
        "(ckpt.register_type(cls) restores the class itself)",
        UserWarning,
        stacklevel=2,
    )
    equivalent: tuple[Any, ...] = _equivalent(name, tuple(fields))(*items)
    return equivalent


@functools.lru_cache(maxsize=256)
def _equivalent(name: str, fields: tuple[str, ...]) -> type:
    short = name.rsplit(".", 1)[-1]
    if not short.isidentifier() or keyword.iskeyword(short):
        short = "SavedTuple"
    return collections.namedtuple(short, fields)  # type: ignore[misc]


def make_enum(name: str, value: int | str) -> Any:
    """Rebuild an ``Enum`` member: of the registered class, else its plain value (a warning)."""
    cls = registered(name)
    if cls is not None and issubclass(cls, enum.Enum):
        try:
            return cls(value)
        except Exception:  # ValueError, or whatever a custom _missing_ raises
            why = f"has no member with value {value!r} now"
    else:
        why = "is not registered"
    warnings.warn(
        f"ckpt: enum {name} {why}; restored as its value {value!r} "
        "(ckpt.register_type(cls) restores the class itself)",
        UserWarning,
        stacklevel=2,
    )
    return value
