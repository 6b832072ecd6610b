"""A PyTorch Lightning ``CheckpointIO`` plugin that writes ckpt checkpoints.

    from ckpt.integrations.lightning import CkptCheckpointIO
    trainer = lightning.Trainer(plugins=[CkptCheckpointIO()])

Each Lightning checkpoint path (``.../epoch=0-step=100.ckpt``) becomes a ckpt checkpoint
*directory* (``manifest.json`` + ``data.bin``, format v1, CRC32C-verified, no pickle). With
``async_save=True`` (default) :meth:`CkptCheckpointIO.save_checkpoint` blocks only while every
tensor is copied to host memory; the write, checksums, fsync and atomic rename run on one
background thread. A background failure is raised by the next ``save_checkpoint``,
``load_checkpoint``, ``remove_checkpoint`` or ``teardown`` call. ``remove_checkpoint`` and
``load_checkpoint`` first wait for a save in flight to the same path.

Because nothing is pickled, a checkpoint may hold only tensors, numpy arrays, Python scalars,
strings, bytes, dicts/lists/tuples and objects with ``state_dict()``. Hyperparameters that are
arbitrary objects raise :class:`ckpt.CheckpointError` naming their path in the checkpoint dict.

Lightning is imported when this module is imported (``lightning``, else ``pytorch_lightning``);
``import ckpt`` never imports it.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ckpt._paths import local_path
from ckpt.errors import CheckpointError
from ckpt.simple import load, save
from feedpipe.io.remote import is_url

__all__ = ["CkptCheckpointIO"]


def _import_checkpoint_io() -> Any:
    for name in ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io"):
        try:
            return importlib.import_module(name).CheckpointIO
        except ImportError:
            continue
    raise ImportError(
        "ckpt.integrations.lightning needs PyTorch Lightning ('lightning' or "
        "'pytorch_lightning'): pip install 'feedpipe[lightning]'"
    )


_CheckpointIO = _import_checkpoint_io()


def _snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are host copies (the blocking part of an async save)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v) for v in obj)
    return obj


def _local(path: Any) -> str:
    """A local path (``file://`` stripped); a remote URL is an error, not a local directory."""
    key: str = os.fspath(path)
    if key[:5].lower() == "file:":  # the rule of feedpipe.io.local_file_path
        return str(local_path(key, "CkptCheckpointIO", "checkpoint to a local path"))
    if is_url(key):
        from feedpipe.io import redact

        raise ValueError(
            f"CkptCheckpointIO writes local directories, got the URL {redact(key)!r}: checkpoint "
            "to a local path and upload with ckpt.CheckpointManager(remote=...)"
        )
    return key


class CkptCheckpointIO(_CheckpointIO):  # type: ignore[misc, valid-type]
    """Lightning ``CheckpointIO`` backed by :func:`ckpt.save` / :func:`ckpt.load`.

    Args:
        async_save: copy tensors to host memory, then write in the background (default); with
            ``False`` every save is durable when ``save_checkpoint`` returns.
        verify: check every chunk's CRC32C when loading (default True).
    """

    def __init__(self, async_save: bool = True, verify: bool = True) -> None:
        super().__init__()
        self.async_save = async_save
        self.verify = verify
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[Path]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ CheckpointIO API
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` as a ckpt directory at ``path`` (in the background if async)."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not take storage_options, got {storage_options!r}"
            )
        self._raise_error()
        key = _local(path)
        self._wait_for(key)
        if not self.async_save:
            save(key, checkpoint, metadata={"writer": "ckpt.integrations.lightning"})
            return
        snapshot = _snapshot(checkpoint)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-lightning")
        future = self._executor.submit(
            save, key, snapshot, metadata={"writer": "ckpt.integrations.lightning"}
        )
        with self._lock:
            self._pending[key] = future
        future.add_done_callback(functools.partial(self._done, key))

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the ckpt directory at ``path`` (verified unless ``verify=False``).

        ``map_location`` may be a device or device string; anything else Lightning passes (a
        callable or a dict) loads to the CPU. ``weights_only`` is accepted and always true in
        effect: a ckpt checkpoint holds no pickled objects.
        """
        key = _local(path)
        self._wait_for(key)
        self._raise_error()
        if not (map_location is None or isinstance(map_location, (str, torch.device))):
            map_location = "cpu"
        state = load(key, map_location=map_location, verify=self.verify)
        if not isinstance(state, dict):
            raise CheckpointError(f"{key}: not a Lightning checkpoint (top level is not a dict)")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint directory at ``path`` (after its save in flight, if any)."""
        key = _local(path)
        self._wait_for(key)
        if os.path.isdir(key):
            shutil.rmtree(key)
        elif os.path.exists(key):
            os.remove(key)

    def teardown(self) -> None:
        """Wait for every save in flight, stop the writer thread, raise a background error."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ helpers
    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save in flight is durable; raise the first background error."""
        with self._lock:
            futures = list(self._pending.items())
        for key, future in futures:
            future.exception(timeout)  # waits; raises TimeoutError if still running
            self._done(key, future)
        self._raise_error()

    def _wait_for(self, key: str) -> None:
        with self._lock:
            future = self._pending.get(key)
        if future is not None:
            future.exception()  # waits; the error is recorded by _done and raised by the caller
            self._done(key, future)

    def _done(self, key: str, future: Future[Path]) -> None:
        """Record a finished save once (from its callback or from a waiter, whichever is first)."""
        exc = future.exception()
        with self._lock:
            if self._pending.get(key) is not future:
                return
            del self._pending[key]
            if exc is not None and self._error is None:
                self._error = CheckpointError(f"background save to {key} failed: {exc}")
                self._error.__cause__ = exc

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
