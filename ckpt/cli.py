"""The ``ckpt`` command: ``ckpt ls|verify|gc DIR``.

``ls`` lists committed steps (size, files, creation time, ``latest``, upload status when a remote
tier is configured) and leftovers without reading data; ``verify`` checks every data file's
CRC32C (exit status 1 if any step is bad);
``gc`` removes leftovers of interrupted saves and all but the newest ``--keep-last`` steps (never
the newest step that verifies, never a step being read), under the directory's writer lock.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ckpt import _commit
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError

__all__ = ["main"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _verify(path: Path) -> tuple[bool, str, int]:
    t0 = time.perf_counter()
    try:
        with _commit.reading(path):
            body = fmt.read_manifest(path)
            for rec in body["files"]:
                fmt.verify_file(path, rec)
            meta = body.get("metadata")
            if isinstance(meta, dict) and "dcp" in meta and not body["entries"]:  # a DCP step
                from ckpt.dcp import check_bytes_items  # byte items load as dcp.load would

                check_bytes_items(path)
    except CheckpointError as exc:
        return False, str(exc), 0
    nbytes = sum(rec["size"] for rec in body["files"])
    dt = time.perf_counter() - t0
    rate = nbytes / max(dt, 1e-9) / 1e9
    return True, f"ok ({_size(nbytes)} in {dt:.2f} s, {rate:.2f} GB/s)", nbytes


def _ls(root: Path) -> int:
    from ckpt.remote import read_status

    latest = _commit.read_latest(root)
    uploads = read_status(root)
    print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'created':<19}  {'upload':<9}  status")
    for step in _commit.steps(root):
        path = _commit.step_dir(root, step)
        try:
            body = fmt.read_manifest(path)
        except CorruptCheckpointError as exc:
            print(f"{step:>10}  {'?':>10}  {'?':>5}  {'?':<19}  {'-':<9}  BAD: {exc}")
            continue
        size = sum(rec["size"] for rec in body["files"])
        created = body.get("created")
        when = (
            datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
            if isinstance(created, (int, float))
            else "-"
        )
        mark = "committed" + (", latest" if step == latest else "")
        up = uploads.get(step, {})
        if up.get("reason"):
            mark += f" (upload: {up['reason']})"
        up_state = str(up.get("state", "-"))
        files = len(body["files"])
        print(f"{step:>10}  {_size(size):>10}  {files:>5}  {when:<19}  {up_state:<9}  {mark}")
    for path in _commit.leftovers(root):
        print(f"{'-':>10}  {'':>10}  {'':>5}  {'':<19}  {'':<9}  leftover: {path.name}")
    return 0


def _verify_cmd(root: Path, only: int | None) -> int:
    chosen = _commit.steps(root) if only is None else [only]
    if not chosen:
        print(f"{root}: no committed checkpoints")
        return 1
    bad = 0
    for step in chosen:
        ok, msg, _ = _verify(_commit.step_dir(root, step))
        bad += not ok
        print(f"step {step}: {'OK' if ok else 'FAILED'}: {msg}")
    return 1 if bad else 0


def _gc(root: Path, keep_last: int, dry_run: bool) -> int:
    lock = _commit.WriterLock(root)
    lock.acquire()
    try:
        if dry_run:
            for path in _commit.leftovers(root):
                print(f"would remove leftover {path.name}")
        else:
            for path in _commit.remove_leftovers(root):
                print(f"removed leftover {path.name}")
        committed = _commit.steps(root)
        protected = None
        for step in reversed(committed):  # the newest step that verifies is never deleted
            if _verify(_commit.step_dir(root, step))[0]:
                protected = step
                break
        for step in committed[:-keep_last]:
            if step == protected:
                print(f"kept step {step} (newest valid checkpoint)")
            elif dry_run:
                print(f"would delete step {step}")
            elif _commit.evict(root, step):
                print(f"deleted step {step}")
            else:
                print(f"kept step {step} (being read)")
    finally:
        lock.release()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckpt`` command."""
    parser = argparse.ArgumentParser(prog="ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_ls = sub.add_parser("ls", help="list steps, sizes and status")
    p_ls.add_argument("directory", type=Path)
    p_verify = sub.add_parser("verify", help="check every checksum")
    p_verify.add_argument("directory", type=Path)
    p_verify.add_argument("--step", type=int, default=None, help="only this step")
    p_gc = sub.add_parser("gc", help="remove leftovers and old steps")
    p_gc.add_argument("directory", type=Path)
    p_gc.add_argument("--keep-last", type=int, default=3)
    p_gc.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    root: Path = args.directory
    if not root.is_dir():
        print(f"ckpt: {root}: no such directory", file=sys.stderr)
        return 2
    try:
        if args.command == "ls":
            return _ls(root)
        if args.command == "verify":
            return _verify_cmd(root, args.step)
        if args.keep_last < 1:
            parser.error("--keep-last must be >= 1")
        return _gc(root, args.keep_last, args.dry_run)
    except CheckpointError as exc:
        print(f"ckpt: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
