"""The DALI side of :mod:`feedpipe.dali`: record validation and the parallel external source.

:class:`_BatchSource` runs inside DALI's Python worker processes (``external_source`` with
``parallel=True, batch=True, batch_info=True``). It must be picklable, so it carries only the
dataset and the directory where the loader publishes one *plan* per DALI epoch: the indices this
rank reads in that epoch (``plan-<epoch>.npy``) and the indices known to be bad
(``skip-<epoch>.npy``). Every batch returns, next to the encoded images and labels, one ``meta``
row per sample: ``[requested index, index read, reason, read ns, bytes, DALI epoch]``.

A bad record (reason != 0) is replaced by the next valid record in dataset order
(``i + 1, i + 2, ...`` modulo ``len(dataset)``): deterministic, whatever the batch, rank or epoch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__: list[str] = []

OK, EMPTY, BAD_HEADER, TRUNCATED, READ_ERROR, KNOWN_BAD, DECODE_ERROR = range(7)
REASONS = {
    OK: "ok",
    EMPTY: "zero-length record",
    BAD_HEADER: "not a JPEG/PNG/WebP/BMP/TIFF/JPEG 2000/PNM image (unknown magic bytes)",
    TRUNCATED: "truncated image (end marker or declared length missing)",
    READ_ERROR: "the dataset raised while reading the record",
    KNOWN_BAD: "listed as bad in the loader state",
    DECODE_ERROR: "DALI could not decode the image",
}
_META_COLS = 6
_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"
_OTHER_MAGIC = (b"BM", b"II*\x00", b"MM\x00*", b"\x00\x00\x00\x0cjP  ", b"\xff\x4f\xff\x51")


def check_image(buf: np.ndarray) -> int:
    """Cheap sanity check of one encoded image; returns a reason code (``OK`` when plausible).

    JPEG needs SOI + a marker and an EOI marker in its last bytes; PNG its signature and a final
    IEND chunk; WebP a RIFF length that matches the record. BMP, TIFF, JPEG 2000 and PNM are only
    checked by magic. Corruption inside the entropy-coded data is left to the decoder.
    """
    n = int(buf.size)
    if n == 0:
        return EMPTY
    head = buf[:16].tobytes()
    if head[:3] == b"\xff\xd8\xff":
        return OK if b"\xff\xd9" in buf[-64:].tobytes() else TRUNCATED
    if head[:8] == _PNG_SIG:
        return OK if buf[-12:].tobytes() == _PNG_IEND else TRUNCATED
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        declared = int.from_bytes(head[4:8], "little") + 8
        return OK if declared <= n else TRUNCATED
    if head.startswith(_OTHER_MAGIC) or (head[:1] == b"P" and head[1:2] in b"123456"):
        return OK
    return BAD_HEADER


def split_sample(sample: Any) -> tuple[np.ndarray, int]:
    """``(encoded uint8 array, int label)`` from ``dataset[i]`` (tuple, dict or bare record)."""
    if isinstance(sample, dict):
        data, label = sample["data"], sample.get("label", -1)
    elif isinstance(sample, (tuple, list)):
        data, label = sample[0], sample[1]
    else:  # a dataset without labels: the record alone
        data, label = sample, -1
    return as_u8(data), int(label)


def as_u8(data: Any) -> np.ndarray:
    """A 1-D uint8 numpy view of a record (numpy array, torch tensor or bytes)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    if hasattr(data, "numpy"):
        data = data.numpy()
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)


def write_plan(root: Path, epoch: int, indices: np.ndarray, skip: list[int]) -> None:
    """Publish the plan of one DALI epoch atomically (write, then rename)."""
    for name, arr in (
        (f"skip-{epoch}.npy", np.asarray(sorted(skip), dtype=np.int64)),
        (f"plan-{epoch}.npy", np.asarray(indices, dtype=np.int64)),
    ):
        tmp = root / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, root / name)


class _BatchSource:
    """Batch-mode source callable for DALI's parallel external source (runs in its workers)."""

    def __init__(self, dataset: Any, plan_dir: str, batch_size: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.plan_dir = plan_dir
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._epoch = -1
        self._plan = np.empty(0, dtype=np.int64)
        self._skip: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_epoch=-1, _plan=np.empty(0, dtype=np.int64), _skip=set())
        return state

    def _load(self, epoch: int) -> None:
        root = Path(self.plan_dir)
        self._plan = np.load(root / f"plan-{epoch}.npy")
        self._skip = {int(i) for i in np.load(root / f"skip-{epoch}.npy")}
        self._epoch = epoch

    def __call__(self, info: Any) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        if info.epoch_idx != self._epoch:
            self._load(int(info.epoch_idx))
        lo = int(info.iteration) * self.batch_size
        hi = min(lo + self.batch_size, len(self._plan))
        if lo >= hi or (self.drop_last and hi - lo < self.batch_size):
            raise StopIteration
        images, labels, meta = [], [], []
        for index in self._plan[lo:hi].tolist():
            buf, label, row = read_valid(self.dataset, index, self._skip)
            row[5] = self._epoch
            images.append(buf)
            labels.append(np.array(label, dtype=np.int64))
            meta.append(row)
        return images, labels, meta


def read_one(dataset: Any, index: int) -> tuple[np.ndarray | None, int, int]:
    """``(record or None, label, reason)`` for one index; never raises for a bad record."""
    try:
        buf, label = split_sample(dataset[index])
    except Exception:
        return None, -1, READ_ERROR
    return buf, label, check_image(buf)


def read_valid(dataset: Any, index: int, skip: set[int]) -> tuple[np.ndarray, int, np.ndarray]:
    """Read ``index``; if it is bad, read the next valid record in dataset order instead."""
    n = len(dataset)
    start = time.perf_counter_ns()
    reason = KNOWN_BAD if index in skip else OK
    used = index
    for step in range(n):
        used = (index + step) % n
        if used in skip:
            continue
        buf, label, why = read_one(dataset, used)
        if step == 0:
            reason = why
        if why == OK and buf is not None:
            ns = time.perf_counter_ns() - start
            return buf, label, np.array([index, used, reason, ns, buf.size, -1], dtype=np.int64)
    raise RuntimeError(f"no valid record left in dataset {dataset!r} (all {n} records are bad)")
