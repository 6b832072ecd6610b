"""Where the parts of ``feedpipe.convert(fn, ...)`` go: a local folder or an fsspec URL.

Both keep the conversion's own state beside the shards, in ``STATE_DIR``: ``plan.json`` (what is
being converted) and one manifest per finished part (that part's small index). A part's shard
files are moved (local) or uploaded (remote) before its manifest is written, so a manifest means
the part is complete; :meth:`Sink.finish` writes ``index.json`` last and then removes the state.

Local: everything is built in ``DEST.partial``, renamed to ``DEST`` at the end (as
``feedpipe convert`` does). Remote: shards are uploaded to their final names at once; the
prefix is a dataset only once ``index.json`` is there.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

from feedpipe.datasets._publish import check_remote_destination
from feedpipe.datasets.destination import check_convert_destination, replace_dataset
from feedpipe.errors import DatasetError
from feedpipe.format import INDEX_NAME, Index, parse_index, write_index
from feedpipe.io.destination import is_writer_file
from feedpipe.io.fsutil import atomic_write
from feedpipe.io.remote import local_file_path
from feedpipe.remote import transfer as _remote

__all__ = ["STATE_DIR", "Sink"]

STATE_DIR = ".feedpipe-convert"
_PLAN = "plan.json"
_MANIFEST = re.compile(r"^part-(\d{5,})\.json$")
_OWN = re.compile(r"^(shard-\d{5,}\.[A-Za-z0-9_.]+|index\.json)$")


def _ours(name: str) -> bool:
    """A name a conversion writes in its folder besides the index's files (see destination)."""
    return name == STATE_DIR or is_writer_file(name)


class Sink:
    """The destination of a conversion (picklable: workers upload their own parts)."""

    def __init__(self, output: str, storage_options: Mapping[str, Any] | None) -> None:
        self.output = output.rstrip("/")
        self.options = dict(storage_options or {})
        self.remote = _remote.is_remote(self.output)
        if not self.remote:
            self.output = local_file_path(self.output)
        self.root = self.output if self.remote else self.output + ".partial"
        self.shown = _remote.redact(self.output, self.options)
        self._fs: tuple[Any, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    # ------------------------------------------------------------------ paths and I/O
    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None:
            self._fs = _remote.resolve(self.output, self.options)
        return self._fs

    def _path(self, rel: str) -> str:
        if self.remote:
            return _remote.join(self._filesystem()[1], rel)
        return os.path.join(self.root, rel)

    def _call(self, fn: Any, rel: str, what: str) -> Any:
        return _remote.call(
            fn, _remote.join(self.output, rel), what=what, storage_options=self.options
        )

    def _read(self, rel: str) -> bytes | None:
        if not self.remote:
            try:
                with open(self._path(rel), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        fs = self._filesystem()[0]
        path = self._path(rel)

        def cat() -> bytes | None:
            try:
                return bytes(fs.cat_file(path))
            except FileNotFoundError:
                return None

        return self._call(cat, rel, "read")  # type: ignore[no-any-return]

    def _write(self, rel: str, data: bytes) -> None:
        if not self.remote:
            os.makedirs(os.path.dirname(self._path(rel)), exist_ok=True)
            atomic_write(self._path(rel), data)
            return
        fs = self._filesystem()[0]
        self._call(functools.partial(fs.pipe_file, self._path(rel), data), rel, "upload")

    def _list(self, rel: str) -> list[str]:
        if not self.remote:
            try:
                return sorted(os.listdir(self._path(rel) if rel else self.root))
            except FileNotFoundError:
                return []
        fs, root = self._filesystem()
        where = _remote.join(root, rel) if rel else root
        try:
            fs.invalidate_cache(where)
            names = fs.ls(where, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in names if p.rstrip("/") != where)

    def _remove(self, rel: str) -> None:
        if not self.remote:
            path = self._path(rel)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            return
        fs = self._filesystem()[0]
        try:
            fs.rm(self._path(rel), recursive=True)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ the protocol
    def start(self, plan: dict[str, Any], *, overwrite: bool) -> dict[int, Index | None]:
        """Resume the conversion of ``plan`` found here, or start afresh; the finished parts."""
        if not self.remote and os.path.islink(self.root):
            raise DatasetError(f"{self.root}: is a symlink, not a feedpipe conversion folder")
        raw = self._read(f"{STATE_DIR}/{_PLAN}")
        if raw is not None:
            try:
                old = json.loads(raw)
            except ValueError:
                old = None
            if old == plan:
                return self._finished()
            self._clear()  # another conversion of ours was interrupted here: start over
        else:
            self._check_fresh(overwrite)
        self._write(f"{STATE_DIR}/{_PLAN}", json.dumps(plan, sort_keys=True).encode())
        return {}

    def converted(self, plan: dict[str, Any]) -> Index | None:
        """Local: the dataset at the destination if this very conversion finished there but
        was killed between the final rename and the removal of its state (which goes now).
        None: convert or resume as usual. (Remote, :meth:`start` resumes such a run.)"""
        if self.remote or os.path.lexists(self.root) or os.path.islink(self.output):
            return None
        state = os.path.join(self.output, STATE_DIR)
        try:
            with open(os.path.join(state, _PLAN), "rb") as f:
                same = json.loads(f.read()) == plan
            with open(os.path.join(self.output, INDEX_NAME), "rb") as f:
                index = parse_index(f.read(), f"{self.output}/{INDEX_NAME}")
        except (OSError, ValueError, RecursionError, AttributeError, DatasetError):
            return None
        if not same or os.path.islink(state):
            return None
        shutil.rmtree(state)
        return index

    def _check_fresh(self, overwrite: bool) -> None:
        if self.remote:
            check_remote_destination(self.output, self.options, overwrite=overwrite, also=_ours)
            if self._read(INDEX_NAME) is not None:  # replaced: no reader sees old over new
                self._remove(INDEX_NAME)
            return
        check_convert_destination(self.output, overwrite=overwrite, also=_ours)
        if os.path.lexists(self.root):
            if os.path.islink(self.root) or not os.path.isdir(self.root) or os.listdir(self.root):
                raise DatasetError(
                    f"{self.root}: exists and is not a feedpipe conversion folder; move it away"
                )
            os.rmdir(self.root)
        os.makedirs(self.root)

    def _clear(self) -> None:
        for name in self._list(""):
            if _OWN.match(name) or name == STATE_DIR:
                self._remove(name)

    def _finished(self) -> dict[int, Index | None]:
        done: dict[int, Index | None] = {}
        for name in self._list(STATE_DIR):
            m = _MANIFEST.match(name)
            raw = self._read(f"{STATE_DIR}/{name}") if m else None
            if m is None or raw is None:
                continue
            part = int(m.group(1))
            try:  # a damaged manifest: the part is converted again
                doc = json.loads(raw)
                done[part] = None if doc == {"empty": True} else parse_index(raw, name)
            except (ValueError, RecursionError, AttributeError, DatasetError):
                continue
        return done

    def put_files(self, local: str, rels: list[str]) -> None:
        """Move or upload finished shard files (then gone from ``local``)."""
        for rel in rels:
            src = os.path.join(local, rel)
            if self.remote:
                fs = self._filesystem()[0]
                dst = self._path(rel)
                self._call(functools.partial(fs.put_file, src, dst), rel, "upload")
                os.unlink(src)
            else:
                os.replace(src, self._path(rel))

    def put_part(self, part: int, local: str | None, index: Index | None) -> None:
        """Move or upload the part's remaining shard files, then its manifest (its commit)."""
        if index is not None and local is not None:
            rels = [rel for _sid, rel, _n, _c in index.files()]
            self.put_files(local, [r for r in rels if os.path.exists(os.path.join(local, r))])
        doc = {"empty": True} if index is None else index.to_json()
        self._write(f"{STATE_DIR}/part-{part:05d}.json", json.dumps(doc).encode())

    def finish(self, index: Index, *, overwrite: bool) -> None:
        """Write ``index.json`` last; drop the state and a replaced dataset's leftovers."""
        listed = {rel for _sid, rel, _n, _c in index.files()}
        if self.remote:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="feedpipe-index-") as tmp:
                write_index(tmp, index)
                with open(os.path.join(tmp, INDEX_NAME), "rb") as f:
                    self._write(INDEX_NAME, f.read())
            for name in self._list(""):
                if name != INDEX_NAME and _OWN.match(name) and name not in listed:
                    self._remove(name)
            self._remove(STATE_DIR)
            return
        write_index(self.root, index)
        replace_dataset(self.root, self.output, overwrite=overwrite, also=_ours)
        shutil.rmtree(os.path.join(self.output, STATE_DIR), ignore_errors=True)
