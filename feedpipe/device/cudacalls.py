"""CUDA event and stream calls that keep the GIL: the device feed's per-batch calls.

torch's bindings let the GIL go around every CUDA call (``Event.record``, ``Event.query``,
``Stream.wait_event``). The call itself is short, but a thread that lets the GIL go while worker
threads are busy must then win it back, which takes far longer (docs/benchmarks.md, "Small
batches to the GPU"; ``benchmarks/diagnostics/gil_handoff.py``), and the feed
made about ten such calls per batch. The same hand-off after the meter's last event, before the
training step's first launch, is device idle that no event can see.

:class:`CudaCalls` makes these calls through torch's own ``libcudart``, loaded with
``ctypes.PyDLL``, which keeps the GIL for the length of the call. The handles are torch's
(``Event.cuda_event``, ``Stream.cuda_stream``): torch's events, streams and caching allocator
are used as before; only who holds the GIL during the call changes.

**Opt-in for now**: ``FEEDPIPE_CUDA_KEEP_GIL=1`` turns it on; unset (or ``0``), every call goes
through torch. It has not yet been measured or tested on a GPU (no GPU machine could be had the
stop it was written; docs/benchmarks.md, "Small batches to the GPU"), so it stays
off until it has. Even when on, it falls back to torch's own call (same effect, GIL released):

- where no ``libcudart`` is mapped in the process (a torch with CUDA linked statically);
- for an event torch has not created yet (torch creates one at its first record);
- for an event or stream of a device other than the calling thread's current one: the runtime
  reads a null stream as the current device's, and a call from a thread whose current device
  has no context yet would create one there (a rank that never called ``set_device`` would
  then hold memory on GPU 0); torch's call sets the device around the call.

A failed call raises ``RuntimeError`` naming the call and the CUDA error, after clearing the
thread's last CUDA error (as torch does) so that torch's next check does not report it again.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from feedpipe.io.cuda import cudart_paths
from feedpipe.io.env import env_flag

__all__ = ["CudaCalls", "cuda_calls", "load_cudart"]

_SUCCESS, _NOT_READY = 0, 600  # cudaSuccess, cudaErrorNotReady


def load_cudart() -> Any | None:
    """torch's ``libcudart`` as a ``PyDLL`` (the one of torch's CUDA major version first), or
    None where none is mapped or its symbols are missing (call it after CUDA is initialised)."""
    import torch

    major = (torch.version.cuda or "").split(".")[0] or None
    paths = cudart_paths()
    if major:
        paths.sort(key=lambda p: f"libcudart.so.{major}" not in p)
    for path in paths:
        try:
            lib = ctypes.PyDLL(path)
            lib.cudaEventRecord  # noqa: B018  (probe the symbols)
            lib.cudaStreamWaitEvent  # noqa: B018
        except (OSError, AttributeError):
            continue
        return lib
    return None


class CudaCalls:
    """``record``, ``wait``, ``query`` and ``elapsed_ms`` on torch events and streams, made with
    the GIL held through ``lib`` (a ``PyDLL`` of ``libcudart``), or by torch when ``lib`` is
    None or the objects need torch (module docstring)."""

    def __init__(self, lib: Any | None) -> None:
        import torch

        self._current_device = torch.cuda.current_device
        self.lib = lib
        if lib is None:
            return
        vp, c_int = ctypes.c_void_p, ctypes.c_int
        self._record = _bind(lib.cudaEventRecord, [vp, vp])
        self._wait = _bind(lib.cudaStreamWaitEvent, [vp, vp, ctypes.c_uint])
        self._query = _bind(lib.cudaEventQuery, [vp])
        self._elapsed = _bind(lib.cudaEventElapsedTime, [ctypes.POINTER(ctypes.c_float), vp, vp])
        self._last_error = _bind(lib.cudaGetLastError, [])
        self._name = lib.cudaGetErrorString
        self._name.restype, self._name.argtypes = ctypes.c_char_p, [c_int]

    def _elsewhere(self, index: int) -> bool:
        """Whether device ``index`` is not this thread's current device."""
        return bool(index != self._current_device())

    def record(self, event: Any, stream: Any) -> None:
        """``event.record(stream)``."""
        handle = event.cuda_event
        if self.lib is None or not handle or self._elsewhere(stream.device_index):
            event.record(stream)
            return
        self._check(self._record(handle, stream.cuda_stream), "cudaEventRecord")

    def wait(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)``: work queued on ``stream`` later runs after ``event``."""
        handle = event.cuda_event
        if self.lib is None or not handle or self._elsewhere(stream.device_index):
            stream.wait_event(event)
            return
        self._check(self._wait(stream.cuda_stream, handle, 0), "cudaStreamWaitEvent")

    def query(self, event: Any) -> bool:
        """``event.query()``: whether the work before its last record has completed."""
        handle = event.cuda_event
        if self.lib is None or not handle or self._elsewhere(event.device.index):
            return bool(event.query())
        code = self._query(handle)
        if code == _SUCCESS:
            return True
        if code == _NOT_READY:
            self._last_error()  # not an error: cleared, as torch clears it
            return False
        self._check(code, "cudaEventQuery")
        return False  # not reached

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """``start.elapsed_time(end)``: milliseconds between two completed records."""
        if (
            self.lib is None
            or not start.cuda_event
            or not end.cuda_event
            or self._elsewhere(start.device.index)
        ):
            return float(start.elapsed_time(end))
        ms = ctypes.c_float()
        self._check(
            self._elapsed(ctypes.byref(ms), start.cuda_event, end.cuda_event),
            "cudaEventElapsedTime",
        )
        return float(ms.value)

    def _check(self, code: int, call: str) -> None:
        if code == _SUCCESS:
            return
        self._last_error()
        name = (self._name(code) or b"unknown error").decode(errors="replace")
        raise RuntimeError(f"feedpipe GPU feed: {call} failed: CUDA error {code}: {name}")


def _bind(fn: Any, argtypes: list[Any]) -> Any:
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


_CALLS: list[CudaCalls] = []
_LOCK = threading.Lock()


def cuda_calls() -> CudaCalls:
    """The process's :class:`CudaCalls`, made once: GIL-held calls with
    ``FEEDPIPE_CUDA_KEEP_GIL=1``, torch's otherwise (call it after CUDA is initialised: torch's
    ``libcudart`` is looked up among the libraries then mapped)."""
    if _CALLS:
        return _CALLS[0]
    with _LOCK:
        if not _CALLS:
            keep = env_flag(
                "FEEDPIPE_CUDA_KEEP_GIL", False, strict=True, meaning=("torch's calls", "kept")
            )
            _CALLS.append(CudaCalls(load_cudart() if keep else None))
    return _CALLS[0]
