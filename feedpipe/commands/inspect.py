"""``feedpipe inspect PATH [--verify]``: print a dataset's index; ``--verify`` checks every file.

Exit status: 0 when the index is valid (and, with ``--verify``, every file has its indexed size and
CRC32C), 1 on any problem; each problem is printed naming the file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from feedpipe.errors import DatasetError
from feedpipe.format import FieldSpec, Index, read_index
from feedpipe.io.cliargs import (
    add_storage_arguments,
    format_bytes,
    non_negative_int,
    storage_options,
)
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.io.remote import local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["add_arguments", "describe", "run", "verify"]

_CHUNK = 8 << 20


def _field(f: FieldSpec) -> str:
    if f.kind in ("str", "json"):
        return f.kind
    if f.kind == "ragged":
        return f"{f.dtype}{[None, *f.shape]}"
    return f"{f.dtype}{list(f.shape) if f.shape else ''}"


def describe(index: Index, path: str, max_shards: int = 10) -> str:
    """A human-readable summary of an index."""
    lay = index.layout
    layout = {
        "fixed": f"fixed {list(lay.shape)} {lay.dtype} ({format_bytes(lay.record_bytes)}/record)",
        "bytes": "bytes (variable-length records)",
        "ragged": f"ragged {[None, *lay.shape]} {lay.dtype} (variable-length arrays)",
        "none": "none (a record is its fields)",
    }[lay.kind]
    lines = [
        f"dataset   {path}",
        f"format    feedpipe.memmap v{index.version}",
        f"layout    {layout}",
        f"records   {index.num_records:,}",
        f"shards    {len(index.shards)}",
        f"size      {format_bytes(index.total_bytes)} in {sum(1 for _ in index.files())} files",
    ]
    if index.fields:
        lines.append("fields    " + ", ".join(f"{n}: {_field(f)}" for n, f in index.fields.items()))
    for key, value in index.extra.items():
        text = repr(value)
        if isinstance(value, list) and len(value) > 8:
            text = f"{len(value)} entries: {value[:8]!r}..."
        lines.append(f"{key:<9} {text[:200]}")
    lines.append("")
    lines.append(f"{'shard':>6} {'records':>10} {'bytes':>12}  files")
    for sid, shard in enumerate(index.shards[:max_shards]):
        nbytes = sum(f.bytes for f in shard.files.values())
        names = ", ".join(f.path for f in shard.files.values())
        lines.append(f"{sid:>6} {shard.records:>10,} {nbytes:>12,}  {names}")
    if len(index.shards) > max_shards:
        lines.append(f"   ... {len(index.shards) - max_shards} more shards")
    return "\n".join(lines)


def verify(index: Index, root: str, fs: Any = None) -> Iterator[tuple[str, str]]:
    """Check every file's size and CRC32C; yield ``(path, problem)`` for each mismatch."""
    for _sid, rel, nbytes, crc in index.files():
        path = f"{root.rstrip('/')}/{rel}"
        try:
            with fs.open(path, "rb") if fs is not None else open(path, "rb", buffering=0) as f:
                value, size = 0, 0
                while True:
                    chunk = f.read(_CHUNK)
                    if not chunk:
                        break
                    value = crc32c(chunk, value)
                    size += len(chunk)
        except FileNotFoundError:
            yield path, "missing"
            continue
        if size != nbytes:
            yield path, f"size {size} bytes, index says {nbytes}"
        elif to_hex(value) != crc:
            yield path, f"crc32c {to_hex(value)}, index says {crc}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="dataset directory (local path or fsspec URL)")
    parser.add_argument("--verify", action="store_true", help="check size and CRC32C of every file")
    parser.add_argument(
        "--shards", type=non_negative_int, default=10, help="shard rows to print (default 10)"
    )
    add_storage_arguments(parser)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    path = os.fspath(args.path)
    fs = None
    root = path
    if _remote.is_remote(path):
        fs, root = _remote.resolve(path, storage_options(args))
    if fs is None:
        try:
            root = path = local_file_path(path)
        except ValueError as exc:  # a file: URL that is not local (the message is redacted)
            raise DatasetError(str(exc)) from None
    index = read_index(root, fs=fs)  # errors: one redacted line from the CLI's handler
    redact = _remote.redact
    print(describe(index, redact(path), args.shards), file=out)
    if not args.verify:
        return 0
    problems = list(verify(index, root, fs))
    for bad, problem in problems:
        print(f"FAILED {redact(str(bad))}: {redact(str(problem))}", file=out)
    nfiles = sum(1 for _ in index.files())
    if problems:
        print(f"verify: {len(problems)} of {nfiles} files do not match the index", file=out)
        return 1
    print(f"verify: all {nfiles} files match ({format_bytes(index.total_bytes)})", file=out)
    return 0
