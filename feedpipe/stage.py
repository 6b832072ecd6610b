"""Stage a dataset from any fsspec URL (``s3://``, ``file://``, a Lustre/NFS path) to local disk.

Files are copied in parallel, each under a temp name, verified against the index (size and
CRC32C) and renamed into place; ``index.json`` is written last, so a directory with an index is a
complete dataset. Rerunning after an interruption copies only files that are missing or wrong.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from feedpipe import _remote
from feedpipe._remote import INDEX_NAME, FileEntry

__all__ = ["StageResult", "add_arguments", "run", "stage"]

DEFAULT_WORKERS = 16


@dataclass(frozen=True)
class StageResult:
    """What :func:`stage` did: files copied, files skipped (already present and verified), bytes."""

    copied: int
    skipped: int
    bytes_copied: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_copied / 2**20 / self.seconds if self.seconds > 0 else 0.0


class _Bar:
    """A thread-safe byte counter feeding an optional tqdm bar (bytes, rate, ETA)."""

    def __init__(self, total: int, show: bool, desc: str) -> None:
        self._lock = threading.Lock()
        self._bar: Any = None
        if show:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def stage(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: bool = True,
    verify_existing: bool = True,
    deadline_s: float = 120.0,
) -> StageResult:
    """Copy the dataset at ``src`` (any fsspec URL or local path) into the local directory ``dst``.

    Files already in ``dst`` with the indexed size (and CRC32C, when ``verify_existing``) are kept;
    everything else is fetched with up to ``workers`` parallel transfers, each retried on transient
    errors until ``deadline_s``. ``index.json`` is written last. Raises
    :class:`~feedpipe._remote.RemoteError` (a :class:`~feedpipe.DatasetError`) naming the URL.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    url = os.fspath(src)
    dst = os.path.abspath(os.fspath(dst))
    fs, root = _remote.resolve(url, storage_options)
    policy = _remote.RetryPolicy(deadline_s=deadline_s)
    t0 = time.perf_counter()
    raw_index, entries = _remote.read_remote_index(fs, root, url, storage_options)
    os.makedirs(dst, exist_ok=True)
    _clean_stale_temps(dst)

    todo: list[FileEntry] = []
    for e in entries:
        if not _remote.is_complete(os.path.join(dst, e.relpath), e, check_crc=verify_existing):
            todo.append(e)
    total = sum(e.nbytes for e in todo)
    bar = _Bar(total, progress, desc=f"stage {_remote.redact(url, storage_options)}")

    def _one(e: FileEntry) -> None:
        _remote.fetch_verified(
            fs,
            _remote.join(root, e.relpath),
            _remote.join(url, e.relpath),
            os.path.join(dst, e.relpath),
            e,
            storage_options=storage_options,
            progress=bar,
            policy=policy,
        )

    try:
        # largest first keeps the pool busy at the end of the run
        todo_sorted = sorted(todo, key=lambda e: -e.nbytes)
        with ThreadPoolExecutor(
            max_workers=min(workers, max(1, len(todo))), thread_name_prefix="stage"
        ) as pool:
            futures = [pool.submit(_one, e) for e in todo_sorted]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for f in futures:
                    f.cancel()
                raise failed[0].exception()  # type: ignore[misc]
    finally:
        bar.close()
    _write_atomic(os.path.join(dst, INDEX_NAME), raw_index)
    return StageResult(len(todo), len(entries) - len(todo), total, time.perf_counter() - t0)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = _remote.temp_name(path, len(data))
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _clean_stale_temps(root: str) -> None:
    """Remove temp files left by an interrupted run whose process no longer exists."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if _remote.PART_MARK not in name:
                continue
            try:
                pid = int(name.rsplit(".", 2)[-2])
            except ValueError:
                continue
            if not _pid_alive(pid):
                try:
                    os.unlink(os.path.join(dirpath, name))
                except FileNotFoundError:
                    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``feedpipe stage SRC DST``."""
    parser.add_argument(
        "src", help="dataset URL or path (s3://bucket/ds, file:///..., /lustre/...)"
    )
    parser.add_argument("dst", help="local destination directory")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="parallel transfers")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-verify-existing", action="store_true", help="trust sizes of files already there"
    )
    parser.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint (e.g. a MinIO or local server)"
    )
    parser.add_argument("--anon", action="store_true", help="anonymous (unsigned) S3 access")


def run(args: argparse.Namespace) -> int:
    """Run ``feedpipe stage``; credentials come from the usual environment/config of the backend."""
    import sys

    from feedpipe.errors import DatasetError

    options: dict[str, Any] = {}
    if args.endpoint_url:
        options["client_kwargs"] = {"endpoint_url": args.endpoint_url}
    if args.anon:
        options["anon"] = True
    try:
        result = stage(
            args.src,
            args.dst,
            storage_options=options or None,
            workers=args.workers,
            progress=not args.no_progress,
            verify_existing=not args.no_verify_existing,
        )
    except DatasetError as exc:
        print(f"feedpipe stage: {exc}", file=sys.stderr)
        return 1
    print(
        f"staged {args.dst}: {result.copied} files copied ({result.bytes_copied / 2**20:.1f} MiB, "
        f"{result.mb_per_s:.1f} MiB/s), {result.skipped} already present"
    )
    return 0
