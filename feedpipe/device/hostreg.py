"""Host memory registered with CUDA (``cudaHostRegister``): every registration feedpipe makes.

The shard maps of the direct DMA path (:mod:`feedpipe.device.dma`) and the worker slot buffers
(:mod:`feedpipe.loader.slots`) are page-locked here, and only here, under four rules:

1. **Never leave an error behind.** The CUDA runtime keeps a failed call's error as the thread's
   "last error", and torch reports it at its next unrelated call (a plain ``tensor.cuda()`` then
   fails with "invalid argument"). After every failed register or unregister the error is read
   back, which clears it, in the same thread and from the same runtime library torch loaded.
2. **Unregister only what was registered, once.** A :class:`Registration` is the only way to
   unregister; ``release`` is idempotent and thread-safe, and a range is never unregistered
   unless its registration succeeded.
3. **Never unmap registered memory.** A registration holds ``anchor`` (an object that keeps the
   memory mapped: the numpy view of a map, the tensor of a buffer) until it has been
   unregistered. Closing the map meanwhile only drops the owner's reference; the pages stay
   mapped, so the kernel can never hand the same addresses to a new map while CUDA still counts
   them as registered (``cudaErrorHostMemoryAlreadyRegistered``, 712, on that new map). If the
   unregister fails, the anchor is kept for the life of the process: a leak of pinned pages,
   never a stale registration.
4. **Release even when forgotten.** A registration whose owner is collected without releasing
   it is released by a ``weakref.finalize`` on the owner's handle (after the device is
   synchronized: a copy may still read the pages).

``runtime`` (a :class:`Runtime`) is injectable so that the bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from feedpipe.io.cuda import cudart_paths

__all__ = [
    "HostRegisterError",
    "Registration",
    "Runtime",
    "clear_last_error",
    "last_error",
    "live",
    "register",
    "release_when_collected",
]

log = logging.getLogger("feedpipe.gpu")

_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered: nothing is registered there any more


class HostRegisterError(RuntimeError):
    """``cudaHostRegister`` refused a range; the message names what and the ``cudaError``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Runtime(Protocol):
    """The CUDA runtime calls used here (each returns a ``cudaError_t`` as ``int``)."""

    def register(self, ptr: int, nbytes: int, flags: int) -> int: ...
    def unregister(self, ptr: int) -> int: ...
    def synchronize(self) -> None: ...
    def get_last_error(self) -> int: ...
    def peek_last_error(self) -> int: ...


def _cudart_libs() -> tuple[Any, ...]:
    """Every ``libcudart`` this process has loaded (found in its maps: torch's own instance, whose
    per-thread last error torch reads, is one of them), else the global namespace's; looked up
    until one is found, then kept."""
    global _LIBS
    if _LIBS:
        return _LIBS
    libs = []
    for path in cudart_paths():
        try:
            lib = ctypes.CDLL(path)
            lib.cudaGetLastError  # noqa: B018  (probe the symbol)
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    if not libs:
        try:
            lib = ctypes.CDLL(None)
            lib.cudaGetLastError  # noqa: B018
            libs.append(lib)
        except (OSError, AttributeError):
            pass
    _LIBS = tuple(libs)
    return _LIBS


_LIBS: tuple[Any, ...] = ()


class _TorchRuntime:
    """torch's bindings for register/unregister, and ``libcudart`` for the last error."""

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        import torch

        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
        return int(cudart.cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> int:
        import torch

        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
        return int(cudart.cudaHostUnregister(ptr))

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def get_last_error(self) -> int:
        libs = _cudart_libs()
        if libs:  # every instance: whichever torch uses is cleared
            errors = [int(lib.cudaGetLastError()) for lib in libs]
            return next((e for e in errors if e), 0)
        import torch

        try:  # no symbol to call: a kernel launch reads the error (torch checks it) and raises
            torch.empty(1, device="cuda").zero_()
        except Exception:  # the stale error, now consumed
            return -1
        return 0

    def peek_last_error(self) -> int:
        errors = [int(lib.cudaPeekAtLastError()) for lib in _cudart_libs()]
        return next((e for e in errors if e), 0)


_RUNTIME: Runtime = _TorchRuntime()
_LOCK = threading.Lock()
_LIVE: dict[int, Registration] = {}  # ptr -> registration, while registered
_STUCK: list[Any] = []  # anchors of ranges whose unregister failed: never unmapped (rule 3)


@dataclass(eq=False)
class Registration:
    """One registered range; ``release()`` unregisters it (once) and lets go of ``anchor``."""

    ptr: int
    nbytes: int
    what: str
    anchor: Any
    runtime: Runtime
    released: bool = False
    pid: int = field(default_factory=os.getpid)

    def release(self, sync: bool = True) -> bool:
        """Unregister (after synchronizing the device when ``sync``: a copy may still read the
        pages); True once nothing is registered there. Idempotent and thread-safe; never
        raises for the unregister itself (a failure is logged and cleared). In a forked child
        it does nothing: the registration is the parent's, and CUDA cannot run there."""
        if self.pid != os.getpid():  # before the lock: a fork may have copied it held
            self.released = True
            return True
        with _LOCK:
            if self.released:
                return True
            self.released = True
        try:
            if sync:
                self.runtime.synchronize()
        finally:
            ok = _unregister(self)
        return ok


def _unregister(reg: Registration) -> bool:
    err = reg.runtime.unregister(reg.ptr)
    if err != 0:
        reg.runtime.get_last_error()  # rule 1
    with _LOCK:
        _LIVE.pop(reg.ptr, None)
        if err not in (0, _NOT_REGISTERED):
            _STUCK.append(reg.anchor)  # rule 3: still registered, so never unmapped
        reg.anchor = None
    if err != 0:
        log.warning(
            "feedpipe: cudaHostUnregister of %s at 0x%x failed (cudaError %d)%s",
            reg.what,
            reg.ptr,
            err,
            "" if err == _NOT_REGISTERED else "; its memory stays mapped (and locked)",
        )
    return err in (0, _NOT_REGISTERED)


def register(
    ptr: int, nbytes: int, flags: int, what: str, anchor: Any, *, runtime: Runtime | None = None
) -> Registration:
    """Register ``nbytes`` at ``ptr`` (``cudaHostRegister`` ``flags``) and return the handle
    that unregisters it. ``anchor`` keeps the memory mapped until then (rule 3). Raises
    :class:`HostRegisterError` naming ``what`` (the runtime's last error cleared first)."""
    rt = runtime if runtime is not None else _RUNTIME
    if nbytes <= 0:
        raise ValueError(f"{what}: cannot register {nbytes} bytes")
    err = rt.register(ptr, nbytes, flags)
    if err != 0:
        rt.get_last_error()  # rule 1
        raise HostRegisterError(
            f"{what}: cudaHostRegister of {nbytes} bytes at 0x{ptr:x} failed (cudaError {err})",
            err,
        )
    reg = Registration(ptr, nbytes, what, anchor, rt)
    with _LOCK:
        _LIVE[ptr] = reg
    return reg


def release_when_collected(owner: object, reg: Registration, sync: bool = True) -> None:
    """Release ``reg`` when ``owner`` is collected, if nothing released it before (rule 4).
    Not at interpreter exit: the process's end frees its registrations."""
    weakref.finalize(owner, _release_quietly, reg, sync).atexit = False


def _release_quietly(reg: Registration, sync: bool) -> None:
    try:
        reg.release(sync)
    except Exception as exc:  # a finalizer must not raise; the unregister itself has run
        log.warning("feedpipe: releasing %s: %s", reg.what, exc)


def live() -> list[Registration]:
    """The registrations made here and not yet released (for tests and diagnostics)."""
    with _LOCK:
        return list(_LIVE.values())


def clear_last_error() -> int:
    """Read (and so clear) this thread's CUDA runtime last error; returns it (0: none)."""
    return _RUNTIME.get_last_error()


def last_error() -> int:
    """This thread's CUDA runtime last error, left in place (0: none)."""
    return _RUNTIME.peek_last_error()
