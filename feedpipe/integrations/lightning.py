"""A PyTorch Lightning callback that logs feedpipe's stall counters.

    from feedpipe.integrations.lightning import StallMonitor
    trainer = lightning.Trainer(callbacks=[StallMonitor(every_n_steps=50)])

Every ``every_n_steps`` training batches it sends to every logger of the trainer (metric names
start with ``prefix``, default ``"feedpipe/"``):

- ``stall_fraction``: the share of wall time the loop waited for input since the last log;
- ``stall_ms_per_batch``: the mean wait per batch since the last log;
- ``samples_per_s``: input samples delivered per second since the last log;
- ``wait_p99_ms``, ``input_busy``, ``outside_s`` (time between passes, outside iteration: in
  none of the above) and ``<stage>_ms`` (each stage's effective time per batch): over the whole
  run, as in :meth:`feedpipe.StallMeter.stats`.

At the end of each training epoch it logs ``meter.report()`` through :mod:`logging` (logger
``feedpipe``) on global rank 0. The meters are the ``meter`` given, or those of every
``feedpipe.DataLoader`` (anything with a ``meter`` attribute) among the trainer's train
dataloaders; with several, names get ``loader<i>/``.

Lightning is imported when this module is imported (``lightning``, else ``pytorch_lightning``);
``import feedpipe`` never imports it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from typing import Any

from feedpipe.errors import MissingExtraError
from feedpipe.stall import StallMeter

__all__ = ["StallMonitor"]

log = logging.getLogger("feedpipe")


def _import_callback() -> Any:
    for name in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise MissingExtraError(
        "feedpipe.integrations.lightning needs PyTorch Lightning ('lightning' or "
        "'pytorch_lightning'): pip install 'feedpipe[lightning]'"
    )


_Callback = _import_callback()


def _walk(obj: Any, depth: int = 0) -> Iterator[Any]:
    """Loaders inside Lightning's containers (CombinedLoader, lists, dicts)."""
    if obj is None or depth > 4:
        return
    flat = getattr(obj, "flattened", None)
    if isinstance(flat, list):
        for item in flat:
            yield from _walk(item, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _walk(item, depth + 1)
    else:
        yield obj


class StallMonitor(_Callback):  # type: ignore[misc, valid-type]
    """Log stall counters of the training input to the trainer's loggers.

    Args:
        every_n_steps: log every this many training batches (>= 1).
        meter: the :class:`~feedpipe.StallMeter` to read; default: the train dataloaders'.
        prefix: metric name prefix.
        report: log ``meter.report()`` at the end of each training epoch (global rank 0).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        meter: StallMeter | None = None,
        prefix: str = "feedpipe/",
        report: bool = True,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.report = report
        self._given = meter
        self.meters: list[StallMeter] = [meter] if meter is not None else []
        self._last: dict[int, tuple[float, float, int, int]] = {}  # id -> (stall, wall, b, s)
        self._batches = 0
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ hooks
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._given is None:
            found: dict[int, StallMeter] = {}
            for loader in _walk(getattr(trainer, "train_dataloader", None)):
                meter = getattr(loader, "meter", None)
                if meter is not None and callable(getattr(meter, "stats", None)):
                    found.setdefault(id(meter), meter)
            self.meters = list(found.values())

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches % self.every_n_steps == 0:
            self.log_now(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.report and getattr(trainer, "is_global_zero", True):
            for i, meter in enumerate(self.meters):
                name = f" (loader {i})" if len(self.meters) > 1 else ""
                log.info("feedpipe stall report%s:\n%s", name, meter.report())

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """The metrics for the interval since the last call (and run-wide ones); see above."""
        out: dict[str, float] = {}
        for i, meter in enumerate(self.meters):
            s = meter.stats()
            base = self.prefix + (f"loader{i}/" if len(self.meters) > 1 else "")
            stall0, wall0, b0, n0 = self._last.get(id(meter), (0.0, 0.0, 0, 0))
            d_stall, d_wall = s.stall_s - stall0, s.wall_s - wall0
            d_batches, d_samples = s.batches - b0, s.samples - n0
            if d_wall < 0 or d_batches < 0:  # the meter was reset: start the interval again
                d_stall, d_wall, d_batches, d_samples = s.stall_s, s.wall_s, s.batches, s.samples
            self._last[id(meter)] = (s.stall_s, s.wall_s, s.batches, s.samples)
            out[base + "stall_fraction"] = d_stall / d_wall if d_wall > 0 else 0.0
            out[base + "stall_ms_per_batch"] = 1e3 * d_stall / d_batches if d_batches else 0.0
            out[base + "samples_per_s"] = d_samples / d_wall if d_wall > 0 else 0.0
            out[base + "wait_p99_ms"] = 1e3 * s.wait_p99_s
            out[base + "outside_s"] = s.outside_s
            if s.input_busy is not None:
                out[base + "input_busy"] = s.input_busy
            for stage, st in s.stages.items():
                out[f"{base}{stage}_ms"] = 1e3 * st.effective_s
        return out

    def log_now(self, trainer: Any) -> dict[str, float]:
        """Compute :meth:`metrics` and send them to every logger of ``trainer``."""
        metrics = self.metrics()
        self.last_metrics = metrics
        if metrics:
            for logger in getattr(trainer, "loggers", []) or []:
                logger.log_metrics(metrics, step=trainer.global_step)
        return metrics
