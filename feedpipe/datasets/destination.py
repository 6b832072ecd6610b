"""Local destinations of ``feedpipe convert`` and ``feedpipe stage``: which entries are a dataset's
own, and the claim both commands make before they write.

Both follow :mod:`feedpipe.io.ownership` (the one ownership rule): a destination holding anything
the tool did not write is refused, naming the entries, and nothing is written. ``stage`` writes
into its folder, so it claims it (:func:`claim_dataset_folder`, a ``.stage-owner.json`` marker);
``convert`` builds elsewhere and replaces its destination whole, so it runs the same check
without a marker (:func:`check_convert_destination`), keeping a dataset's bytes a function of
its source alone.
What a dataset folder may hold as its own (:func:`dataset_entries`):

- ``index.json`` when it parses as a feedpipe index (a user's own ``index.json`` is not ours);
- every file that index lists, and every file the caller lists (the source's index for
  ``stage``), as a regular file: a symlink is never ours;
- a directory on such a file's path, when everything inside it is ours too;
- names the caller recognises as its own temporaries (``also``).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from feedpipe.datasets.format import INDEX_NAME, parse_index
from feedpipe.datasets.writer import is_writer_file
from feedpipe.errors import DatasetError
from feedpipe.io.ownership import ForeignEntriesError, claim, foreign_entries

__all__ = [
    "CONVERT",
    "check_convert_destination",
    "claim_dataset_folder",
    "dataset_entries",
    "replace_dataset",
]

CONVERT = "convert"  # the tool named in convert's refusals (it writes no marker, see above)


def dataset_entries(
    root: str | os.PathLike[str],
    listed: Iterable[str] = (),
    also: Callable[[str], bool] = lambda name: False,
) -> Callable[[Path], bool]:
    """The ``is_ours`` predicate of a dataset folder (see the module docstring)."""
    base = Path(root)
    names = set(listed)
    index_ok = False
    raw = _regular_bytes(base / INDEX_NAME)
    if raw is not None:
        try:
            names.update(rel for _sid, rel, _n, _c in parse_index(raw, str(base)).files())
            index_ok = True
        except DatasetError:
            pass
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
        if rel == INDEX_NAME:
            return index_ok
        return rel in names or also(path.name)

    return is_ours


def claim_dataset_folder(
    path: str, tool: str, is_ours: Callable[[Path], bool], *, adopt: bool = True
) -> bool:
    """Claim ``path`` for ``tool`` by the one ownership rule, and refuse it if it holds entries
    that are not ``is_ours`` even when it carries ``tool``'s marker (a marker says "my
    directory", not "everything in it is mine"). Returns whether ``path`` holds a dataset
    (``index.json``). ``DatasetError`` names the path and the foreign entries; nothing is
    written then. ``adopt=False`` only checks: no marker is written."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise DatasetError(
            f"{path}: exists and is not a dataset folder; refusing to use it for {tool}"
            + (" (did you forget DEST?)" if path.endswith((".npy", ".npz")) else "")
        )
    try:
        if adopt:
            claim(path, tool, is_ours)
        foreign = foreign_entries(path, tool, is_ours) if st is not None else []
    except ForeignEntriesError as exc:
        foreign = exc.entries
    except ValueError as exc:  # a malformed marker
        raise DatasetError(str(exc)) from None
    if foreign:
        shown = [
            f"{n} (a symlink)" if os.path.islink(os.path.join(path, n)) else n for n in foreign
        ]
        raise DatasetError(str(ForeignEntriesError(Path(path), tool, shown)))
    return os.path.lexists(os.path.join(path, INDEX_NAME))


def check_convert_destination(
    dest: str, *, overwrite: bool, also: Callable[[str], bool] = is_writer_file
) -> bool:
    """Refuse ``dest`` unless ``feedpipe convert`` may put a new dataset there: absent, empty,
    or (with ``overwrite``) a dataset holding only its own files. Writes nothing (a conversion
    builds elsewhere and replaces ``dest`` whole, :func:`replace_dataset`). True when a
    dataset is there."""
    entries = dataset_entries(dest, also=also)
    has = claim_dataset_folder(dest, CONVERT, entries, adopt=False)
    if has and not overwrite:
        raise DatasetError(f"{dest}: a dataset already exists here (pass overwrite=True)")
    return has


def replace_dataset(
    work: str, dest: str, *, overwrite: bool, also: Callable[[str], bool] = is_writer_file
) -> None:
    """Put the finished dataset ``work`` at ``dest``: ``dest`` is checked again (only a dataset
    of ours is replaced), then ``work`` is renamed into place and the old ``dest`` removed.

    No marker goes into the dataset: its bytes depend on the source alone (the same for any
    worker count, local or uploaded), and ``convert`` never writes into ``dest``, it replaces
    it whole, so the check half of the rule is all it needs."""
    check_convert_destination(dest, overwrite=overwrite, also=also)
    if os.path.lexists(dest):
        old = f"{dest}.old-{os.getpid()}"
        os.replace(dest, old)
        os.replace(work, dest)
        shutil.rmtree(old)
    else:
        os.replace(work, dest)


def _regular_bytes(path: Path) -> bytes | None:
    """The bytes of a regular file (never through a symlink), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)
