"""The DALI side of :mod:`feedpipe.dali`: record validation and the parallel external source.

:class:`BatchSource` runs inside DALI's Python worker processes (``external_source`` with
``parallel=True, batch=True, batch_info=True``). It must be picklable, so it carries only the
dataset and the directory where the loader publishes *segments*. The pipeline runs as one endless
DALI epoch (it is never reset); DALI's iteration counter ``g`` numbers every batch it ever asks
for. Segment ``s`` (``seg-<s>.npy``: ``[start, *indices]``, and ``skip-<s>.npy``: the indices known
to be bad) maps the iterations ``start, start + 1, ...`` to its batches of indices; a later segment
overrides earlier ones from its start on. An iteration that no segment covers yet is answered
with a one-image *filler* batch while it lies within ``gap`` iterations after the last segment
(DALI feeds one or two batches ahead of what the loader consumes), and otherwise waits until the
loader publishes the next segment (or removes the directory, at close). The loader discards the
outputs of fillers and of overridden iterations.

Every batch returns, next to the encoded images and labels, one ``meta`` row per sample:
``[requested index, index read, reason, read ns, bytes, segment]`` (segment -1: a filler).

A bad record (reason != 0) is replaced by the next valid record in dataset order
(``i + 1, i + 2, ...`` modulo ``len(dataset)``): deterministic, whatever the batch, rank or epoch.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from feedpipe.io.fsutil import atomic_write
from feedpipe.io.reaper import die_with_parent

__all__ = ["META_COLS", "BatchSource", "read_valid", "watch_owner", "write_segment"]

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
META_COLS = 6
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


# An 8x8 grey baseline JPEG (629 bytes, PIL quality 50): the image of a filler batch.
_FILLER = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb004300100b0c0e0c0a100e0d0e1211101318281a1816"
    "16183123251d283a333d3c3933383740485c4e404457453738506d51575f626768673e4d71797064785c6567"
    "63ffdb0043011112121815182f1a1a2f63423842636363636363636363636363636363636363636363636363"
    "6363636363636363636363636363636363636363636363636363ffc000110800080008030122000211010311"
    "01ffc4001f0000010501010101010100000000000000000102030405060708090a0bffc400b5100002010303"
    "020403050504040000017d01020300041105122131410613516107227114328191a1082342b1c11552d1f024"
    "33627282090a161718191a25262728292a3435363738393a434445464748494a535455565758595a63646566"
    "6768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7"
    "b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6e7e8e9eaf1f2f3f4f5f6f7f8f9faffc400"
    "1f0100030101010101010101010000000000000102030405060708090a0bffc400b511000201020404030407"
    "05040400010277000102031104052131061241510761711322328108144291a1b1c109233352f0156272d10a"
    "162434e125f11718191a262728292a35363738393a434445464748494a535455565758595a63646566676869"
    "6a737475767778797a82838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9"
    "bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae2e3e4e5e6e7e8e9eaf2f3f4f5f6f7f8f9faffda000c030100"
    "02110311003f0028a28a00ffd9"
)
_POLL_S = (0.0005, 0.005)  # first and longest sleep while a worker waits for the next segment


def write_segment(root: Path, seg: int, start: int, indices: np.ndarray, skip: list[int]) -> None:
    """Publish segment ``seg`` atomically (write, then rename; the skip list first)."""
    body = np.concatenate([[start], np.asarray(indices, dtype=np.int64)]).astype(np.int64)
    for name, arr in (
        (f"skip-{seg}.npy", np.asarray(sorted(skip), dtype=np.int64)),
        (f"seg-{seg}.npy", body),
    ):
        buf = io.BytesIO()
        np.save(buf, arr)
        atomic_write(root / name, buf.getvalue(), durable=False)  # scratch in /dev/shm


class _Segment:
    def __init__(self, root: Path, seg: int, batch_size: int, drop_last: bool) -> None:
        body = np.load(root / f"seg-{seg}.npy")
        self.id = seg
        self.start = int(body[0])
        self.indices = body[1:]
        self.skip = {int(i) for i in np.load(root / f"skip-{seg}.npy")}
        n = len(self.indices)
        self.batches = n // batch_size if drop_last else -(-n // batch_size)


class BatchSource:
    """Batch-mode source callable for DALI's parallel external source (runs in its workers)."""

    def __init__(
        self, dataset: Any, plan_dir: str, batch_size: int, drop_last: bool, gap: int
    ) -> None:
        self.dataset = dataset
        self.plan_dir = plan_dir
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.gap = gap
        self._segments: list[_Segment] = []
        self._owner = self._watched = os.getpid()  # the loader's process; where the watch is set

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_segments": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A ``spawn`` worker: watch the owner from the start, before any task comes."""
        self.__dict__.update(state)
        self._watch()

    def _watch(self) -> None:
        """Set the owner watch once in each process (``fork`` workers unpickle nothing)."""
        if self._watched != os.getpid():
            self._watched = os.getpid()
            watch_owner(self._owner)

    def _refresh(self) -> bool:
        """Load segments published since the last look; False once the loader has closed."""
        root = Path(self.plan_dir)
        while True:
            seg = len(self._segments)
            try:
                self._segments.append(_Segment(root, seg, self.batch_size, self.drop_last))
            except FileNotFoundError:
                return root.is_dir()

    def _find(self, g: int) -> tuple[_Segment | None, bool]:
        """``(segment, wait)`` for iteration ``g``: its segment, a filler (None, False) or wait."""
        for seg in reversed(self._segments):
            if seg.start <= g:
                if g < seg.start + seg.batches:
                    return seg, False
                if seg is self._segments[-1]:  # past the last segment
                    return None, g >= seg.start + seg.batches + self.gap
                return None, False  # overridden by a later segment that starts after g
        return None, not self._segments

    def __call__(self, info: Any) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """One batch: a list of encoded images, and labels and meta rows as dense arrays.

        Dense arrays (not lists of per-sample arrays) keep DALI's per-sample work in the main
        process, which feeds every batch into the pipeline, to the images alone.
        """
        self._watch()
        g = int(info.iteration)
        alive = self._refresh()  # always: a segment published since may override iteration g
        seg, wait = self._find(g)
        sleep = _POLL_S[0]
        while seg is None and wait and alive:
            time.sleep(sleep)
            sleep = min(2 * sleep, _POLL_S[1])
            alive = self._refresh()  # False once the loader closed: a filler ends the wait
            seg, wait = self._find(g)
        if seg is None:
            filler = np.frombuffer(_FILLER, dtype=np.uint8)
            rows = np.array([[-1, -1, OK, 0, 0, -1]], dtype=np.int64)
            return [filler], np.full(1, -1, dtype=np.int64), rows
        lo = (g - seg.start) * self.batch_size
        hi = min(lo + self.batch_size, len(seg.indices))
        images: list[np.ndarray] = []
        labels = np.empty(hi - lo, dtype=np.int64)
        meta = np.empty((hi - lo, META_COLS), dtype=np.int64)
        for k, index in enumerate(seg.indices[lo:hi].tolist()):
            buf, labels[k], meta[k] = read_valid(self.dataset, index, seg.skip)
            images.append(buf)
        meta[:, 5] = seg.id
        return images, labels, meta


def watch_owner(owner: int | None) -> None:
    """In a source worker (a process the loader's process ``owner`` started, by ``spawn`` or
    ``fork``): exit, with the worker's own children, as soon as the loader's
    process is gone, however it died (SIGKILL, the OOM killer), even while stuck in the dataset.

    The watch is a pidfd of the owner (:func:`~feedpipe.io.reaper.die_with_parent`): it fires
    when the whole *process* has exited, never when one of its threads ends (unlike
    ``PR_SET_PDEATHSIG``, which fires when the forking *thread* exits: DALI starts its workers
    from whichever thread first builds or runs the pipeline). A source unpickled anywhere else
    (the owner itself, a copy, a process the owner did not start) sets no watch.
    """
    if owner is None or owner == os.getpid() or os.getppid() != owner:
        return
    die_with_parent()


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
