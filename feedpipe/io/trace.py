"""NVTX ranges for Nsight Systems: stable names, opened in the thread that does the work.

Every wait for a batch, every loader stage and every ckpt phase opens a range named in
:data:`NAMES` (``feedpipe/wait``, ``feedpipe/fetch``, ``ckpt/write``, ...), so a timeline shows
the training loop's waits against the GPU's idle gaps and the worker that caused them.

**When ranges are recorded.** The decision is taken once per process, on first use:

- ``FEEDPIPE_NVTX=0``: never. ``FEEDPIPE_NVTX=1``: always, through the ``nvtx`` package
  (``ImportError`` naming the package when it is missing).
- Otherwise (the default), only when a profiler is attached: an NVTX tool such as ``nsys``
  announces itself by setting ``NVTX_INJECTION64_PATH`` in the profiled process's environment.
  Without that variable ``nvtx`` is not even imported; with it, ranges are on when ``nvtx``
  imports and its default domain is live (``nvtx.get_domain()`` is not the dummy domain that the
  package returns when no tool listens).

:func:`set_recorder` replaces the decision with any object that has ``push(name)`` and ``pop()``
(tests inject a recorder that lists the ranges per thread); ``set_recorder(None)`` turns ranges
off and :func:`reset` goes back to the decision above.

**Cost when off.** Hot paths read :func:`recorder` once (when an iterator or a feed starts) and
test the local for ``None`` around each stage: a few nanoseconds per range. :func:`span` is the
context manager for everything else (ckpt phases, a user's code); off, it returns a shared no-op
object. ``benchmarks/stall_overhead.py`` measures both.

Standard library only: ``nvtx`` is imported lazily (``pip install nvtx``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from feedpipe.io.env import env_flag
from feedpipe.io.forks import ForkLock, first_lock

__all__ = ["ENV", "NAMES", "Recorder", "active", "recorder", "reset", "set_recorder", "span"]

#: Environment variable that forces ranges on (``1``) or off (``0``).
ENV = "FEEDPIPE_NVTX"

#: Every range name feedpipe and ckpt open. Stable: tools and guides match on them.
NAMES = (
    "feedpipe/wait",
    "feedpipe/fetch",
    "feedpipe/collate",
    "feedpipe/pin",
    "feedpipe/h2d",
    "feedpipe/decode",
    "ckpt/stage",
    "ckpt/write",
    "ckpt/fsync",
    "ckpt/commit",
    "ckpt/upload",
)

_INJECTION_VARS = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")


class Recorder(Protocol):
    """Where ranges go: ``push(name)`` opens a range in the calling thread, ``pop()`` closes
    that thread's innermost one (NVTX's per-thread push/pop stack)."""

    def push(self, name: str) -> None: ...

    def pop(self) -> None: ...


class NvtxRecorder:
    """Ranges through the ``nvtx`` package, on its default domain (names appear as given)."""

    def __init__(self, nvtx: Any) -> None:
        self._domain = nvtx.get_domain()
        self._attrs: dict[str, Any] = {}
        self._push = self._domain.push_range
        self._pop = self._domain.pop_range

    def push(self, name: str) -> None:
        attrs = self._attrs.get(name)
        if attrs is None:  # one EventAttributes per name, built once (a registered string)
            attrs = self._attrs[name] = self._domain.get_event_attributes(message=name)
        self._push(attrs)

    def pop(self) -> None:
        self._pop()

    @property
    def listening(self) -> bool:
        """False on the dummy domain ``nvtx`` returns when no tool listens."""
        return type(self._domain).__name__ != "DummyDomain"


_UNSET: Any = object()
_recorder: Any = _UNSET
# a ForkLock (made on first use): a child forked while another thread decided finds it free
_LOCK: list[ForkLock] = []


def _decide() -> Recorder | None:
    """The recorder the environment asks for (see the module docstring)."""
    setting = env_flag(ENV, None)  # unset or another word: decide by the profiler
    if setting is False:
        return None
    forced = setting is True
    if not forced and not any(os.environ.get(v) for v in _INJECTION_VARS):
        return None  # no NVTX tool injected into this process: do not even import nvtx
    try:
        import nvtx
    except ImportError as exc:
        if forced:
            raise ImportError(f"{ENV}=1 needs the nvtx package: pip install nvtx") from exc
        return None
    rec = NvtxRecorder(nvtx)
    if not forced and not rec.listening:
        return None  # nvtx says no tool listens
    return rec


def recorder() -> Recorder | None:
    """The active recorder, or ``None`` while ranges are off (decided once, on first use)."""
    rec = _recorder
    if rec is _UNSET:
        with first_lock(_LOCK).lock:
            if _recorder is _UNSET:
                _set(_decide())
            rec = _recorder
    return rec  # type: ignore[no-any-return]


def active() -> bool:
    """Whether ranges are being recorded."""
    return recorder() is not None


def _set(rec: Any) -> None:
    global _recorder
    _recorder = rec
    _SPANS.clear()


def set_recorder(rec: Recorder | None) -> Recorder | None:
    """Send ranges to ``rec`` (``None``: off); returns the previous recorder.

    Objects that read :func:`recorder` when they start (a loader's iterator, a GPU feed, a
    meter) keep the recorder they saw: set it before starting them.
    """
    with first_lock(_LOCK).lock:
        previous = _recorder
        _set(rec)
    return None if previous is _UNSET else previous  # type: ignore[no-any-return]


def reset() -> None:
    """Forget :func:`set_recorder` and decide again from the environment on next use."""
    with first_lock(_LOCK).lock:
        _set(_UNSET)


class _Span:
    """A reusable range: any thread may enter it (push) and leave it (pop) at once."""

    __slots__ = ("_name", "_rec")

    def __init__(self, rec: Recorder, name: str) -> None:
        self._rec, self._name = rec, name

    def __enter__(self) -> None:
        self._rec.push(self._name)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._rec.pop()


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class _Spans(dict[str, "_Span | _NoSpan"]):
    """name -> the context manager for the current recorder (``_NO_SPAN`` while off), made on
    first use and dropped whenever the recorder changes."""

    def __missing__(self, name: str) -> _Span | _NoSpan:
        rec = recorder()
        cm: _Span | _NoSpan = _NO_SPAN if rec is None else _Span(rec, name)
        self[name] = cm
        return cm


_SPANS = _Spans()

#: ``with span("ckpt/write"): ...``: a range around the block, in the calling thread. A bound
#: ``dict.__getitem__`` (no Python frame), so a range costs two no-op calls while off.
span: Callable[[str], _Span | _NoSpan] = _SPANS.__getitem__
