"""The bad-record policy of an :class:`~feedpipe.dali.ImageLoader` (:class:`BadRecords`), and how
a dataset and one of its records are named in errors (:func:`describe`, :func:`locate`)."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np

from feedpipe.dali import source
from feedpipe.dali.pipeline import build_probe
from feedpipe.errors import DatasetError

__all__ = ["BadRecords", "describe", "locate"]


class BadRecords:
    """Bad records of one loader's dataset: ``on_error="raise"`` raises a
    :class:`~feedpipe.errors.DatasetError` naming dataset, shard and record; ``"skip"`` replaces
    each by the next valid record, counts it (``skipped``) and remembers its index (``indices``,
    kept in the loader's state so a resumed run replaces the same records)."""

    def __init__(self, dataset: Any, on_error: str) -> None:
        self.dataset = dataset
        self.on_error = on_error
        self.indices: set[int] = set()
        self.skipped = 0  # bad records replaced so far (one per replaced sample)
        self._probe: Any = None  # a CPU decode of one record

    def known(self) -> list[int]:
        """The bad indices known so far, in order (what a segment's workers skip)."""
        return sorted(self.indices)

    def account(self, meta: np.ndarray) -> None:
        """Raise for bad records of a batch (``on_error="raise"``) or count them (``"skip"``)."""
        for requested, used, reason in meta[:, :3].tolist():
            if requested == used:
                continue
            if self.on_error == "raise" and reason != source.KNOWN_BAD:
                raise self.error(requested, reason)
            self.skipped += 1
            self.indices.add(requested)

    def error(self, index: int, reason: int, cause: BaseException | None = None) -> DatasetError:
        """The error for bad record ``index`` (``reason``: one of :data:`source.REASONS`)."""
        if reason == source.READ_ERROR and cause is None:
            try:
                self.dataset[index]
            except Exception as exc:
                cause = exc
        err = DatasetError(
            f"bad image in dataset {describe(self.dataset)}, {locate(self.dataset, index)} "
            f"(index {index}): {source.REASONS[reason]}"
            + (
                f": {type(cause).__name__}: {cause}"
                if reason == source.READ_ERROR and cause
                else ""
            )
        )
        err.__cause__ = cause
        return err

    def replace(
        self, batch: np.ndarray, exc: Exception, seg_id: int
    ) -> tuple[list[np.ndarray], list[int], list[np.ndarray]]:
        """DALI failed on ``batch``: each record decoded alone on the CPU, an undecodable one
        replaced by the next valid one (or raised for); the encoded buffers, labels and meta
        rows of the batch to decode again."""
        bufs, labels, rows = [], [], []
        for index in batch.tolist():
            while True:
                buf, label, row = source.read_valid(self.dataset, index, self.indices)
                if self.decodes(buf):
                    break
                used = int(row[1])
                if self.on_error == "raise":
                    raise self.error(used, source.DECODE_ERROR, exc)
                self.indices.add(used)  # the next read_valid moves past it
            if int(row[1]) != index and int(row[2]) == source.OK:
                row[2] = source.DECODE_ERROR
            row[5] = seg_id
            bufs.append(buf)
            labels.append(label)
            rows.append(row)
        return bufs, labels, rows

    def decodes(self, buf: np.ndarray) -> bool:
        """Whether DALI's CPU decoder takes ``buf``."""
        if self._probe is None:
            self._probe = build_probe()
        self._probe.feed_input("encoded", [buf])
        try:
            self._probe.run()
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)  # its frames would hold the pipeline
            self._probe = build_probe()  # a failed pipeline is not reused (dropped here)
            return False
        return True

    def close(self) -> None:
        """Drop the probe pipeline."""
        self._probe = None


def describe(dataset: Any) -> str:
    """The dataset's path, root or URL, else its type's name."""
    for attr in ("path", "root", "url"):
        value = getattr(dataset, attr, None)
        if value is not None:
            return str(value)
    return type(dataset).__name__


def locate(dataset: Any, index: int) -> str:
    """``"shard S (file), record R"`` when the dataset can tell, else ``"record I"``."""
    find = getattr(dataset, "locate", None)
    if callable(find):
        try:
            shard, record = find(index)
            return f"shard {shard}, record {record}"
        except Exception:
            pass
    shards = getattr(getattr(dataset, "index", None), "shards", None)
    if isinstance(shards, list):  # a feedpipe MemmapDataset index: shards with record counts
        start = 0
        for sid, shard in enumerate(shards):
            records = int(getattr(shard, "records", 0))
            if start <= index < start + records:
                data = getattr(shard, "files", {}).get("data")
                name = f" ({data.path})" if data is not None else ""
                return f"shard {sid}{name}, record {index - start}"
            start += records
    return f"record {index}"
