"""The unit of work of ``convert(fn, ...)``: a part's inputs (:class:`Task`), and how an error
names the function and an input."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from feedpipe.io.remote import redact

__all__ = ["Task", "describe_input", "fn_name", "short", "unwrap"]


@dataclass(frozen=True)
class Task:
    """One part: ``items`` are the inputs ``first..first + len(items) - 1``."""

    part: int
    first: int  # index of the part's first input
    items: list[Any]

    def holds(self, number: int) -> bool:
        """Whether input ``number`` is one of this part's."""
        return self.first <= number < self.first + len(self.items)


def describe_input(tasks: Sequence[Task], number: int) -> str:
    """``input N (repr)``, as an error names input ``number``."""
    for t in tasks:
        if t.holds(number):
            return f"input {number} ({short(t.items[number - t.first])})"
    return f"input {number}"


def short(item: Any) -> str:
    """An input as an error shows it: redacted whole, then cut (a cut first could leave a
    URL's password without the "@" that marks it)."""
    text = redact(repr(item))
    return text if len(text) <= 80 else text[:77] + "..."


def unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function under ``functools.partial`` layers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def fn_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of ``fn`` (``partial(...)`` around it for a partial)."""
    inner = unwrap(fn)
    name = type(inner).__name__
    name = f"{getattr(inner, '__module__', '?')}:{getattr(inner, '__qualname__', name)}"
    return name if inner is fn else f"partial({name})"
