"""The destination rule of ``feedpipe stage`` and ``feedpipe convert``: which entries of a
dataset folder are the dataset's own, and the claim made before anything is written there.

It follows :mod:`feedpipe.io.ownership` (the one ownership rule): a destination holding anything
the tool did not write is refused, naming the entries, and nothing is written. What a dataset
folder may hold as its own (:func:`folder_entries`):

- its index (``index_name``) when it parses as a feedpipe index (``index_files`` says so; a
  user's own ``index.json`` is not ours);
- every file that index lists, and every file the caller lists (the source's index for
  ``stage``), as a regular file: a symlink is never ours;
- a directory on such a file's path, when everything inside it is ours too;
- names the caller recognises as its own temporaries (``also``), such as the names a dataset
  writer creates (:func:`is_writer_file`).

The dataset side (the index parser, ``DatasetError``) is :mod:`feedpipe.datasets.destination`;
``stage`` passes the index parser of :mod:`feedpipe.remote.transfer`. Standard library only.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from feedpipe.io.dirfd import Dir, read_regular
from feedpipe.io.ownership import ForeignEntriesError, claim, foreign_entries

__all__ = ["DestinationError", "claim_folder", "folder_entries", "is_writer_file"]

# names a writer creates: shard files, their temps, and the index and its temps
_WRITER_NAME = re.compile(
    r"^(index\.json|\.index\.json\..*\.tmp|\.?shard-\d{5,}\.[A-Za-z0-9_.]+(\.tmp-[0-9a-f]{8})?)$"
)


class DestinationError(ValueError):
    """A destination that may not be used: the message names it (and the foreign entries)."""


def is_writer_file(name: str) -> bool:
    """Whether ``name`` is one a writer creates (a shard file, the index, their temps)."""
    return _WRITER_NAME.match(name) is not None


def folder_entries(
    root: str | os.PathLike[str],
    index_name: str,
    index_files: Callable[[bytes, str], Iterable[str] | None],
    listed: Iterable[str] = (),
    also: Callable[[str], bool] = lambda name: False,
) -> Callable[[Path], bool]:
    """The ``is_ours`` predicate of a dataset folder (see the module docstring).

    ``index_files(raw, source)`` is the files the index bytes ``raw`` list, or None when they
    are no feedpipe index."""
    base = Path(root)
    names = set(listed)
    index_ok = False
    raw = read_regular(base / index_name)
    if raw is not None:
        files = index_files(raw, str(base))
        if files is not None:
            names.update(files)
            index_ok = True
    dirs = {rel.rsplit("/", i)[0] for rel in names for i in range(1, rel.count("/") + 1)}

    def is_ours(path: Path) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True  # gone meanwhile
        rel = path.relative_to(base).as_posix()
        if stat.S_ISDIR(st.st_mode):
            if also(path.name):
                return True
            if rel not in dirs:
                return False
            with os.scandir(path) as it:
                return all(is_ours(Path(e.path)) for e in it)
        if not stat.S_ISREG(st.st_mode):
            return False  # a symlink, a fifo...: never ours
        if rel == index_name:
            return index_ok
        return rel in names or also(path.name)

    return is_ours


def claim_folder(
    path: str,
    tool: str,
    is_ours: Callable[[Path], bool],
    index_name: str,
    *,
    adopt: bool = True,
    at: Dir | None = None,
) -> bool:
    """Claim ``path`` for ``tool`` by the one ownership rule, and refuse it if it holds entries
    that are not ``is_ours`` even when it carries ``tool``'s marker (a marker says "my
    directory", not "everything in it is mine"). Returns whether ``path`` holds a dataset
    (``index_name``). :class:`DestinationError` names the path and the foreign entries; nothing
    is written then. ``adopt=False`` only checks: no marker is written. ``at``: the caller's open
    :class:`~feedpipe.io.dirfd.Dir` of ``path``, where the marker goes (see ``claim``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise DestinationError(
            f"{path}: exists and is not a dataset folder; refusing to use it for {tool}"
            + (" (did you forget DEST?)" if path.endswith((".npy", ".npz")) else "")
        )
    try:
        if adopt:
            claim(path, tool, is_ours, at=at)
        foreign = foreign_entries(path, tool, is_ours) if st is not None else []
    except ForeignEntriesError as exc:
        foreign = exc.entries
    except (ValueError, NotADirectoryError) as exc:  # a malformed marker, a root replaced
        raise DestinationError(str(exc)) from None
    if foreign:
        shown = [
            f"{n} (a symlink)" if os.path.islink(os.path.join(path, n)) else n for n in foreign
        ]
        raise DestinationError(str(ForeignEntriesError(Path(path), tool, shown)))
    return os.path.lexists(os.path.join(path, index_name))
